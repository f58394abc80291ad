"""Which queued steps go into the next batch: the trunk worker's policy, as a pure function.

Continuous batching (vLLM, SGLang, llama.cpp's server slots): whenever the device is free, take
every session's next piece of work — at most one per session, oldest first — until the batch's
row budget is spent. A long step (a prefill) is cut into chunks of at most ``prefill_chunk``
rows at fixed offsets (0, C, 2C, ...); after each chunk the rest of the step queues again *behind*
whatever arrived meanwhile, so other sessions' short steps run between its chunks instead of
waiting for the whole prompt (Sarathi-Serve's stall-free schedule; vLLM's chunked prefill). A
short step waits at most about one chunk's compute.

Chunk offsets depend only on the step, never on the batch: attention over a chunk sees the slots
up to its last row, so cutting a block differently would round differently, and a session's bits
must not depend on who else is queued.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Ready:
    """A session's next chunk, waiting since ``since`` (a monotonic clock reading)."""

    key: str  # the session
    rows: int  # rows in this chunk
    since: float  # when the step arrived, or when its previous chunk finished


def chunk_rows(total: int, done: int, prefill_chunk: int) -> int:
    """Rows of the chunk that starts at row ``done`` of a ``total``-row step."""
    return min(prefill_chunk, total - done)


def plan_batch(ready: Sequence[Ready], max_rows: int, max_steps: int) -> list[Ready]:
    """The next batch: oldest first, one chunk per session, at most ``max_rows`` rows and
    ``max_steps`` chunks. The oldest chunk always goes, even when it alone is over the budget,
    so nothing starves; a younger chunk that does not fit waits, and smaller ones behind it
    may still join."""
    chosen: list[Ready] = []
    rows = 0
    seen: set[str] = set()
    for r in sorted(ready, key=lambda r: r.since):
        if len(chosen) >= max_steps:
            break
        if r.key in seen or (chosen and rows + r.rows > max_rows):
            continue
        chosen.append(r)
        seen.add(r.key)
        rows += r.rows
    return chosen
