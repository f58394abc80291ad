"""The trunk worker's counters: of the whole worker, and of each client key on its own.

A key's own counters say what its work did and nothing about anybody else's: the batches its
work ran in, and in the histogram how many of *its own* rows each of those batches held (not the
batch's size, which would show other users' prompt lengths). Thread-safe; the worker books a
batch, a step or an error, and ``snapshot`` reads them.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

COUNTERS = ("batches", "shared_batches", "steps", "chunks", "errors")
OWN = (*COUNTERS, "opened", "busy_s", "batch_rows_hist")  # what snapshot(key) holds
MAX_KEYS = 1024  # keys whose own counters are kept (the least recently active are forgotten)


@dataclass
class _Counts:
    opened: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    hist: dict[int, int] = field(default_factory=dict)  # rows in a batch -> batches
    busy_s: float = 0.0

    def batch(self, rows: Sequence[int], dt: float) -> None:
        """A batch that held chunks of ``rows`` rows (of this key, or of everyone)."""
        self.counts["batches"] += 1
        self.counts["chunks"] += len(rows)
        self.counts["shared_batches"] += len(rows) > 1
        self.hist[sum(rows)] = self.hist.get(sum(rows), 0) + 1
        self.busy_s += dt

    def snapshot(self) -> dict[str, Any]:
        return {
            "busy_s": round(self.busy_s, 3),
            "batch_rows_hist": {str(k): v for k, v in sorted(self.hist.items())},
            **self.counts,
        }


class WorkerCounters:
    """Everyone's counters and each key's own (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all = _Counts()
        self._keys: collections.OrderedDict[str, _Counts] = collections.OrderedDict()

    def _key(self, key: str) -> _Counts:
        """The counters of ``key`` (under the lock), now the most recently active."""
        c = self._keys.get(key)
        if c is None:
            c = self._keys[key] = _Counts()
            while len(self._keys) > MAX_KEYS:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        return c

    def opened(self, key: str) -> None:
        with self._lock:
            self._key(key).opened += 1

    def batch(self, rows_by_key: Mapping[str, Sequence[int]], dt: float) -> None:
        """A finished batch: each key's chunks in it (their rows), and its wall time."""
        with self._lock:
            self._all.batch([r for rows in rows_by_key.values() for r in rows], dt)
            for key, rows in rows_by_key.items():
                self._key(key).batch(rows, dt)

    def add(self, key: str, name: str) -> None:
        """One more ``name`` (``steps``, ``errors``) for ``key`` and for everyone."""
        with self._lock:
            self._all.counts[name] += 1
            self._key(key).counts[name] += 1

    def snapshot(self, key: str | None = None) -> dict[str, Any]:
        """Everyone's counters (``key`` None) or the key's own (zeros for a key never seen)."""
        with self._lock:
            if key is None:
                return self._all.snapshot()
            c = self._keys.get(key) or _Counts()
            return {**c.snapshot(), "opened": c.opened}

    def keys(self) -> dict[str, dict[str, Any]]:
        """Every remembered key's own counters."""
        with self._lock:
            names = list(self._keys)
        return {k: self.snapshot(k) for k in names}
