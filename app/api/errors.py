"""Errors as OpenAI's API writes them: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from engine.errors import VeilError


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = (
            status,
            message,
            type_,
            code,
            param,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_veil(exc: VeilError) -> ApiError:
    """An engine error (server unreachable, model missing ...) as a 503 with its one line."""
    from engine.errors import GenerationError, TransportError

    if isinstance(exc, GenerationError):
        return ApiError(400, str(exc))
    if isinstance(exc, TransportError):
        return ApiError(503, str(exc), "server_error", "trunk_unavailable")
    return ApiError(503, str(exc), "server_error", "engine_unavailable")
