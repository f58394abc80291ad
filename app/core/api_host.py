"""The app's switch "Let other programs use Veil": the OpenAI-compatible API (``app/api``) on
127.0.0.1, over the app's own engine: the same model, server and privacy setting as the window.

Qt-free. Started and stopped from the settings (``api_enabled``, ``api_port``, ``api_token``).
"""

from __future__ import annotations

import logging
from typing import Any

from engine.errors import VeilError

log = logging.getLogger("veil.app")
API_HOST = "127.0.0.1"  # the app serves this computer only (`veil api --host` can do more)


def api_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("starlette", "uvicorn"))


class ApiService:
    def __init__(self, host: Any, settings: Any) -> None:
        self.host, self.settings = host, settings
        self.server: Any = None
        self.error = ""  # why it is not running although switched on

    @property
    def running(self) -> bool:
        return self.server is not None

    def url(self) -> str:
        return (
            self.server.url
            if self.server is not None
            else f"http://{API_HOST}:{self.settings.api_port}/v1"
        )

    def sync(self) -> None:
        """Start, restart (new port or token) or stop the server to match the settings.
        A failure (say, the port is taken) is kept in :attr:`error` and raised."""
        s = self.settings
        want = (API_HOST, int(s.api_port), str(s.api_token)) if s.api_enabled else None
        have = (
            (API_HOST, int(self.server.port), self.server.token)
            if self.server is not None
            else None
        )
        if want == have:
            return
        self.stop()
        self.error = ""
        if want is None:
            return
        if not want[2]:
            raise VeilError("the API has no token", hint="open Settings and make a new token")
        if not api_available():
            self.error = "this installation has no API server"
            raise VeilError(self.error)
        from app.api.backend import HostBackend
        from app.api.server import ApiServer

        try:
            self.server = ApiServer(HostBackend(self.host, s), want[2], API_HOST, want[1]).start()
        except VeilError as exc:
            self.error = str(exc)
            raise
        log.info("API on %s", self.server.url)

    def status_text(self) -> str:
        if self.server is not None:
            return f"Other programs can use Veil at {self.server.url}"
        if self.settings.api_enabled and self.error:
            return f"The API is not running: {self.error}"
        return "Off"

    def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            server.stop()
