"""A tqdm progress bar on stderr for long CLI work (model conversion, hashing, benchmarks)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


class Eta:
    """Time left in the current stage, from how far its bar got in how long (the app's status
    line shows it; tqdm draws its own). Shown once a stage ran a few seconds and moved."""

    MIN_S = 3.0  # before this, or below 3%, there is no rate worth quoting

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.stage = ""
        self.t0 = 0.0

    def left(self, stage: str, fraction: float) -> float | None:
        """Seconds left for ``stage`` at ``fraction`` (None: too early to say, or done)."""
        now = self.clock()
        if stage != self.stage:
            self.stage, self.t0 = stage, now
        elapsed = now - self.t0
        if elapsed < self.MIN_S or not 0.03 <= fraction < 1.0:
            return None
        return elapsed * (1.0 - fraction) / fraction

    def text(self, stage: str, fraction: float) -> str:
        """The status line's suffix, like "  ·  about 40 s left" ("" while too early)."""
        left = self.left(stage, fraction)
        if left is None:
            return ""
        from engine.paced import about

        return f"  ·  {about(left)} left"


class CliProgress:
    """Callable ``(stage, fraction)`` that draws one tqdm bar per stage."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._bar: Any = None
        self._stage = ""

    def __call__(self, stage: str, fraction: float) -> None:
        if not self.enabled:
            return
        if not self.tty:  # logs and pipes: one line per stage
            if stage != self._stage:
                self._stage = stage
                print(f"veil: {stage}...", file=sys.stderr, flush=True)
            return
        from tqdm import tqdm

        if stage != self._stage:
            self.close()
            self._stage = stage
            self._bar = tqdm(total=100, desc=stage, file=sys.stderr, leave=False)
        if self._bar is not None:
            self._bar.n = int(fraction * 100)
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
