"""Why an error banner is shown, so it can be taken away when that cause is resolved.

Every banner the window shows carries a *cause*; :class:`~app.core.controller.AppController`
emits ``resolved(cause)`` when the cause is gone (the server answers again, the model loaded,
Settings were saved, a reply succeeded) and the banners with that cause disappear.
"""

from __future__ import annotations

from engine.errors import (
    AuthError,
    KeyStoreError,
    ModelLoadError,
    ModelSpecError,
    TransportError,
    UnsupportedArchitecture,
    VeilError,
)

CONNECTION = "connection"  # the server cannot be reached (cleared when it answers again)
INVITE = "invite"  # the invite code is damaged (cleared when Settings are saved)
MODEL = "model"  # the model cannot be loaded (cleared when a model loads)
SETTINGS = "settings"  # settings were refused (cleared when Settings are saved)
REPLY = "reply"  # a reply or a suggestion failed otherwise (cleared by the next good one)
AUDIT = "audit"  # the privacy audit failed (cleared when an audit finishes)
EXPORT = "export"  # a file could not be saved (cleared by the next good export)
DOCUMENTS = "documents"  # a file could not be read or indexed (cleared when files are read)

RECONNECTS = "Veil reconnects by itself when the server is back."


def cause_of(err: VeilError, state: str) -> str:
    """The cause an error belongs to, from its type and the connection ``state``."""
    from app.core.engine_host import NEEDS_SETUP, OFFLINE

    if state == NEEDS_SETUP:
        return INVITE
    if isinstance(err, ModelSpecError | ModelLoadError | UnsupportedArchitecture):
        return MODEL
    if isinstance(err, AuthError | KeyStoreError):
        return SETTINGS
    if isinstance(err, TransportError) or state == OFFLINE:
        return CONNECTION
    return REPLY


def explain(err: VeilError, state: str) -> VeilError:
    """``err`` as the banner shows it: a lost server also says that Veil reconnects by itself
    (only when that is true: never for a damaged invite code or a refused key)."""
    from app.core.engine_host import OFFLINE

    if state != OFFLINE or cause_of(err, state) != CONNECTION:
        return err
    hint = err.hint or ""
    if "reconnect" in hint.lower() or "restarting" in hint.lower():
        return err
    sep = " " if hint.endswith((".", "?", "!")) else (". " if hint else "")
    return VeilError(err.message, hint + sep + RECONNECTS)
