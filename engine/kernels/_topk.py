"""Top-k of each row of a logits matrix with the softmax probability of each, in one pass over
the row plus one exp-sum pass in vector code (numba; imported lazily, cached on disk).

The speculative decoder records the model's most likely successors of every verified node (for
token recycling): torch's ``topk`` and ``logsumexp`` each read the whole [B, V] matrix on the
client's torch threads, ~3 ms a round for a 29-node tree over SmolLM2's 49,152 tokens on the
2-core machine we measured; this runs on the kernel threads, parallel over rows.

Ties keep the lower token id first. Logits are finite (they come out of the LM head).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

CACHE = True


@njit(fastmath=True, boundscheck=False, nogil=True, cache=CACHE)  # type: ignore[untyped-decorator]
def _sum_exp(row: Any, m: float) -> float:
    """sum(exp(row - m)) for ``m`` >= every entry, in plain multiplies and adds that the
    compiler turns into vector code (a call to ``exp`` per entry would not be, and was ~3/4 of
    this kernel's time): exp(x) = (e^(x / 1024))^1024, the inner term by its Taylor series to
    degree 6 (relative error < 4e-12 for x / 1024 in [-0.085, 0]), then ten squarings in
    float64 (together ~1e-9 relative). Entries more than 87 below the maximum add less than
    1e-37 each and are clamped there. The attention kernel has the same exp as its own copy
    (``_attention._exp_below``, without fast-math there): numba's on-disk cache of a function
    is not refreshed when a function it calls in another file changes."""
    s = 0.0
    for j in range(row.shape[0]):
        y = max(np.float64(row[j]) - m, -87.0) * (1.0 / 1024.0)
        e = 1.0 + y * (1.0 + y * (0.5 + y * (1.0 / 6 + y * (1.0 / 24 + y * (1.0 / 120 + y / 720)))))
        for _ in range(10):  # e^(y / 1024) -> e^y
            e *= e
        s += e
    return s


@njit(  # type: ignore[untyped-decorator]
    "void(float32[:, ::1], int64[:, ::1], float32[:, ::1])",
    parallel=True,
    boundscheck=False,
    nogil=True,
    cache=CACHE,
)
def top_k_softmax(x: Any, ids: Any, probs: Any) -> None:
    """ids [B, k], probs [B, k] = the k largest entries of each row of x [B, V] (descending)
    and their softmax probabilities."""
    k = ids.shape[1]
    for b in prange(x.shape[0]):
        row = x[b]
        tv = np.full(k, -np.inf, dtype=np.float32)
        ti = np.full(k, -1, dtype=np.int64)
        thr = tv[k - 1]
        for j in range(row.shape[0]):
            v = row[j]
            if v > thr:  # insertion into the sorted k best (rare once the row is under way)
                p = k - 1
                while p > 0 and tv[p - 1] < v:
                    tv[p] = tv[p - 1]
                    ti[p] = ti[p - 1]
                    p -= 1
                tv[p] = v
                ti[p] = j
                thr = tv[k - 1]
        m = np.float64(tv[0])
        lse = m + np.log(_sum_exp(row, m))
        for i in range(k):
            ids[b, i] = ti[i]
            probs[b, i] = np.float32(np.exp(np.float64(tv[i]) - lse))
