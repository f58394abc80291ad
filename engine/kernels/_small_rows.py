"""The numba small-row float32 kernel behind :mod:`engine.kernels` (imported lazily: importing
compiles it, or loads it from numba's on-disk cache). Kept in its own module so numba's cache can
key it by file.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

TILE_N = 32  # weight rows per tile (32 x 576 floats = 74 KB: fits L2)
# numba caches a frozen app's functions too (in the user cache, keyed by the executable)
CACHE = True
GROUP_M = 8  # input rows per pass over a tile (8 x 576 floats = 18 KB: fits L1)


@njit(fastmath=True, boundscheck=False, inline="always", cache=CACHE)  # type: ignore[untyped-decorator]
def _dot4(x0: Any, x1: Any, x2: Any, x3: Any, w: Any) -> Any:
    """Four dot products sharing one read of ``w`` (LLVM vectorizes the loop)."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    for k in range(w.shape[0]):
        wk = w[k]
        a0 += x0[k] * wk
        a1 += x1[k] * wk
        a2 += x2[k] * wk
        a3 += x3[k] * wk
    return a0, a1, a2, a3


@njit(  # type: ignore[untyped-decorator]
    "void(float32[:, ::1], float32[:, ::1], float32[:, ::1])",
    fastmath=True,
    boundscheck=False,
    parallel=True,
    nogil=True,
    cache=CACHE,
)
def rows_times_weight(x: Any, w: Any, y: Any) -> None:
    """y = x @ w.T for x [M, K], w [N, K], y [M, N]; parallel over tiles of weight rows.

    A tile of TILE_N weight rows is read from memory once and stays in L2 while groups of
    GROUP_M input rows (which stay in L1) pass over it. Rows of x go four at a time; a short last
    group repeats its last row and drops the copies, so every output element is computed by the
    same instructions whatever M is (batch invariance).
    """
    m_rows = x.shape[0]
    n_rows = w.shape[0]
    last = m_rows - 1
    for t in prange((n_rows + TILE_N - 1) // TILE_N):
        n0 = t * TILE_N
        n1 = min(n0 + TILE_N, n_rows)
        for g0 in range(0, m_rows, GROUP_M):
            g1 = min(g0 + GROUP_M, m_rows)
            for n in range(n0, n1):
                wn = w[n]  # [K]
                for m in range(g0, g1, 4):
                    a0, a1, a2, a3 = _dot4(
                        x[m], x[min(m + 1, last)], x[min(m + 2, last)], x[min(m + 3, last)], wn
                    )
                    y[m, n] = a0
                    if m + 1 < g1:
                        y[m + 1, n] = a1
                    if m + 2 < g1:
                        y[m + 2, n] = a2
                    if m + 3 < g1:
                        y[m + 3, n] = a3
