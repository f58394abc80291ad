"""Veil's error types. Every exception carries the one line a user should read.

The CLI and the app catch :class:`VeilError` and show ``str(err)`` — never a traceback.
"""

from __future__ import annotations


class VeilError(Exception):
    """Base class: ``message`` is shown to the user verbatim; ``hint`` says what to do."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class ModelSpecError(VeilError):
    """The model spec names nothing Veil can load."""


class ModelLoadError(VeilError):
    """A model file exists but cannot be read (corrupt, truncated, missing tensors)."""


class UnsupportedArchitecture(VeilError):
    """The model family is not one Veil implements."""


class SplitError(VeilError):
    """The requested split (local layers) does not fit the model."""


class GenerationError(VeilError):
    """Decoding failed (bad sampling parameters, context overflow, ...)."""


class Cancelled(VeilError):
    """The user stopped generation."""

    exit_code = 130


class TransportError(VeilError):
    """The trunk server could not be reached or answered with an error."""

    exit_code = 3


class ServerBusy(TransportError):
    """The trunk server refused a session because it is full."""


class AuthError(TransportError):
    """The trunk server does not accept this client's key."""


class FingerprintMismatch(TransportError):
    """The server serves a different model than the client has."""


class KeyStoreError(VeilError):
    """Keys could not be read from or written to the OS keyring."""
