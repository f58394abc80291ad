"""Row-invariant float32 attention over one session's KV cache (numba; imported lazily).

torch's CPU ``scaled_dot_product_attention`` rounds differently when masked keys are present:
one query over 60 keys and the same query over those keys plus 12 masked ones give different
bits. A tree block's rows see the cache with their non-ancestors masked, a sequential step sees
the same keys with nothing masked, so verification and sequential decoding could disagree on a
near tie. Here each (row, head) walks only the keys its mask allows, in slot order, with scalar
sums over the keys and the same fixed-length dot products: a row's result depends only on the
sequence of keys it sees, not on the block around it or on how many keys are masked.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit, prange

CACHE = True  # numba caches a frozen app's functions too (in the user cache)


@njit(boundscheck=False, nogil=True, cache=CACHE)  # type: ignore[untyped-decorator]
def _exp_below(x: Any, n: int, top: Any) -> None:
    """x[:n] = exp(x[:n] - top) for ``top`` >= every entry, in plain multiplies and adds that the
    compiler turns into vector code (a call to ``exp`` per key was most of this kernel's time):
    (e^(y / 1024))^1024 with a degree-6 Taylor term and ten squarings in float64, relative error
    ~1e-9 before the rounding to float32; more than 87 below ``top`` counts as 87 below (a weight
    under 2e-38). No fast-math: the vector body and the scalar remainder do the same operations,
    so a key's weight does not depend on its slot (which is what keeps rows invariant). Same
    exp as ``_topk._sum_exp``, kept as this file's own copy (numba's per-file cache)."""
    for t in range(n):
        y = max(np.float64(x[t]) - top, -87.0) * (1.0 / 1024.0)
        e = 1.0 + y * (1.0 + y * (0.5 + y * (1.0 / 6 + y * (1.0 / 24 + y * (1.0 / 120 + y / 720)))))
        for _ in range(10):  # e^(y / 1024) -> e^y
            e *= e
        x[t] = np.float32(e)


@njit(  # type: ignore[untyped-decorator]
    "void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], int64, boolean[:, ::1], "
    "boolean, float32, float32, float32[:, ::1])",
    fastmath=True,
    boundscheck=False,
    parallel=True,
    nogil=True,
    cache=CACHE,
)
def attend_rows(
    q: Any,
    kc: Any,
    vc: Any,
    end: int,
    mask: Any,
    masked: bool,
    scale: Any,
    softcap: Any,
    out: Any,
) -> None:
    """out[b, h*hd:(h+1)*hd] = softmax(q[h, b] . K * scale) V over slots [0, end) of the
    cache that ``mask[b]`` allows (all of them when not ``masked``); ``scale`` 0 means
    1 / sqrt(hd); ``softcap`` > 0 caps each score at softcap * tanh(score / softcap).

    q [nh, B, hd]; kc, vc [nkv, capacity, hd] (one layer's buffers); out [B, nh hd]. Query
    heads share K/V in groups of nh / nkv, as in grouped-query attention."""
    nh, n, hd = q.shape
    group = nh // kc.shape[0]
    if scale == 0:
        scale = np.float32(1.0 / math.sqrt(hd))
    capped = softcap > 0
    for job in prange(n * nh):
        b = job // nh
        h = job - b * nh
        g = h // group
        scores = np.full(end, -np.inf, dtype=np.float32)  # masked keys stay -inf
        acc = np.zeros(hd, dtype=np.float32)
        top = np.float32(-np.inf)
        for t in range(end):
            if masked and not mask[b, t]:
                continue
            s = np.float32(0.0)
            for i in range(hd):  # the only vectorized sum: fixed length, same for every row
                s += q[h, b, i] * kc[g, t, i]
            s *= scale
            if capped:
                s = np.float32(np.tanh(s / softcap)) * softcap
            scores[t] = s
            top = max(top, s)
        _exp_below(scores, end, top)  # every slot's weight, visible or not (vector code)
        den = np.float32(0.0)
        for t in range(end):  # not innermost: summed in slot order over the visible keys
            if masked and not mask[b, t]:
                continue
            p = scores[t]
            den += p
            for i in range(hd):
                acc[i] += p * vc[g, t, i]
        for i in range(hd):
            out[b, h * hd + i] = acc[i] / den
