"""Row-invariant float32 attention over one session's KV cache (numba; imported lazily).

torch's CPU ``scaled_dot_product_attention`` rounds differently when masked keys are present:
one query over 60 keys and the same query over those keys plus 12 masked ones give different
bits. A tree block's rows see the cache with their non-ancestors masked, a sequential step sees
the same keys with nothing masked, so verification and sequential decoding could disagree on a
near tie. This kernel gives every (row, head) the same arithmetic on each key it may see,
whatever the block around it:

* a score is ``scale * (q . k)``, the dot product in the fixed order of
  :mod:`engine.kernels._f32_ir` (16 lanes, a fixed tree), so it depends on the query and that
  key only;
* the softmax maximum is exact, each weight is one elementwise ``exp``, a masked key's weight
  is exactly 0;
* the denominator and the weighted sum of values add the keys in slot order, and adding an
  exact 0 for a masked key changes no bit.

So a row's result depends only on the sequence of keys it sees. Within that rule the work is
tiled for speed, which the row-at-a-time walks it replaces were not (a 4k-token prompt spent
most of its prefill in the quantized layer's serial one): a job takes a tile of 8 rows and
the query heads of one K/V group, scores four queries against four keys per pass, and adds
the values 256 keys at a time with eight queries' sums held in vector registers (LLVM IR:
numba kept them in memory); jobs run in parallel. A tile stops at the last key any of its
rows may see, so a causal prompt costs half a square, not a square. Measured on the 2-core
AMD EPYC (Zen 5) machine, one layer of SmolLM2 (9 heads, 3 K/V heads, hd 64), a 256-row
chunk at 4k context: 72 ms with the previous parallel kernel, 26 ms with this one.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.kernels._f32_ir import F32, I32, I64, LANES, byte_ptr, dot1x4, dot4x4, load_vec, vec

CACHE = True  # numba caches a frozen app's functions too (in the user cache)
ROWS = 8  # rows of a block per job
KEY_BLOCK = 256  # keys whose values stay in L1/L2 while a job's queries pass over them


def _make_weighted_sum(rows: int, chunks: int = 1) -> Any:
    """An intrinsic ``wsum(p, v, acc, r0, t0, t1)``: for query rows r0 .. r0 + rows and the
    first 16 * (hd // 16) lanes, acc[r] += sum over t in [t0, t1) of p[r, t] * v[t], one fused
    multiply-add per key in order of t. Each lane's chain is the same whatever ``rows`` is, so
    a query's bits do not depend on its neighbours; the accumulators stay in registers across
    the keys (numba's loops kept them in memory, ~5x slower). ``chunks`` groups of 16 lanes go
    over the keys together: independent chains, so one query (a decode step's head) is not held
    to one fused multiply-add per latency (each lane's order is unchanged: the same bits)."""

    def typer(typingctx: Any, p: Any, v: Any, acc: Any, r0: Any, t0: Any, t1: Any) -> Any:
        return types.void(p, v, acc, r0, t0, t1), codegen

    def codegen(context: Any, b: ir.IRBuilder, sig: Any, args: Any) -> Any:
        pa = context.make_array(sig.args[0])(context, b, args[0])
        va = context.make_array(sig.args[1])(context, b, args[1])
        aa = context.make_array(sig.args[2])(context, b, args[2])
        r0, t0, t1 = args[3], args[4], args[5]
        hd = b.extract_value(va.shape, 1)
        p_step = b.extract_value(pa.strides, 0)
        v_step = b.extract_value(va.strides, 0)
        a_step = b.extract_value(aa.strides, 0)
        prow = [
            byte_ptr(b, pa.data, b.mul(b.add(r0, ir.Constant(I64, k)), p_step)) for k in range(rows)
        ]
        arow = [
            byte_ptr(b, aa.data, b.mul(b.add(r0, ir.Constant(I64, k)), a_step)) for k in range(rows)
        ]
        v16 = vec(F32, LANES)
        vptr = ir.PointerType(v16)
        fptr = ir.PointerType(F32)
        zeros = ir.Constant(vec(I32, LANES), [0] * LANES)
        fma = cgutils.get_or_insert_function(
            b.module, ir.FunctionType(v16, [v16, v16, v16]), f"llvm.fma.v{LANES}f32"
        )
        width = ir.Constant(I64, LANES * 4)  # bytes per chunk of 16 lanes

        def chunk_group(first: ir.Value, n: int) -> None:
            """Chunks first .. first + n - 1 of every row over the keys [t0, t1)."""
            offs = [b.mul(b.add(first, ir.Constant(I64, c)), width) for c in range(n)]
            accs = [[cgutils.alloca_once(b, v16) for _ in range(n)] for _ in range(rows)]
            for k in range(rows):
                for c in range(n):
                    b.store(load_vec(b, b.gep(arow[k], [offs[c]]), LANES), accs[k][c])
            with cgutils.for_range(b, b.sub(t1, t0)) as key:
                t = b.add(t0, key.index)
                vrow = b.mul(t, v_step)
                vvs = [load_vec(b, byte_ptr(b, va.data, b.add(vrow, o)), LANES) for o in offs]
                for k in range(rows):
                    pk = b.load(b.bitcast(b.gep(prow[k], [b.mul(t, ir.Constant(I64, 4))]), fptr))
                    one = b.insert_element(ir.Constant(v16, ir.Undefined), pk, ir.Constant(I32, 0))
                    pv = b.shuffle_vector(one, one, zeros)
                    for c in range(n):
                        b.store(b.call(fma, [pv, vvs[c], b.load(accs[k][c])]), accs[k][c])
            for k in range(rows):
                for c in range(n):
                    dst = b.bitcast(b.gep(arow[k], [offs[c]]), vptr)
                    b.store(b.load(accs[k][c]), dst, align=1)

        total = b.udiv(hd, ir.Constant(I64, LANES))
        groups = b.udiv(total, ir.Constant(I64, chunks))
        with cgutils.for_range(b, groups) as grp:
            chunk_group(b.mul(grp.index, ir.Constant(I64, chunks)), chunks)
        if chunks > 1:  # the chunks past the last whole group, one at a time
            left = b.mul(groups, ir.Constant(I64, chunks))
            with cgutils.for_range_slice(b, left, total, ir.Constant(I64, 1)) as (c, _):
                chunk_group(c, 1)
        return context.get_dummy_value()

    return intrinsic(typer)


wsum8: Any = _make_weighted_sum(8)
wsum1: Any = _make_weighted_sum(1, 4)


@njit(fastmath={"nnan", "nsz"}, boundscheck=False, nogil=True, cache=CACHE)  # type: ignore[untyped-decorator]
def _top(x: Any, vis: Any, masked: bool, n: int) -> Any:
    """The largest of x[:n] that ``vis`` allows (every one when not ``masked``): a maximum is
    exact in any order, so the compiler may take it in vectors (scores are never NaN)."""
    top = np.float32(-np.inf)
    if masked:
        for t in range(n):
            top = max(top, x[t] if vis[t] else np.float32(-np.inf))
    else:
        for t in range(n):
            top = max(top, x[t])
    return top


@njit(boundscheck=False, nogil=True, cache=CACHE)  # type: ignore[untyped-decorator]
def _softmax_weights(x: Any, vis: Any, masked: bool, n: int) -> None:
    """x[:n] = exp(x[:n] - top) where ``vis`` allows (every key when not ``masked``) and exactly
    0 elsewhere, ``top`` the largest visible score; unnormalised (the caller divides by the
    sum once per lane). The exp is (e^(y / 1024))^1024 with a degree-6 Taylor term and ten
    squarings in float64, in plain multiplies and adds the compiler turns into vector code
    (a call to ``exp`` per key was most of the old kernel's time): relative error ~1e-9 before
    the rounding to float32; more than 87 below ``top`` counts as 87 below (a weight under
    2e-38, never 0). No fast-math: the vector body and the scalar remainder do the same
    operations, so a key's weight does not depend on its slot. Same exp as
    ``_topk._sum_exp``, kept as this file's own copy (numba's per-file cache)."""
    top = np.float64(_top(x, vis, masked, n))
    for t in range(n):
        y = max(np.float64(x[t]) - top, -87.0) * (1.0 / 1024.0)
        e = 1.0 + y * (1.0 + y * (0.5 + y * (1.0 / 6 + y * (1.0 / 24 + y * (1.0 / 120 + y / 720)))))
        for _ in range(10):  # e^(y / 1024) -> e^y
            e *= e
        x[t] = np.float32(e) if not masked or vis[t] else np.float32(0.0)


@njit(boundscheck=False, nogil=True, cache=CACHE)  # type: ignore[untyped-decorator]
def _visible_end(mask: Any, masked: bool, r0: int, r1: int, length: int) -> int:
    """One past the last key that any of rows [r0, r1) may see."""
    if not masked:
        return length
    end = 0
    for b in range(r0, r1):
        t = length
        while t > end and not mask[b, t - 1]:
            t -= 1
        end = max(end, t)
    return end


@njit(boundscheck=False, nogil=True, cache=CACHE)  # type: ignore[untyped-decorator]
def _scores(qv: Any, kg: Any, end: int, s: Any) -> None:
    """s[r, t] = qv[r] . kg[t] for t < end: each one dot product in the fixed order of
    :mod:`engine.kernels._f32_ir` (its bits depend on the two rows only), four queries against
    four keys at a time where there are four queries (one against four otherwise). Past the
    last key the block repeats it and drops those results."""
    qn = qv.shape[0]
    last = end - 1
    for t in range(0, end, 4):
        t1, t2, t3 = min(t + 1, last), min(t + 2, last), min(t + 3, last)
        n = min(4, end - t)
        r = 0
        while r + 4 <= qn:
            d = dot4x4(qv, kg, (r, r + 1, r + 2, r + 3, t, t1, t2, t3))
            for i in range(4):
                for c in range(n):
                    s[r + i, t + c] = d[4 * i + c]
            r += 4
        while r < qn:
            d1 = dot1x4(qv, kg, (r, t, t1, t2, t3))
            for c in range(n):
                s[r, t + c] = d1[c]
            r += 1


@njit(  # type: ignore[untyped-decorator]
    "void(float32[:, ::1], float32[:, :, ::1], float32[:, :, ::1], int64, boolean[:, ::1], "
    "boolean, int64, float32, float32, float32[:, ::1], int64)",
    boundscheck=False,
    parallel=True,
    nogil=True,
    cache=CACHE,
)
def attend_rows(
    q: Any,
    kc: Any,
    vc: Any,
    length: int,
    mask: Any,
    masked: bool,
    nh: int,
    scale: Any,
    softcap: Any,
    out: Any,
    threads: int,
) -> None:
    """out[b, h*hd:(h+1)*hd] = softmax(q_h[b] . K * scale) V over cache slots [0, length) that
    ``mask[b]`` allows (all of them when not ``masked``); ``scale`` 0 means 1 / sqrt(hd);
    ``softcap`` > 0 caps each score at softcap * tanh(score / softcap).

    q [B, >= nh hd] (query head h in columns h*hd .. (h+1)*hd; a fused q|k|v row will do);
    kc, vc [nkv, capacity, hd] (one layer's buffers); out [B, nh hd]. Query heads share K/V in
    groups of nh / nkv, as in grouped-query attention. ``threads``: how many the caller runs
    (the work is split finely enough to keep them busy)."""
    n = q.shape[0]
    nkv, _, hd = kc.shape
    group = nh // nkv
    if scale == 0:
        scale = np.float32(1.0 / math.sqrt(hd))
    capped = softcap > 0
    rows = min(ROWS, n)
    tiles = (n + rows - 1) // rows
    # query heads per job: fewer only while there are fewer jobs than threads (a job reads its
    # group's keys and values once; splitting a group between two jobs reads them twice, which
    # cost a decode step at 4k context more than an idle thread: 1.04-1.26x on two models)
    per = group
    while per > 1 and tiles * nkv * ((group + per - 1) // per) < threads:
        per = (per + 1) // 2
    subs = (group + per - 1) // per
    for job in prange(tiles * nkv * subs):
        tile = job // (nkv * subs)
        g = (job // subs) % nkv
        h0 = g * group + (job % subs) * per
        h1 = min(h0 + per, (g + 1) * group)
        r0 = tile * rows
        r1 = min(r0 + rows, n)
        nr, nq = r1 - r0, (h1 - h0) * (r1 - r0)
        end = _visible_end(mask, masked, r0, r1, length)
        qv = np.empty((nq, hd), dtype=np.float32)  # query r = (row, head) of this job
        for b in range(nr):
            for h in range(h1 - h0):
                for i in range(hd):
                    qv[b * (h1 - h0) + h, i] = q[r0 + b, (h0 + h) * hd + i]
        s = np.empty((nq, end), dtype=np.float32)
        _scores(qv, kc[g], end, s)
        for r in range(nq):
            w = s[r, :end]
            if capped:
                for t in range(end):
                    w[t] = np.float32(np.tanh(w[t] * scale / softcap)) * softcap
            else:
                for t in range(end):
                    w[t] *= scale
            _softmax_weights(w, mask[min(r0 + r // (h1 - h0), mask.shape[0] - 1)], masked, end)
        vg = vc[g]
        acc = np.zeros((nq, hd), dtype=np.float32)
        den = np.zeros(nq, dtype=np.float32)
        for t in range(end):  # slot order; a masked key adds exact zeros
            for r in range(nq):
                den[r] += s[r, t]
        vector_lanes = hd // LANES * LANES
        for t0 in range(0, end, KEY_BLOCK):  # values a block at a time, each key in order
            t1 = min(t0 + KEY_BLOCK, end)
            r = 0
            while r + 8 <= nq:
                wsum8(s, vg, acc, r, t0, t1)
                r += 8
            while r < nq:
                wsum1(s, vg, acc, r, t0, t1)
                r += 1
            for r in range(nq):  # lanes past the last 16: one by one, also in order of t
                for t in range(t0, t1):
                    p = s[r, t]
                    for i in range(vector_lanes, hd):
                        acc[r, i] += p * vg[t, i]
        for r in range(nq):
            b = r0 + r // (h1 - h0)
            h = h0 + r % (h1 - h0)
            for i in range(hd):
                out[b, h * hd + i] = acc[r, i] / den[r]
