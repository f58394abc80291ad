"""Matrix products with quantized weights: ``y = x @ dequant(w).T`` for a few rows of ``x``,
without a float copy of ``w`` (numba drivers around the LLVM IR of :mod:`engine.kernels._ir`;
imported lazily; numba caches the machine code on disk).

Each thread takes tiles of 4 weight rows. A tile is decoded chunk by chunk (``KC`` values of the
input dimension, 16 KB of float32 for the 4 rows: it stays in L1) and the input rows are
multiplied with the decoded chunk while it is hot, four at a time (:func:`dot4x4`: 16 products
sharing each load), the rest one by one. So the stored blocks are read from memory
once per call whatever the number of rows, and decoding (a few vector instructions per 8
values) is paid once per call and shared by all rows.

Batch invariance: every output element comes from the same operations (:func:`dot4` and
:func:`dot4x4` have the same 16 explicit lanes and order) over the same chunks of the input
dimension, summed in the same order, so a row's result does not depend on how many rows share
the call or where it sits among them.

The format is a literal argument (``numba.literally``): one driver source, one compiled
specialization per format, each cached separately.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import literally, njit, prange, types
from numba.core import cgutils, errors
from numba.extending import intrinsic

from engine.kernels._ir import (
    F32,
    FORMATS,
    I32,
    I64,
    LANES,
    byte_ptr,
    fma,
    load_vec,
    prefetch,
    reduce_lanes,
    store_vec,
    vec,
)

# numba caches a frozen app's functions too (in the user cache, keyed by the executable)
CACHE = True
KC = 1024  # input values decoded per chunk (a multiple of every block size)
TILE = 4  # weight rows per tile
FUSE_ROWS = 2  # up to this many input rows, decode into registers once per row (no buffer)
BLOCK = tuple(f[1] for f in FORMATS)  # values per block, by format code
_OPTS: dict[str, Any] = {"fastmath": False, "boundscheck": False, "nogil": True, "cache": CACHE}


def _array(context: Any, builder: ir.IRBuilder, ty: Any, value: ir.Value) -> Any:
    return context.make_array(ty)(context, builder, value)


def _i64(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    return b.sext(v, I64) if v.type.width < 64 else v


def _decode(
    typingctx: Any, fmt: Any, w: Any, n: Any, b0: Any, nb: Any, out: Any, r: Any, scale: Any
) -> Any:
    """Blocks ``b0 .. b0 + nb`` of weight row ``n`` of ``w`` (uint8 [N, row bytes]) ->
    ``out[r, 0 : nb * block]`` (float32 2-D), for the literal format code ``fmt``."""
    if not isinstance(fmt, types.IntegerLiteral):
        raise errors.RequireLiteralValue(fmt)
    _, per, nbytes, emit = FORMATS[fmt.literal_value]
    sig = types.void(fmt, w, n, b0, nb, out, r, scale)

    def codegen(context: Any, b: ir.IRBuilder, signature: Any, args: Any) -> Any:
        wa = _array(context, b, signature.args[1], args[1])
        oa = _array(context, b, signature.args[5], args[5])
        n_, b0_, nb_, r_ = (_i64(b, a) for a in (args[2], args[3], args[4], args[6]))
        sc = args[7] if args[7].type == F32 else b.fptrunc(args[7], F32)
        wrow = byte_ptr(b, wa.data, b.mul(n_, b.extract_value(wa.strides, 0)))
        orow = byte_ptr(b, oa.data, b.mul(r_, b.extract_value(oa.strides, 0)))
        ahead = b.mul(ir.Constant(I64, TILE), b.extract_value(wa.strides, 0))
        with cgutils.for_range(b, nb_) as loop:
            p = b.gep(wrow, [b.mul(b.add(b0_, loop.index), ir.Constant(I64, nbytes))])
            prefetch(b, b.gep(p, [ahead]), nbytes)  # the next tile's row, read next
            o = b.mul(loop.index, ir.Constant(I64, per * 4))
            for off, v in emit(b, p, sc):
                store_vec(b, v, b.gep(orow, [b.add(o, ir.Constant(I64, off * 4))]))
        return context.get_dummy_value()

    return sig, codegen


decode: Any = intrinsic(prefer_literal=True)(_decode)


def _dot4(typingctx: Any, buf: Any, x: Any, m: Any, k0: Any, n: Any) -> Any:
    """Rows 0-3 of ``buf`` (float32 2-D) against ``x[m, k0 : k0 + n]`` (float32 2-D), ``n`` a
    multiple of 16: the 4 dot products, each over 16 explicit lanes."""
    ret = types.UniTuple(types.float32, 4)
    sig = ret(buf, x, m, k0, n)

    def codegen(context: Any, b: ir.IRBuilder, signature: Any, args: Any) -> Any:
        ba = _array(context, b, signature.args[0], args[0])
        xa = _array(context, b, signature.args[1], args[1])
        m_, k0_, n_ = (_i64(b, a) for a in args[2:5])
        xrow = byte_ptr(
            b,
            xa.data,
            b.add(b.mul(m_, b.extract_value(xa.strides, 0)), b.mul(k0_, ir.Constant(I64, 4))),
        )
        bstride = b.extract_value(ba.strides, 0)
        wrows = [byte_ptr(b, ba.data, b.mul(bstride, ir.Constant(I64, r))) for r in range(4)]
        v8 = vec(F32, 8)
        accs = [cgutils.alloca_once(b, v8) for _ in range(8)]
        for a in accs:
            b.store(ir.Constant(v8, [0.0] * 8), a)
        with cgutils.for_range(b, b.udiv(n_, ir.Constant(I64, LANES))) as loop:
            off = b.mul(loop.index, ir.Constant(I64, LANES * 4))
            halves = [b.add(off, ir.Constant(I64, 32 * h)) for h in range(2)]
            xs = [load_vec(b, b.gep(xrow, [o]), F32, 8) for o in halves]
            for r in range(4):
                for h in range(2):
                    wv = load_vec(b, b.gep(wrows[r], [halves[h]]), F32, 8)
                    acc = accs[2 * r + h]
                    b.store(fma(b, wv, xs[h], b.load(acc)), acc)
        return context.make_tuple(b, ret, _sums(b, accs))

    return sig, codegen


dot4: Any = intrinsic(_dot4)


def _dot4x4(typingctx: Any, buf: Any, x: Any, m: Any, k0: Any, n: Any) -> Any:
    """Rows 0-3 of ``buf`` against rows ``m .. m + 3`` of ``x`` at ``k0 .. k0 + n``: 16 dot
    products (element 4 i + r: input row m + i, buffer row r) sharing each vector load, each
    with exactly :func:`dot4`'s lanes and order (16-lane accumulators, the same fixed tree), so
    an element's bits do not depend on which of the two computed it."""
    ret = types.UniTuple(types.float32, 16)
    sig = ret(buf, x, m, k0, n)

    def codegen(context: Any, b: ir.IRBuilder, signature: Any, args: Any) -> Any:
        ba = _array(context, b, signature.args[0], args[0])
        xa = _array(context, b, signature.args[1], args[1])
        m_, k0_, n_ = (_i64(b, a) for a in args[2:5])
        xstride = b.extract_value(xa.strides, 0)
        kbytes = b.mul(k0_, ir.Constant(I64, 4))
        xrows = [
            byte_ptr(b, xa.data, b.add(b.mul(b.add(m_, ir.Constant(I64, i)), xstride), kbytes))
            for i in range(4)
        ]
        bstride = b.extract_value(ba.strides, 0)
        wrows = [byte_ptr(b, ba.data, b.mul(bstride, ir.Constant(I64, r))) for r in range(4)]
        v16 = vec(F32, LANES)
        accs = [cgutils.alloca_once(b, v16) for _ in range(16)]
        for a in accs:
            b.store(ir.Constant(v16, [0.0] * LANES), a)
        with cgutils.for_range(b, b.udiv(n_, ir.Constant(I64, LANES))) as loop:
            off = b.mul(loop.index, ir.Constant(I64, LANES * 4))
            xs = [load_vec(b, b.gep(p, [off]), F32, LANES) for p in xrows]
            ws = [load_vec(b, b.gep(p, [off]), F32, LANES) for p in wrows]
            for i in range(4):
                for r in range(4):
                    acc = accs[4 * i + r]
                    b.store(fma(b, ws[r], xs[i], b.load(acc)), acc)
        return context.make_tuple(b, ret, [reduce_lanes(b, b.load(a)) for a in accs])

    return sig, codegen


dot4x4: Any = intrinsic(_dot4x4)


def _fused4(
    typingctx: Any, fmt: Any, w: Any, n: Any, scale: Any, b0: Any, nb: Any, x: Any, m: Any
) -> Any:
    """Weight rows ``n .. n + 3`` (clamped to the last row), blocks ``b0 .. b0 + nb``, decoded
    into registers and multiplied with ``x[m]`` at the same positions: the 4 dot products, with
    exactly :func:`dot4`'s lanes and order (so the result is bit-identical to decoding into a
    buffer first). Used when there are too few input rows to share a decoded buffer."""
    if not isinstance(fmt, types.IntegerLiteral):
        raise errors.RequireLiteralValue(fmt)
    _, per, nbytes, emit = FORMATS[fmt.literal_value]
    ret = types.UniTuple(types.float32, 4)
    sig = ret(fmt, w, n, scale, b0, nb, x, m)

    def codegen(context: Any, b: ir.IRBuilder, signature: Any, args: Any) -> Any:
        wa = _array(context, b, signature.args[1], args[1])
        sa = _array(context, b, signature.args[3], args[3])
        xa = _array(context, b, signature.args[6], args[6])
        n_, b0_, nb_, m_ = (_i64(b, a) for a in (args[2], args[4], args[5], args[7]))
        last = b.sub(_i64(b, b.extract_value(wa.shape, 0)), ir.Constant(I64, 1))
        wstride = b.extract_value(wa.strides, 0)
        rows, scales = [], []
        for r in range(4):
            nr = b.add(n_, ir.Constant(I64, r))
            nr = b.select(b.icmp_signed(">", nr, last), last, nr)
            rows.append(byte_ptr(b, wa.data, b.mul(nr, wstride)))
            scales.append(b.load(b.gep(sa.data, [nr])))
        xrow = byte_ptr(b, xa.data, b.mul(m_, b.extract_value(xa.strides, 0)))
        ahead = b.mul(ir.Constant(I64, 4), wstride)
        v8 = vec(F32, 8)
        accs = [cgutils.alloca_once(b, v8) for _ in range(8)]
        for a in accs:
            b.store(ir.Constant(v8, [0.0] * 8), a)
        with cgutils.for_range(b, nb_) as loop:
            blk = b.add(b0_, loop.index)
            xblk = b.gep(xrow, [b.mul(blk, ir.Constant(I64, per * 4))])
            for r in range(4):  # (two rows per pass measured slower: x read twice)
                nxt = b.gep(rows[r], [b.add(b.mul(blk, ir.Constant(I64, nbytes)), ahead)])
                prefetch(b, nxt, nbytes)  # the next tile's row
                _fused_block(b, emit, rows[r], scales[r], blk, nbytes, xblk, accs[2 * r :])
        return context.make_tuple(b, ret, _sums(b, accs))

    return sig, codegen


def _fused_block(
    b: ir.IRBuilder,
    emit: Any,
    row: ir.Value,
    scale: ir.Value,
    blk: ir.Value,
    nbytes: int,
    xblk: ir.Value,
    accs: list[ir.Value],
) -> None:
    """One stored block of one weight row, decoded and multiplied into the row's two 8-lane
    accumulators ``accs[0:2]`` (lane l of the 16 takes the elements ≡ l mod 16, in order)."""
    p = b.gep(row, [b.mul(blk, ir.Constant(I64, nbytes))])
    for off, v in emit(b, p, scale):
        for j in range(v.type.count // 8):
            wv = v
            if v.type.count > 8:
                idx = ir.Constant(vec(I32, 8), list(range(8 * j, 8 * j + 8)))
                wv = b.shuffle_vector(v, v, idx)
            e = off + 8 * j
            xv = load_vec(b, b.gep(xblk, [ir.Constant(I64, 4 * e)]), F32, 8)
            acc = accs[(e // 8) % 2]
            b.store(fma(b, wv, xv, b.load(acc)), acc)


fused4: Any = intrinsic(prefer_literal=True)(_fused4)


def _sums(b: ir.IRBuilder, accs: list[ir.Value]) -> list[ir.Value]:
    """Per output r: its two 8-lane accumulators as 16 lanes, reduced by the fixed tree."""
    out = []
    for r in range(len(accs) // 2):
        lanes = b.shuffle_vector(
            b.load(accs[2 * r]),
            b.load(accs[2 * r + 1]),
            ir.Constant(vec(I32, 16), list(range(16))),
        )
        out.append(reduce_lanes(b, lanes))
    return out


@njit(inline="always", **_OPTS)  # type: ignore[untyped-decorator]
def _tiles(fmt: int, x: Any, w: Any, scale: Any, y: Any, first: int, stop: int) -> None:
    """Tiles ``first .. stop`` of 4 weight rows: y[:, rows] = x @ dequant(w[rows]).T."""
    per = BLOCK[fmt]
    n_rows = w.shape[0]
    k_in = x.shape[1]
    m_rows = x.shape[0]
    buf = np.empty((TILE, KC), dtype=np.float32)
    acc = np.empty((m_rows, TILE), dtype=np.float32)
    for tile in range(first, stop):
        acc[:, :] = 0.0
        for k0 in range(0, k_in, KC):
            kn = min(KC, k_in - k0)
            if m_rows > FUSE_ROWS:
                for r in range(TILE):
                    n = min(tile * TILE + r, n_rows - 1)  # a short last tile repeats a row
                    decode(fmt, w, n, k0 // per, kn // per, buf, r, scale[n])
            m0 = 0
            if m_rows > FUSE_ROWS:  # four input rows at a time share the buffer's loads
                while m0 + 4 <= m_rows:
                    q = dot4x4(buf, x, m0, k0, kn)
                    for i in range(4):
                        for r in range(TILE):
                            acc[m0 + i, r] += q[4 * i + r]
                    m0 += 4
            for m in range(m0, m_rows):
                if m_rows > FUSE_ROWS:
                    a0, a1, a2, a3 = dot4(buf, x, m, k0, kn)
                else:
                    a0, a1, a2, a3 = fused4(fmt, w, tile * TILE, scale, k0 // per, kn // per, x, m)
                acc[m, 0] += a0
                acc[m, 1] += a1
                acc[m, 2] += a2
                acc[m, 3] += a3
        n0 = tile * TILE
        for m in range(m_rows):
            for r in range(min(TILE, n_rows - n0)):
                y[m, n0 + r] = acc[m, r]


@njit(parallel=True, **_OPTS)  # type: ignore[untyped-decorator]
def matmul(fmt: int, x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    """y [M, N] = x [M, K] @ dequant(w).T for weight rows w [N, bytes] of format ``fmt``;
    ``threads`` workers take equal runs of tiles (the split never changes a result)."""
    literally(fmt)
    tiles = (w.shape[0] + TILE - 1) // TILE
    workers = max(1, min(threads, tiles))
    step = (tiles + workers - 1) // workers
    for t in prange(workers):
        _tiles(fmt, x, w, scale, y, t * step, min(tiles, (t + 1) * step))


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def matmul_serial(fmt: int, x: Any, w: Any, scale: Any, y: Any) -> None:
    """:func:`matmul` on the calling thread alone: one thread never waits on a pool barrier
    (on a busy machine waking the pool's other threads cost milliseconds per product)."""
    literally(fmt)
    _tiles(fmt, x, w, scale, y, 0, (w.shape[0] + TILE - 1) // TILE)


@njit(parallel=True, **_OPTS)  # type: ignore[untyped-decorator]
def take_rows(fmt: int, w: Any, scale: Any, rows: Any, out: Any) -> None:
    """out [R, K] = dequant(w)[rows] (embedding lookups, prefill tiles, tests)."""
    literally(fmt)
    per = BLOCK[fmt]
    for i in prange(rows.shape[0]):
        n = rows[i]
        decode(fmt, w, n, 0, out.shape[1] // per, out, i, scale[n])


# Entry points, one per format: the format code is a constant inside compiled code (a call
# from Python with ``fmt`` would go through numba's literal dispatch, ~100 ms a call).
@njit(**_OPTS)  # type: ignore[untyped-decorator]
def mm_q8_0(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    if threads > 1:
        matmul(0, x, w, scale, y, threads)
    else:
        matmul_serial(0, x, w, scale, y)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def mm_q4_0(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    if threads > 1:
        matmul(1, x, w, scale, y, threads)
    else:
        matmul_serial(1, x, w, scale, y)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def mm_q4_1(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    if threads > 1:
        matmul(2, x, w, scale, y, threads)
    else:
        matmul_serial(2, x, w, scale, y)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def mm_q4_k(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    if threads > 1:
        matmul(3, x, w, scale, y, threads)
    else:
        matmul_serial(3, x, w, scale, y)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def mm_q6_k(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    if threads > 1:
        matmul(4, x, w, scale, y, threads)
    else:
        matmul_serial(4, x, w, scale, y)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def mm_int8(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    if threads > 1:
        matmul(5, x, w, scale, y, threads)
    else:
        matmul_serial(5, x, w, scale, y)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def rows_q8_0(w: Any, scale: Any, rows: Any, out: Any) -> None:
    take_rows(0, w, scale, rows, out)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def rows_q4_0(w: Any, scale: Any, rows: Any, out: Any) -> None:
    take_rows(1, w, scale, rows, out)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def rows_q4_1(w: Any, scale: Any, rows: Any, out: Any) -> None:
    take_rows(2, w, scale, rows, out)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def rows_q4_k(w: Any, scale: Any, rows: Any, out: Any) -> None:
    take_rows(3, w, scale, rows, out)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def rows_q6_k(w: Any, scale: Any, rows: Any, out: Any) -> None:
    take_rows(4, w, scale, rows, out)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def rows_int8(w: Any, scale: Any, rows: Any, out: Any) -> None:
    take_rows(5, w, scale, rows, out)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def mm_q5_0(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    if threads > 1:
        matmul(6, x, w, scale, y, threads)
    else:
        matmul_serial(6, x, w, scale, y)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def mm_q5_1(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    if threads > 1:
        matmul(7, x, w, scale, y, threads)
    else:
        matmul_serial(7, x, w, scale, y)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def mm_q5_k(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    if threads > 1:
        matmul(8, x, w, scale, y, threads)
    else:
        matmul_serial(8, x, w, scale, y)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def rows_q5_0(w: Any, scale: Any, rows: Any, out: Any) -> None:
    take_rows(6, w, scale, rows, out)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def rows_q5_1(w: Any, scale: Any, rows: Any, out: Any) -> None:
    take_rows(7, w, scale, rows, out)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def rows_q5_k(w: Any, scale: Any, rows: Any, out: Any) -> None:
    take_rows(8, w, scale, rows, out)


MATMUL = {"q8_0": mm_q8_0, "q4_0": mm_q4_0, "q4_1": mm_q4_1, "q4_k": mm_q4_k}
MATMUL |= {"q6_k": mm_q6_k, "int8": mm_int8, "q5_0": mm_q5_0, "q5_1": mm_q5_1, "q5_k": mm_q5_k}
ROWS = {"q8_0": rows_q8_0, "q4_0": rows_q4_0, "q4_1": rows_q4_1, "q4_k": rows_q4_k}
ROWS |= {"q6_k": rows_q6_k, "int8": rows_int8, "q5_0": rows_q5_0, "q5_1": rows_q5_1}
ROWS |= {"q5_k": rows_q5_k}
