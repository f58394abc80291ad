"""Log lines that strangers can cause, bounded: one line per source and minute, then a count.

Anyone who can reach the server's port can make it refuse handshakes, connections and messages
as fast as the network allows. :class:`LogLimiter` logs the first such event from a source
(an address, a key) in full; the next ones from it are only counted, and once a minute it
writes "N refused handshakes from ADDR in the last minute". Past ``max_sources`` sources in one
minute, new sources share one counter ("from other addresses"), so neither the log nor the
limiter's memory grows with the number of addresses an attacker uses. Socket thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

OTHERS = ""  # the shared source of events past max_sources


@dataclass
class _Window:
    start: float
    count: int = 0  # events in the window
    logged: bool = False  # the first one was logged in full


def _span(seconds: float) -> str:
    return "the last minute" if seconds >= 59.5 else f"the last {max(seconds, 1):.0f} s"


class LogLimiter:
    """Per-source rate limit for one kind of log line (see the module docstring)."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        level: int = logging.WARNING,
        window_s: float = 60.0,
        max_sources: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.what = what  # "refused handshakes", as in "N refused handshakes from ADDR"
        self.level = level
        self.window_s = window_s
        self.max_sources = max_sources
        self.clock = clock
        self._windows: dict[str, _Window] = {}

    def event(self, source: str, line: str, *args: object) -> None:
        """One event from ``source``: ``line % args`` is logged if it opens the source's
        window, else counted."""
        if source not in self._windows and len(self._windows) >= self.max_sources:
            source = OTHERS
        w = self._windows.get(source)
        if w is None:
            w = self._windows[source] = _Window(self.clock(), logged=source != OTHERS)
            if w.logged:
                self.log.log(self.level, line, *args)
        w.count += 1

    def flush(self, everything: bool = False) -> None:
        """Summarise the windows that are a minute old (all of them when ``everything``, as at
        shutdown). A source still busy gets a new window, counted without a first line."""
        now = self.clock()
        for source, w in list(self._windows.items()):
            age = now - w.start
            if age < self.window_s and not everything:
                continue
            del self._windows[source]
            if w.count > int(w.logged):
                where = f"from {source}" if source != OTHERS else "from other sources"
                self.log.log(self.level, "%d %s %s in %s", w.count, self.what, where, _span(age))
                if not everything and source != OTHERS:
                    self._windows[source] = _Window(now)
