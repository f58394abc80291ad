"""The numba float32 kernel for batches of any size (see :mod:`engine.kernels.batched`); imported
lazily (importing compiles it, or loads it from numba's on-disk cache) and kept in its own module
so numba's cache can key it by file.

Register blocking: each inner call computes a 4 x 2 block of outputs — four input rows against
two weight rows — so one pass over K loads six vectors for eight fused multiply-adds, where the
small-row kernel's 4 x 1 block loads five for four. That is what makes it fast at 64-256 rows,
where the small-row kernel runs out of load bandwidth.

Batch invariance: an output element is always the dot product of one input row and one weight
row computed by :func:`_dot4x2`, whose eight accumulators run the same instructions. Weight rows
are paired by index (fixed by the weight's shape), input rows are taken four at a time with a
short last group repeating its last row, so nothing about an element's arithmetic depends on how
many rows the call has or where the row sits in it. :func:`engine.kernels.batched.self_check`
confirms this on the running CPU before the batching worker relies on it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

TILE_N = 32  # weight rows per parallel tile (an even number: row j pairs with row j + TILE_N/2)
GROUP_M = 8  # input rows per pass over a tile (a multiple of 4)
# numba caches a frozen app's functions too (in the user cache, keyed by the executable)
CACHE = True


@njit(fastmath=True, boundscheck=False, inline="always", cache=CACHE)  # type: ignore[untyped-decorator]
def _dot4x2(x0: Any, x1: Any, x2: Any, x3: Any, w0: Any, w1: Any) -> Any:
    """Eight dot products: four input rows times two weight rows (LLVM vectorizes over K)."""
    a00 = np.float32(0.0)
    a01 = np.float32(0.0)
    a10 = np.float32(0.0)
    a11 = np.float32(0.0)
    a20 = np.float32(0.0)
    a21 = np.float32(0.0)
    a30 = np.float32(0.0)
    a31 = np.float32(0.0)
    for k in range(w0.shape[0]):
        u = w0[k]
        v = w1[k]
        b0 = x0[k]
        b1 = x1[k]
        b2 = x2[k]
        b3 = x3[k]
        a00 += b0 * u
        a01 += b0 * v
        a10 += b1 * u
        a11 += b1 * v
        a20 += b2 * u
        a21 += b2 * v
        a30 += b3 * u
        a31 += b3 * v
    return a00, a01, a10, a11, a20, a21, a30, a31


@njit(  # type: ignore[untyped-decorator]
    "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])",
    fastmath=True,
    boundscheck=False,
    parallel=True,
    nogil=True,
    cache=CACHE,
)
def batch_times_weight(x: Any, w: Any, y: Any) -> None:
    """y = x @ w.T for x [M, K], w [N, K], y [M, N]; parallel over tiles of weight rows.

    A tile of TILE_N weight rows stays in L2 while groups of GROUP_M input rows (in L1) pass
    over it, two weight rows and four input rows at a time. Row j of a tile pairs with row
    j + TILE_N/2, not j + 1: two long sequential streams through the tile, which measured
    ~1.5x faster at 1-16 rows than adjacent pairs on our Zen 3 VM (the products are memory-bound
    there).
    """
    m_rows = x.shape[0]
    n_rows = w.shape[0]
    last = m_rows - 1
    half = TILE_N // 2
    for t in prange((n_rows + TILE_N - 1) // TILE_N):
        n0 = t * TILE_N
        n1 = min(n0 + TILE_N, n_rows)
        for g0 in range(0, m_rows, GROUP_M):
            g1 = min(g0 + GROUP_M, m_rows)
            for j in range(half):
                na = n0 + j
                if na >= n1:
                    break
                nb = na + half
                two = nb < n1
                wa = w[na]  # [K]
                wb = w[nb] if two else wa  # [K]: a row without a partner pairs with itself
                for m in range(g0, g1, 4):
                    c00, c01, c10, c11, c20, c21, c30, c31 = _dot4x2(
                        x[m],
                        x[min(m + 1, last)],
                        x[min(m + 2, last)],
                        x[min(m + 3, last)],
                        wa,
                        wb,
                    )
                    y[m, na] = c00
                    if two:
                        y[m, nb] = c01
                    if m + 1 < g1:
                        y[m + 1, na] = c10
                        if two:
                            y[m + 1, nb] = c11
                    if m + 2 < g1:
                        y[m + 2, na] = c20
                        if two:
                            y[m + 2, nb] = c21
                    if m + 3 < g1:
                        y[m + 3, na] = c30
                        if two:
                            y[m + 3, nb] = c31
