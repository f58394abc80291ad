"""Background work as plain tasks, and a tiny observer type, both without Qt.

A :class:`Task` wraps a function that runs off the GUI thread. While it runs it may report
progress, streamed text and live stats through its :class:`TaskContext`; its handlers are then
called on the GUI thread (``app/worker.py`` marshals them with Qt signals). In tests without Qt,
:class:`InlineExecutor` runs tasks synchronously.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.errors import VeilError
from engine.generate import CancelToken

log = logging.getLogger("veil.app")


class Event:
    """A list of callbacks: ``connect(fn)``, ``emit(*args)``."""

    def __init__(self) -> None:
        self._subs: list[Callable[..., Any]] = []

    def connect(self, fn: Callable[..., Any]) -> None:
        self._subs.append(fn)

    def disconnect(self, fn: Callable[..., Any]) -> None:
        if fn in self._subs:
            self._subs.remove(fn)

    def emit(self, *args: Any) -> None:
        for fn in list(self._subs):
            fn(*args)


def user_error(exc: BaseException) -> VeilError:
    """Any exception as the one-line :class:`VeilError` a user should read."""
    if isinstance(exc, VeilError):
        return exc
    name = type(exc).__name__
    if isinstance(exc, MemoryError) or "OutOfMemory" in name:
        return VeilError(
            "this computer ran out of memory",
            hint="move the privacy slider to the left, or close other programs",
        )
    if isinstance(exc, ConnectionError | TimeoutError):
        return VeilError(
            f"the connection failed: {exc}",
            hint="check the network; the app retries by itself",
        )
    log.error("internal error:\n%s", "".join(traceback.format_exception(exc)))
    return VeilError(
        f"internal error: {name}: {exc}",
        hint="please report this; the details are in the log",
    )


class TaskContext:
    """What a running task can report; each call is forwarded to the GUI thread."""

    def __init__(
        self,
        cancel: CancelToken,
        progress: Callable[[str, float], None],
        text: Callable[[str], None],
        report: Callable[[dict[str, Any]], None],
        reading: Callable[[int, int, float | None], None] | None = None,
    ) -> None:
        self.cancel = cancel
        self.progress = progress
        self.text = text
        self.report = report
        # (prompt rows read, rows in the prompt, about how many seconds the rest takes)
        self.reading = reading or _ignore


def _ignore(*_: Any) -> None:
    pass


@dataclass
class Task:
    name: str
    fn: Callable[[TaskContext], Any]
    on_done: Callable[[Any], None] = _ignore
    on_error: Callable[[VeilError], None] = _ignore
    on_text: Callable[[str], None] = _ignore
    on_progress: Callable[[str, float], None] = _ignore
    on_report: Callable[[dict[str, Any]], None] = _ignore
    on_reading: Callable[[int, int, float | None], None] = _ignore
    cancel: CancelToken = field(default_factory=CancelToken)


class Executor(Protocol):
    def submit(self, task: Task) -> None: ...


class InlineExecutor:
    """Runs each task at once in the calling thread (tests, scripts)."""

    def __init__(self) -> None:
        self.history: list[str] = []

    def submit(self, task: Task) -> None:
        self.history.append(task.name)
        ctx = TaskContext(
            task.cancel, task.on_progress, task.on_text, task.on_report, task.on_reading
        )
        try:
            result = task.fn(ctx)
        except Exception as exc:
            task.on_error(user_error(exc))
            return
        task.on_done(result)
