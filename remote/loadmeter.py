"""The trunk's load as each step's reply reports it (``load`` in a Result, docs/protocol.md).

Three aggregate numbers, smoothed over recent batches, so a client can price the rows it sends
by what they cost the whole office (``engine.spec_cost.CostModel``):

* ``peers`` — other steps a step shares its batch with or waits behind: the steps of a batch
  less one, plus the steps still queued when it finished (every key's, counted, never named);
* ``row_ms`` — the marginal compute of one more row in a batch: the slope of batch time over
  batch rows, by exponentially weighted least squares over recent batches (while their sizes
  vary too little to show a slope, the average time per row, an upper bound; and never less
  than MIN_ROW_SHARE of that average: on a busy or noisy machine the fitted slope can come out
  at or below zero, yet one more row always costs something, and a client pricing rows at zero
  would flood a shared trunk);
* ``busy`` — the fraction of recent wall time the trunk spent computing;
* ``fixed_ms`` — a batch's compute at zero rows: the same fit's intercept (what a batch costs
  however few rows it holds, shared by the steps in it).

No key's own work shows: each number mixes every key's batches and is averaged over many of
them (issue 29's rule — a key sees only its own counters — allows aggregates of this kind).
Thread-safe; the worker books each finished batch and reads a snapshot per reply.
"""

from __future__ import annotations

import threading

from engine.protocol import MAX_LOAD_PEERS, MAX_LOAD_ROW_MS, Load

DECAY = 0.98  # weight of the past per batch (about the last 50 batches count)
MIN_ROW_SPREAD = 1.0  # variance of batch rows (rows^2) the slope needs
MIN_ROW_SHARE = 0.05  # the slope's floor, as a share of the average time per row


class LoadMeter:
    """Smoothed load of one worker (see the module docstring)."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self._lock = threading.Lock()
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self._peers = 0.0
        self._busy = 0.0
        self._last_end: float | None = None
        self.batches = 0

    def batch(self, rows: int, steps: int, waiting: int, t0: float, t1: float) -> None:
        """A finished batch of ``rows`` rows and ``steps`` steps that computed from ``t0`` to
        ``t1`` (perf_counter seconds), with ``waiting`` steps still queued after it."""
        dt = max(t1 - t0, 0.0)
        peers = float(max(steps - 1, 0) + max(waiting, 0))
        with self._lock:
            d = self.decay
            n = float(rows)
            self._w = d * self._w + 1.0
            self._n = d * self._n + n
            self._t = d * self._t + dt
            self._nn = d * self._nn + n * n
            self._nt = d * self._nt + n * dt
            if self.batches == 0:
                self._peers = peers
            else:
                self._peers = d * self._peers + (1 - d) * peers
            if self._last_end is not None:  # busy: compute over the time since the last batch
                span = max(t1 - self._last_end, dt)
                busy = dt / span if span > 0 else 1.0
                first = self.batches == 1
                self._busy = busy if first else d * self._busy + (1 - d) * busy
            self._last_end = t1
            self.batches += 1

    def fit_ms(self) -> tuple[float, float]:
        """(fixed ms per batch, marginal ms per row) of recent batches ((0, 0) before any)."""
        with self._lock:
            if self._w <= 0 or self._n <= 0:
                return 0.0, 0.0
            mn, mt = self._n / self._w, self._t / self._w
            mean_per_row = mt / mn
            var = self._nn / self._w - mn * mn
            fitted = (self._nt / self._w - mn * mt) / var if var >= MIN_ROW_SPREAD else None
            floor = MIN_ROW_SHARE * mean_per_row
            slope = min(max(mean_per_row if fitted is None else fitted, floor), mean_per_row)
            return 1000.0 * max(mt - slope * mn, 0.0), 1000.0 * slope

    def row_ms(self) -> float:
        """Marginal ms per row of recent batches (0 before any batch)."""
        return self.fit_ms()[1]

    def snapshot(self) -> Load:
        """The load a reply carries now (clamped to what the protocol accepts)."""
        fixed, row = (min(x, MAX_LOAD_ROW_MS) for x in self.fit_ms())
        with self._lock:
            peers = min(self._peers, MAX_LOAD_PEERS)
            busy = min(max(self._busy, 0.0), 1.0)
        return Load(round(peers, 3), round(row, 4), round(busy, 4), round(fixed, 4))
