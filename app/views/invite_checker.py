"""Runs :func:`app.core.invite_check.check_invite_server` off the GUI thread and hands the
result back on it, so the Settings dialog can say "Checking…" meanwhile.

The thread only fills a :class:`~concurrent.futures.Future`; a timer owned by the dialog
collects it. Nothing crosses threads through Qt, so a dialog closed during a check simply stops
its timer, and the finished thread touches no Qt object."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from PySide6.QtCore import QObject, QTimer, Signal

from app.core.invite_check import ServerCheck, check_invite_server

Check = Callable[[str], ServerCheck]
POLL_MS = 50


class InviteChecker(QObject):
    finished = Signal(object)  # ServerCheck

    def __init__(self, check: Check | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._check = check or check_invite_server
        self._future: Future[ServerCheck] | None = None
        self._timer = QTimer(self, interval=POLL_MS)
        self._timer.timeout.connect(self._collect)

    @property
    def running(self) -> bool:
        return self._future is not None

    def start(self, code: str) -> None:
        future: Future[ServerCheck] = Future()
        self._future = future
        check = self._check

        def run() -> None:
            try:
                future.set_result(check(code))
            except Exception as exc:  # one line, never a traceback from a thread
                future.set_result(ServerCheck("error", f"Veil could not check the server: {exc}"))

        threading.Thread(target=run, name="veil-invite-check", daemon=True).start()
        self._timer.start()

    def _collect(self) -> None:
        future = self._future
        if future is None or not future.done():
            return
        self._timer.stop()
        self._future = None
        self.finished.emit(future.result())
