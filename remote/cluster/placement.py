"""Pure policy for the gateway: which replica takes a new session, and one statistics map for all.

Sessions are sticky: a session's KV cache lives in one replica, so the replica is chosen once, at
``open``, and every later step goes there. The choice is the ready replica with the most free
KV-cache budget (``--max-cache-gb`` minus what its sessions have booked), then the fewest open
sessions, then the lowest index; a replica at its ``--max-sessions`` or without room for the new
session's first cache allocation is skipped. ``busy`` only when no ready replica can take it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ModelConfig


@dataclass
class Load:
    """What the gateway has booked on one replica."""

    index: int
    ready: bool
    sessions: int
    cache_bytes: int


def choose_replica(
    loads: Sequence[Load], need_bytes: int, max_sessions: int, cache_cap: int
) -> tuple[int | None, str]:
    """(replica index, "") or (None, why every replica refused) for a new session."""
    ready = [x for x in loads if x.ready]
    if not ready:
        return None, f"server busy: no trunk replica is ready ({len(loads)} starting or restarting)"
    fits = [
        x for x in ready if x.sessions < max_sessions and x.cache_bytes + need_bytes <= cache_cap
    ]
    if not fits:
        if all(x.sessions >= max_sessions for x in ready):
            return None, (
                f"server busy: {sum(x.sessions for x in ready)} sessions open "
                f"({max_sessions} per replica, {len(ready)} ready)"
            )
        return None, "server busy: the KV-cache memory cap is reached on every replica"
    best = min(fits, key=lambda x: (-(cache_cap - x.cache_bytes), x.sessions, x.index))
    return best.index, ""


def slot_bytes_for(
    config: ModelConfig, dtype: torch.dtype, stages: Sequence[tuple[int, int]], start: int, end: int
) -> int:
    """KV-cache bytes per cached token of a session over [start, end) on a replica whose layers
    are split into ``stages`` [lo, hi): the same count as ``TrunkWorker.slot_bytes``."""
    elt = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for lo, hi in stages:
        a, b = max(start, lo), min(end, hi)
        if a < b:
            total += (b - a) * config.n_kv_heads * config.head_dim * elt * 2 + 8
    return total


COUNTERS = ("batches", "shared_batches", "steps", "chunks", "errors", "opened")
SETTINGS = (
    "batching",
    "max_batch_rows",
    "prefill_chunk",
    "bit_identical",
    "kernel",
    "stages",
    "pipelined",
)


def add_counts(into: dict[str, Any], stats: dict[str, Any]) -> None:
    """Add one worker's counters, busy time and batch-size histogram to ``into``."""
    for k in COUNTERS:
        if k in stats:
            into[k] = int(into.get(k, 0)) + int(stats[k])
    into["busy_s"] = round(float(into.get("busy_s", 0.0)) + float(stats.get("busy_s", 0.0)), 3)
    hist = dict(into.get("batch_rows_hist", {}))
    for rows, n in stats.get("batch_rows_hist", {}).items():
        hist[rows] = int(hist.get(rows, 0)) + int(n)
    into["batch_rows_hist"] = {k: hist[k] for k in sorted(hist, key=int)}


def mean_batch_rows(stats: dict[str, Any]) -> float:
    hist = stats.get("batch_rows_hist", {})
    n = sum(int(v) for v in hist.values())
    return round(sum(int(k) * int(v) for k, v in hist.items()) / n, 2) if n else 0.0
