"""Progress for calls that report none, paced by the clock against an estimate.

The one-time conversion of a GGUF file spends its time inside two transformers calls (reading
the config, building the tokenizer from the file's vocabulary), which say nothing until they
return: ~30 s for Qwen2.5-1.5B's 455k vocabulary and merge entries, ~1 min for Gemma 3's 786k.
:class:`PacedProgress` runs such a call as a *step* with an estimated duration and, from a
helper thread, reports its share of the bar as time passes: linearly up to 90% of the step at
the estimate, then creeping towards its end without reaching it, so a slow machine sees a bar
that slows down rather than one that stops or lies about being done.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Progress = Callable[[str, float], None]
TICK_S = 0.5  # between reports


def about(seconds: float) -> str:
    """A rounded duration for a label: "about 40 s", "about 2 min"."""
    if seconds < 55:
        return f"about {max(5, round(seconds / 5) * 5)} s"
    return f"about {max(1, round(seconds / 60))} min"


def paced_fraction(elapsed: float, estimate: float) -> float:
    """Share of a step shown after ``elapsed`` seconds of an ``estimate``: 0.9 at the
    estimate, then towards 1 (never 1: only the step's end reports its end)."""
    r = elapsed / max(estimate, 1e-6)
    if r <= 1.0:
        return 0.9 * r
    return min(0.999, 1.0 - 0.1 * math.exp(-(r - 1.0)))


class PacedProgress:
    """Reports ``stage`` through ``progress`` while steps run; ``tick_s`` between reports."""

    def __init__(self, progress: Progress, stage: str, tick_s: float | None = None) -> None:
        self.progress = progress
        self.stage = stage
        self.tick_s = TICK_S if tick_s is None else tick_s
        self.last_s = 0.0  # how long the last step took

    def report(self, fraction: float) -> None:
        self.progress(self.stage, fraction)

    @contextmanager
    def step(self, start: float, end: float, estimate_s: float) -> Iterator[None]:
        """Run the block as the bar's part [start, end], expected to take ``estimate_s``."""
        stop = threading.Event()
        t0 = time.monotonic()

        def tick() -> None:
            while not stop.wait(self.tick_s):
                f = paced_fraction(time.monotonic() - t0, estimate_s)
                self.report(start + (end - start) * f)

        self.report(start)
        ticker = threading.Thread(target=tick, name="veil-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            self.last_s = time.monotonic() - t0
        self.report(end)


def labelled_if_slow(
    progress: Progress, stage: str, work: Callable[[], None], after_s: float
) -> None:
    """Run ``work``, reporting ``stage`` (at 0, then 1 when done) only if it is still running
    after ``after_s`` seconds (at once when ``after_s`` <= 0): a step that is usually quick
    (loading cached machine code) adds no line or flicker, and a slow one (compiling it on a
    machine's first run) says why the wait."""
    lock, state = threading.Lock(), {"done": False, "shown": False}

    def show() -> None:
        with lock:
            if not state["done"]:
                state["shown"] = True
                progress(stage, 0.0)

    timer = None
    if after_s <= 0:
        show()
    else:
        timer = threading.Timer(after_s, show)
        timer.daemon = True
        timer.start()
    try:
        work()
    finally:
        if timer is not None:
            timer.cancel()
        with lock:
            state["done"] = True
            if state["shown"]:
                progress(stage, 1.0)
