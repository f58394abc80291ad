"""Which queued steps go into the next batch: the trunk worker's policy, as pure code.

Continuous batching (vLLM, SGLang, llama.cpp's server slots): whenever the device is free, take
sessions' next pieces of work — at most one per session — until the batch's row budget is spent.
A long step (a prefill) is cut into chunks of at most ``prefill_chunk`` rows at fixed offsets
(0, C, 2C, ...), so other sessions' short steps run between its chunks instead of waiting for
the whole prompt (Sarathi-Serve's stall-free schedule; vLLM's chunked prefill).

**Fair between client keys.** Sessions belong to client keys (one person's computer), and keys,
not sessions, take turns: start-time fair queueing over the rows each key has had computed
(:class:`Shares`). The key that has had the least *leads* the batch: its sessions' chunks go
first. While another key has a session open, one key puts at most one chunk's worth of rows
into a batch, so a key with many sessions or huge steps gets turns like everybody else, not
batches to itself. The other keys add their *short steps* — whole steps of at most a quarter of
``max_rows`` — which may take the batch a quarter over ``max_rows``, so a short step always
fits beside a full prefill chunk; their prefill chunks wait for their own key's turn, so a
batch led by short steps stays short. A key back from idle starts level with the leader, never
ahead by what it did not use; nothing starves, since a key's usage only grows while it is
served and the leader's first chunk always goes. So a short step waits at most for the batch
running when it arrives — about one chunk — and then runs in the next one.

Chunk offsets depend only on the step, never on the batch: attention over a chunk sees the slots
up to its last row, so on kernels that round a row differently by block (SDPA on a GPU) cutting a
block differently would round differently, and a session's bits must not depend on who else is
queued. Where every row gets the bits it gets alone (the trunk worker's ``bit_identical``: the CPU
kernels), a prefill with no other session's work queued, while no other client key has a session
open, takes several of its chunks at once, up to the batch budget (``TrunkWorker.lone_rows``):
the same offsets, fewer of them used, the same bits. Only that key's own next step can wait for
such a batch; with another key present, chunks stay at C rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Ready:
    """A session's next chunk, waiting since ``since`` (a monotonic clock reading)."""

    key: str  # the session
    rows: int  # rows in this chunk
    since: float  # when the step arrived, or when its previous chunk finished
    owner: str = ""  # the client key the session belongs to
    whole: bool = True  # the chunk is its whole step (False: a piece of a prefill)


def chunk_rows(total: int, done: int, prefill_chunk: int) -> int:
    """Rows of the chunk that starts at row ``done`` of a ``total``-row step."""
    return min(prefill_chunk, total - done)


def short_rows(max_rows: int) -> int:
    """A chunk of at most this many rows is *short*: it may use the batch's reserve."""
    return max(1, max_rows // 4)


def plan_batch(
    ready: Sequence[Ready],
    max_rows: int,
    max_steps: int,
    chunk: int | None = None,
    usage: Mapping[str, float] | None = None,
    others: bool = False,
) -> list[Ready]:
    """The next batch (see the module docstring): keys in order of ``usage`` (least first; ties:
    the key waiting longest), each key's sessions oldest first, one chunk per session, at most
    ``max_steps`` chunks. While several keys wait, or ``others`` (another key has a session
    open), a key adds chunks beyond its first only up to ``chunk`` rows (default ``max_rows``)."""
    by_owner: dict[str, list[Ready]] = {}
    for r in sorted(ready, key=lambda r: r.since):
        by_owner.setdefault(r.owner, []).append(r)
    use = usage or {}
    owners = sorted(by_owner, key=lambda o: (use.get(o, 0.0), by_owner[o][0].since))
    cap = (chunk or max_rows) if others or len(owners) > 1 else None
    short = short_rows(max_rows)
    chosen: list[Ready] = []
    rows = 0
    seen: set[str] = set()
    for o in owners:
        mine = 0
        for r in by_owner[o]:
            if len(chosen) >= max_steps:
                return chosen
            if r.key in seen:
                continue
            if chosen:
                is_short = r.whole and r.rows <= short
                if o != chosen[0].owner and not is_short:
                    continue  # another key's prefill chunk waits for its key's turn
                limit = max_rows + (short if is_short else 0)
                if rows + r.rows > limit or (cap is not None and mine and mine + r.rows > cap):
                    continue
            chosen.append(r)
            seen.add(r.key)
            rows += r.rows
            mine += r.rows
    return chosen


@dataclass
class Shares:
    """Each key's usage — rows computed for it, on a clock shared by all keys (start-time fair
    queueing). A key coming back from idle starts at the clock (the usage of the key that led
    the last batch) unless it is still ahead of it: it can neither bank an idle period nor
    escape what it just had by pausing between steps."""

    usage: dict[str, float] = field(default_factory=dict)
    clock: float = 0.0  # the usage of the last batch's leader when that batch was planned

    def track(self, active: Iterable[str]) -> None:
        """Keys with queued work start no lower than the clock; an idle key is remembered only
        while it is ahead of the clock (behind it, it would come back at the clock anyway)."""
        keys = set(active)
        self.usage = {k: v for k, v in self.usage.items() if k in keys or v > self.clock}
        for k in keys:
            self.usage[k] = max(self.usage.get(k, self.clock), self.clock)

    def book(self, batch: Sequence[Ready]) -> None:
        """A planned batch: the clock moves to its leader's usage, each key pays for its rows."""
        if not batch:
            return
        self.clock = max(self.clock, self.usage.get(batch[0].owner, self.clock))
        for r in batch:
            self.usage[r.owner] = self.usage.get(r.owner, self.clock) + r.rows
