"""Quantized matrix products with int8 activations (numba drivers around the IR emitters of
:mod:`engine.kernels._ir_int` and :mod:`engine.kernels._ir_kquant`; imported lazily, cached by
numba).

``y = x @ dequant(w).T`` with ``x`` quantized per row first (blocks of 32,
:func:`quantize_acts`; blocks of 256 for the K-quants, :func:`quantize_acts_k`), then every
block product done in integers: ~3x less work per weight than decoding weights to float
(:mod:`engine.kernels._quant_mm`), at the price of rounding the activations to 8 bits per block
(llama.cpp's rule; the quality cost is measured in docs/performance.md). Each weight block is
decoded once for up to 8 activation rows. Batch-invariant: a row's quantization and sums
involve that row only, and every row pair gets the same operations in any group.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import literally, njit, prange, types
from numba.core import cgutils, errors
from numba.extending import intrinsic

from engine.kernels._ir import F32, FORMATS, I64, byte_ptr, prefetch
from engine.kernels._ir_int import (
    GROUP,
    GROUPED,
    Acc,
    Acts,
    IntEmitter,
    dec_int8,
    dec_q4_0,
    dec_q4_1,
    dec_q5_0,
    dec_q5_1,
    dec_q8_0,
    single,
)
from engine.kernels._ir_kquant import K_CODES, int_q4_k, int_q5_k, int_q6_k

# one block against every activation row, by format code (engine.kernels._ir.CODES)
INT_FORMATS: tuple[IntEmitter, ...] = (
    single(dec_q8_0),
    single(dec_q4_0),
    single(dec_q4_1),
    int_q4_k,
    int_q6_k,
    single(dec_int8),
    single(dec_q5_0),
    single(dec_q5_1),
    int_q5_k,
)

# numba caches a frozen app's functions too (in the user cache, keyed by the executable)
CACHE = True
TILE = 1  # weight rows per call (measured best on Zen 4: 1 x 8 rows beat 4 x 4 and 2 x 8)
_OPTS: dict[str, Any] = {"boundscheck": False, "nogil": True, "cache": CACHE}
PARALLEL_ROWS = 32  # from this many activation rows (prefill) their quantization is parallel


@njit(fastmath={"nnan", "nsz"}, **_OPTS)  # type: ignore[untyped-decorator]
def _abs_max(x: Any, m: int, o: int, n: int) -> Any:
    """max |x[m, o : o + n]| (a maximum is exact in any order: these flags let it vectorize;
    not inlined by numba, which would compile it with its caller's flags — LLVM inlines it
    and keeps them)."""
    a = np.float32(0.0)
    for i in range(n):
        a = max(a, abs(x[m, o + i]))
    return a


@njit(inline="always", **_OPTS)  # type: ignore[untyped-decorator]
def _round_block(x: Any, m: int, o: int, n: int, amax: Any, r: Any) -> Any:
    """r[:n] = x[m, o : o + n] rounded to the int8 grid of ``amax`` (as float32 integers in
    [-127, 127]: floor(x * 127 / amax + 0.5), no fused multiply-add); returns the scale
    ``amax / 127``. Element by element, so it vectorizes."""
    inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
    lo, hi, half = np.float32(-127.0), np.float32(127.0), np.float32(0.5)
    for i in range(n):
        r[i] = min(hi, max(lo, np.floor(x[m, o + i] * inv + half)))
    return amax / np.float32(127.0)


@njit(inline="always", **_OPTS)  # type: ignore[untyped-decorator]
def _quantize_row(x: Any, q: Any, d: Any, s: Any, m: int, r: Any, grouped: int) -> None:
    for blk in range(x.shape[1] // 32):
        o = blk * 32
        d[m, blk] = _round_block(x, m, o, 32, _abs_max(x, m, o, 32), r)
        tot = np.int32(0)
        j = blk % GROUP
        for i in range(32):
            v = np.int32(r[i])
            if blk < grouped:
                piece = i // 4
                at = (blk - j) * 32 + 8 * GROUP * (piece // 2) + 4 * (j + GROUP * (piece % 2))
                q[m, at + i % 4] = v
            else:
                q[m, o + i] = v
            tot += v
        s[m, blk] = tot


@njit(inline="always", **_OPTS)  # type: ignore[untyped-decorator]
def _quantize_row_k(x: Any, q: Any, d: Any, s: Any, m: int, r: Any) -> None:
    for blk in range(x.shape[1] // 256):
        o = blk * 256
        d[m, blk] = _round_block(x, m, o, 256, _abs_max(x, m, o, 256), r)
        for g in range(16):
            tot = np.int32(0)
            for i in range(16):
                v = np.int32(r[16 * g + i])
                q[m, o + 16 * g + i] = v
                tot += v
            s[m, 16 * blk + g] = tot


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def quantize_acts(x: Any, q: Any, d: Any, s: Any) -> None:
    """x [M, K] float32 -> q int8 [M, K], d [M, K/32] (scale of each block of 32: max|x|/127),
    s int32 [M, K/32] (the sum of the block's quantized values). Within each whole group of
    ``G`` = :data:`engine.kernels._ir_int.GROUP` blocks (4 or 8) ``q`` is interleaved as the
    grouped kernels read it (:func:`engine.kernels._ir_int.interleave` /
    :func:`~engine.kernels._ir_int.interleave8`): 4-byte piece p of block j goes to byte
    8 * G * (p // 2) + 4 * (j + G * (p % 2)) of the group; the blocks past the last whole group
    stay in order. Each row alone: the same bits whatever rows share the call."""
    grouped = x.shape[1] // (32 * GROUP) * GROUP  # blocks in whole groups
    r = np.empty(32, dtype=np.float32)
    for m in range(x.shape[0]):
        _quantize_row(x, q, d, s, m, r, grouped)


@njit(parallel=True, **_OPTS)  # type: ignore[untyped-decorator]
def quantize_acts_rows(x: Any, q: Any, d: Any, s: Any, threads: int) -> None:
    """:func:`quantize_acts` with the rows shared among ``threads`` threads (prefill)."""
    grouped = x.shape[1] // (32 * GROUP) * GROUP
    rows = x.shape[0]
    step = (rows + threads - 1) // threads
    for t in prange(threads):
        r = np.empty(32, dtype=np.float32)
        for m in range(t * step, min(rows, (t + 1) * step)):
            _quantize_row(x, q, d, s, m, r, grouped)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def quantize_acts_k(x: Any, q: Any, d: Any, s: Any) -> None:
    """As :func:`quantize_acts` in blocks of 256 (llama.cpp's Q8_K, for the K-quants):
    x [M, K] float32 -> q int8 [M, K], d [M, K/256] (max|x|/127 of each block), s int16
    [M, K/16] (the integer sum of each 16 quantized values, for the formats' minimums and
    offsets)."""
    r = np.empty(256, dtype=np.float32)
    for m in range(x.shape[0]):
        _quantize_row_k(x, q, d, s, m, r)


@njit(parallel=True, **_OPTS)  # type: ignore[untyped-decorator]
def quantize_acts_k_rows(x: Any, q: Any, d: Any, s: Any, threads: int) -> None:
    """:func:`quantize_acts_k` with the rows shared among ``threads`` threads (prefill)."""
    rows = x.shape[0]
    step = (rows + threads - 1) // threads
    for t in prange(threads):
        r = np.empty(256, dtype=np.float32)
        for m in range(t * step, min(rows, (t + 1) * step)):
            _quantize_row_k(x, q, d, s, m, r)


def _array(context: Any, builder: ir.IRBuilder, ty: Any, value: ir.Value) -> Any:
    return context.make_array(ty)(context, builder, value)


def _i64(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    return b.sext(v, I64) if v.type.width < 64 else v


def _itile(
    typingctx: Any,
    fmt: Any,
    nx: Any,
    w: Any,
    n: Any,
    scale: Any,
    xq: Any,
    xd: Any,
    xs: Any,
    m: Any,
    y: Any,
) -> Any:
    """Weight rows ``n .. n + TILE - 1`` against activation rows ``m .. m + nx - 1``: their
    ``TILE * nx`` dot products over the whole row, block by block in integers, stored into
    ``y`` (weight rows past the last are computed on the last and not stored). Each weight
    block is decoded once for all ``nx`` rows (the blocks of formats with a grouped emitter,
    :data:`engine.kernels._ir_int.GROUPED`, :data:`~engine.kernels._ir_int.GROUP` at a time);
    every (weight row, activation row) pair keeps its own accumulators and the same
    operations whatever ``nx`` is, so a row's result does not depend on the rows beside it."""
    for lit in (fmt, nx):
        if not isinstance(lit, types.IntegerLiteral):
            raise errors.RequireLiteralValue(lit)
    _, per, nbytes, _ = FORMATS[fmt.literal_value]
    emit = INT_FORMATS[fmt.literal_value]
    group = GROUPED.get(fmt.literal_value)
    rows_x = nx.literal_value
    sig = types.none(fmt, nx, w, n, scale, xq, xd, xs, m, y)

    def codegen(context: Any, b: ir.IRBuilder, signature: Any, args: Any) -> Any:
        wa = _array(context, b, signature.args[2], args[2])
        sa = _array(context, b, signature.args[4], args[4])
        qa, da, ssa = (_array(context, b, signature.args[i], args[i]) for i in (5, 6, 7))
        ya = _array(context, b, signature.args[9], args[9])
        n_, m_ = _i64(b, args[3]), _i64(b, args[8])
        last = b.sub(_i64(b, b.extract_value(wa.shape, 0)), ir.Constant(I64, 1))
        wstride = b.extract_value(wa.strides, 0)
        rows, scales, valid = [], [], []
        for r in range(TILE):
            nr = b.add(n_, ir.Constant(I64, r))
            valid.append(b.icmp_signed("<=", nr, last))
            nr = b.select(valid[-1], nr, last)
            rows.append(byte_ptr(b, wa.data, b.mul(nr, wstride)))
            scales.append(b.load(b.gep(sa.data, [nr])))
        accs = [[Acc(b) for _ in range(rows_x)] for _ in range(TILE)]
        xrows = []
        for i in range(rows_x):
            mi = b.add(m_, ir.Constant(I64, i))

            def row(arr: Any, mi: ir.Value = mi) -> ir.Value:
                return byte_ptr(b, arr.data, b.mul(mi, b.extract_value(arr.strides, 0)))

            xrows.append((row(qa), row(da), row(ssa)))
        k_acts = fmt.literal_value in K_CODES
        s_type = ir.PointerType(ir.IntType(16) if k_acts else ir.IntType(32))

        def acts_at(first: ir.Value) -> list[Acts]:  # every row's Acts at element ``first``
            d_at = b.udiv(first, ir.Constant(I64, 256 if k_acts else 32))
            s_at = b.udiv(first, ir.Constant(I64, 16 if k_acts else 32))
            return [
                Acts(
                    b,
                    b.gep(q, [first]),
                    b.gep(b.bitcast(d, ir.PointerType(F32)), [d_at]),
                    b.gep(b.bitcast(s, s_type), [s_at]),
                )
                for q, d, s in xrows
            ]

        def block(r: int, index: ir.Value) -> ir.Value:  # weight row r's block ``index``
            return b.gep(rows[r], [b.mul(index, ir.Constant(I64, nbytes))])

        def ahead(first: ir.Value, count: int) -> None:
            """Prefetch the next weight row's bytes beside these blocks' (the rows are read
            one after the other: without it the 8-row products waited on memory)."""
            prefetch(b, b.gep(block(TILE - 1, first), [wstride]), count * nbytes)

        nb = b.udiv(_i64(b, b.extract_value(qa.shape, 1)), ir.Constant(I64, per))
        start = ir.Constant(I64, 0)
        if group is not None:  # whole groups of blocks first, then the blocks left
            groups = b.udiv(nb, ir.Constant(I64, GROUP))
            with cgutils.for_range(b, groups) as loop:
                blk0 = b.mul(loop.index, ir.Constant(I64, GROUP))
                acts = acts_at(b.mul(blk0, ir.Constant(I64, per)))
                ahead(blk0, GROUP)
                for r in range(TILE):
                    ps = [block(r, b.add(blk0, ir.Constant(I64, j))) for j in range(GROUP)]
                    group(b, ps, acts, accs[r], scales[r])
            start = b.mul(groups, ir.Constant(I64, GROUP))
        with cgutils.for_range_slice(b, start, nb, ir.Constant(I64, 1)) as (index, _):
            acts = acts_at(b.mul(index, ir.Constant(I64, per)))
            ahead(index, 1)
            for r in range(TILE):
                emit(b, block(r, index), acts, accs[r], scales[r])
        ys0, ys1 = (b.extract_value(ya.strides, i) for i in range(2))
        for r in range(TILE):
            with cgutils.if_likely(b, valid[r]):
                col = b.mul(b.add(n_, ir.Constant(I64, r)), ys1)
                for i, a in enumerate(accs[r]):
                    total = a.total()
                    at = b.add(b.mul(b.add(m_, ir.Constant(I64, i)), ys0), col)
                    b.store(total, b.bitcast(byte_ptr(b, ya.data, at), ir.PointerType(F32)))
        return context.get_dummy_value()

    return sig, codegen


itile: Any = intrinsic(prefer_literal=True)(_itile)


PANEL = 32  # weight rows per pass of each group of activation rows


@njit(inline="always", **_OPTS)  # type: ignore[untyped-decorator]
def _tiles(fmt: int, xq: Any, xd: Any, xs: Any, w: Any, scale: Any, y: Any, a: int, z: int) -> None:
    """Weight rows ``a * TILE ..`` up to ``z * TILE`` against every activation row, in panels of
    :data:`PANEL` weight rows (kept in the L2 cache while each group of 8 activation rows goes
    over them)."""
    rows = xq.shape[0]
    eights = rows - rows % 8
    fours = rows - rows % 4
    rest = rows - fours  # 1-3 rows left: one pass of a tile that size, not 2 + 1
    for p0 in range(a, z, PANEL):
        p1 = min(z, p0 + PANEL)
        for m in range(0, eights, 8):
            for tile in range(p0, p1):
                itile(fmt, 8, w, tile * TILE, scale, xq, xd, xs, m, y)
        if fours > eights:
            for tile in range(p0, p1):
                itile(fmt, 4, w, tile * TILE, scale, xq, xd, xs, eights, y)
        if rest == 3:
            for tile in range(p0, p1):
                itile(fmt, 3, w, tile * TILE, scale, xq, xd, xs, fours, y)
        elif rest == 2:
            for tile in range(p0, p1):
                itile(fmt, 2, w, tile * TILE, scale, xq, xd, xs, fours, y)
        elif rest == 1:
            for tile in range(p0, p1):
                itile(fmt, 1, w, tile * TILE, scale, xq, xd, xs, fours, y)


@njit(parallel=True, **_OPTS)  # type: ignore[untyped-decorator]
def imatmul(fmt: int, xq: Any, xd: Any, xs: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    literally(fmt)
    tiles = (w.shape[0] + TILE - 1) // TILE
    workers = max(1, min(threads, tiles))
    step = (tiles + workers - 1) // workers
    for t in prange(workers):
        _tiles(fmt, xq, xd, xs, w, scale, y, t * step, min(tiles, (t + 1) * step))


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def imatmul_serial(fmt: int, xq: Any, xd: Any, xs: Any, w: Any, scale: Any, y: Any) -> None:
    literally(fmt)
    _tiles(fmt, xq, xd, xs, w, scale, y, 0, (w.shape[0] + TILE - 1) // TILE)


@njit(inline="always", **_OPTS)  # type: ignore[untyped-decorator]
def _product(fmt: int, xq: Any, xd: Any, xs: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    if threads > 1:
        imatmul(fmt, xq, xd, xs, w, scale, y, threads)
    else:
        imatmul_serial(fmt, xq, xd, xs, w, scale, y)


@njit(inline="always", **_OPTS)  # type: ignore[untyped-decorator]
def _run(fmt: int, x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    m, k = x.shape
    xq = np.empty((m, k), dtype=np.int8)
    xd = np.empty((m, k // 32), dtype=np.float32)
    xs = np.empty((m, k // 32), dtype=np.int32)
    if threads > 1 and m >= PARALLEL_ROWS:
        quantize_acts_rows(x, xq, xd, xs, threads)
    else:
        quantize_acts(x, xq, xd, xs)
    _product(fmt, xq, xd, xs, w, scale, y, threads)


@njit(inline="always", **_OPTS)  # type: ignore[untyped-decorator]
def _run_k(fmt: int, x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    m, k = x.shape
    xq = np.empty((m, k), dtype=np.int8)
    xd = np.empty((m, k // 256), dtype=np.float32)
    xs = np.empty((m, k // 16), dtype=np.int16)
    if threads > 1 and m >= PARALLEL_ROWS:
        quantize_acts_k_rows(x, xq, xd, xs, threads)
    else:
        quantize_acts_k(x, xq, xd, xs)
    _product(fmt, xq, xd, xs, w, scale, y, threads)


# Entry points by format (the code is a constant inside compiled code; see _quant_mm).
@njit(**_OPTS)  # type: ignore[untyped-decorator]
def im_q8_0(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    _run(0, x, w, scale, y, threads)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def im_q4_0(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    _run(1, x, w, scale, y, threads)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def im_q4_1(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    _run(2, x, w, scale, y, threads)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def im_q4_k(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    _run_k(3, x, w, scale, y, threads)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def im_q6_k(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    _run_k(4, x, w, scale, y, threads)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def im_int8(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    _run(5, x, w, scale, y, threads)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def im_q5_0(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    _run(6, x, w, scale, y, threads)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def im_q5_1(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    _run(7, x, w, scale, y, threads)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def im_q5_k(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    _run_k(8, x, w, scale, y, threads)


IMATMUL = {"q8_0": im_q8_0, "q4_0": im_q4_0, "q4_1": im_q4_1, "q4_k": im_q4_k, "q6_k": im_q6_k}
IMATMUL |= {"int8": im_int8, "q5_0": im_q5_0, "q5_1": im_q5_1, "q5_k": im_q5_k}
