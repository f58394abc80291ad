"""A tqdm progress bar on stderr for long CLI work (model conversion, hashing, benchmarks)."""

from __future__ import annotations

import sys
from typing import Any


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
