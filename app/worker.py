"""Runs :class:`~app.core.tasks.Task` objects on one QThread and calls their handlers on the GUI
thread through queued Qt signals. The engine is used by one task at a time, in order."""

from __future__ import annotations

import queue
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal

from app.core.tasks import Task, TaskContext, user_error


class _Thread(QThread):
    def __init__(self, owner: QtExecutor) -> None:
        super().__init__()
        self.owner = owner
        self.tasks: queue.Queue[Task | None] = queue.Queue()
        self.setObjectName("veil-engine")

    def _context(self, task: Task) -> TaskContext:
        o = self.owner

        def progress(stage: str, frac: float) -> None:
            o._progress.emit(task, stage, float(frac))

        def text(delta: str) -> None:
            o._text.emit(task, delta)

        def report(values: dict[str, Any]) -> None:
            o._report.emit(task, dict(values))

        def reading(done: int, total: int, seconds_left: float | None) -> None:
            o._reading.emit(task, int(done), int(total), seconds_left)

        return TaskContext(
            task.cancel, progress=progress, text=text, report=report, reading=reading
        )

    def run(self) -> None:
        o = self.owner
        while True:
            task = self.tasks.get()
            if task is None:
                return
            ctx = self._context(task)
            try:
                result = task.fn(ctx)
            except BaseException as exc:  # every failure reaches the user as one line
                o._failed.emit(task, user_error(exc))
                continue
            o._done.emit(task, result)


class QtExecutor(QObject):
    """``submit(task)`` from the GUI thread; handlers run on the GUI thread."""

    _text = Signal(object, str)
    _progress = Signal(object, str, float)
    _report = Signal(object, dict)
    _reading = Signal(object, int, int, object)
    _done = Signal(object, object)
    _failed = Signal(object, object)
    idle = Signal()  # no task is queued or running

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.pending = 0
        self.history: list[str] = []
        self._thread = _Thread(self)
        self._started = False
        self._text.connect(lambda t, d: t.on_text(d))
        self._progress.connect(lambda t, s, f: t.on_progress(s, f))
        self._report.connect(lambda t, v: t.on_report(v))
        self._reading.connect(lambda t, d, n, s: t.on_reading(d, n, s))
        self._done.connect(self._on_done)
        self._failed.connect(self._on_failed)
        # The thread starts with the first task, so an app that fails while starting up (say,
        # a damaged database) exits cleanly instead of destroying a running QThread.

    def submit(self, task: Task) -> None:
        self.pending += 1
        self.history.append(task.name)
        if not self._started:
            self._started = True
            self._thread.start()
        self._thread.tasks.put(task)

    def _finish(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.idle.emit()

    def _on_done(self, task: Task, result: Any) -> None:
        try:
            task.on_done(result)
        finally:
            self._finish()

    def _on_failed(self, task: Task, err: Any) -> None:
        try:
            task.on_error(err)
        finally:
            self._finish()

    def shutdown(self, timeout_ms: int = 30000) -> bool:
        """Let the running task end (its cancel token should be set) and stop the thread."""
        if not self._started:
            return True
        self._thread.tasks.put(None)
        return bool(self._thread.wait(timeout_ms))
