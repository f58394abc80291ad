"""Quantized matrix products with int8 activations (numba drivers around
:mod:`engine.kernels._ir_int`; imported lazily, cached by numba).

``y = x @ dequant(w).T`` with ``x`` quantized per row in blocks of 32 first
(:func:`quantize_acts`), then every block product done in integers: ~3x less work per weight
than decoding weights to float (:mod:`engine.kernels._quant_mm`), at the price of rounding the
activations to 8 bits per block (llama.cpp's rule; the quality cost is measured in
docs/performance.md). Batch-invariant: a row's quantization and sums involve that row only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import literally, njit, prange, types
from numba.core import cgutils, errors
from numba.extending import intrinsic

from engine.kernels._ir import F32, FORMATS, I64, byte_ptr, reduce_lanes
from engine.kernels._ir_int import INT_FORMATS, Acc, Acts

# numba caches a frozen app's functions too (in the user cache, keyed by the executable)
CACHE = True
TILE = 4
_OPTS: dict[str, Any] = {"boundscheck": False, "nogil": True, "cache": CACHE}


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def quantize_acts(x: Any, q: Any, d: Any, s: Any) -> None:
    """x [M, K] float32 -> q int8 [M, K], d [M, K/32] (scale of each block of 32: max|x|/127),
    s [M, K/16] (d times the sum of each 16 quantized values)."""
    for m in range(x.shape[0]):
        for blk in range(x.shape[1] // 32):
            o = blk * 32
            amax = np.float32(0.0)
            for i in range(32):
                amax = max(amax, abs(x[m, o + i]))
            dd = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            d[m, blk] = dd
            for h in range(2):
                tot = 0
                for i in range(16):
                    v = math.floor(x[m, o + 16 * h + i] * inv + np.float32(0.5))
                    v = min(127, max(-127, v))
                    q[m, o + 16 * h + i] = v
                    tot += v
                s[m, 2 * blk + h] = dd * np.float32(tot)


def _array(context: Any, builder: ir.IRBuilder, ty: Any, value: ir.Value) -> Any:
    return context.make_array(ty)(context, builder, value)


def _i64(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    return b.sext(v, I64) if v.type.width < 64 else v


def _idot4(
    typingctx: Any, fmt: Any, w: Any, n: Any, scale: Any, xq: Any, xd: Any, xs: Any, m: Any
) -> Any:
    """Weight rows ``n .. n + 3`` (clamped to the last) against activation row ``m``: the 4
    dot products over the whole row, block by block in integers."""
    if not isinstance(fmt, types.IntegerLiteral):
        raise errors.RequireLiteralValue(fmt)
    _, per, nbytes, _ = FORMATS[fmt.literal_value]
    emit = INT_FORMATS[fmt.literal_value]
    ret = types.UniTuple(types.float32, 4)
    sig = ret(fmt, w, n, scale, xq, xd, xs, m)

    def codegen(context: Any, b: ir.IRBuilder, signature: Any, args: Any) -> Any:
        wa = _array(context, b, signature.args[1], args[1])
        sa = _array(context, b, signature.args[3], args[3])
        qa, da, ssa = (_array(context, b, signature.args[i], args[i]) for i in (4, 5, 6))
        n_, m_ = _i64(b, args[2]), _i64(b, args[7])
        nb = b.udiv(_i64(b, b.extract_value(qa.shape, 1)), ir.Constant(I64, per))
        last = b.sub(_i64(b, b.extract_value(wa.shape, 0)), ir.Constant(I64, 1))
        wstride = b.extract_value(wa.strides, 0)
        rows, scales, accs = [], [], []
        for r in range(TILE):
            nr = b.add(n_, ir.Constant(I64, r))
            nr = b.select(b.icmp_signed(">", nr, last), last, nr)
            rows.append(byte_ptr(b, wa.data, b.mul(nr, wstride)))
            scales.append(b.load(b.gep(sa.data, [nr])))
            accs.append(Acc(b))
        qrow = byte_ptr(b, qa.data, b.mul(m_, b.extract_value(qa.strides, 0)))
        drow = byte_ptr(b, da.data, b.mul(m_, b.extract_value(da.strides, 0)))
        srow = byte_ptr(b, ssa.data, b.mul(m_, b.extract_value(ssa.strides, 0)))
        with cgutils.for_range(b, nb) as loop:
            first = b.mul(loop.index, ir.Constant(I64, per))  # element index
            acts = Acts(
                b,
                b.gep(qrow, [first]),
                b.gep(b.bitcast(drow, ir.PointerType(F32)), [b.udiv(first, ir.Constant(I64, 32))]),
                b.gep(b.bitcast(srow, ir.PointerType(F32)), [b.udiv(first, ir.Constant(I64, 16))]),
            )
            for r in range(TILE):
                p = b.gep(rows[r], [b.mul(loop.index, ir.Constant(I64, nbytes))])
                emit(b, p, acts, accs[r], scales[r])
        sums = [b.fadd(reduce_lanes(b, b.load(a.v)), b.load(a.s)) for a in accs]
        return context.make_tuple(b, ret, sums)

    return sig, codegen


idot4: Any = intrinsic(prefer_literal=True)(_idot4)


@njit(inline="always", **_OPTS)  # type: ignore[untyped-decorator]
def _tiles(fmt: int, xq: Any, xd: Any, xs: Any, w: Any, scale: Any, y: Any, a: int, z: int) -> None:
    n_rows = w.shape[0]
    for tile in range(a, z):
        n0 = tile * TILE
        for m in range(xq.shape[0]):
            s0, s1, s2, s3 = idot4(fmt, w, n0, scale, xq, xd, xs, m)
            y[m, n0] = s0
            if n0 + 1 < n_rows:
                y[m, n0 + 1] = s1
            if n0 + 2 < n_rows:
                y[m, n0 + 2] = s2
            if n0 + 3 < n_rows:
                y[m, n0 + 3] = s3


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
def _run(fmt: int, x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    m, k = x.shape
    xq = np.empty((m, k), dtype=np.int8)
    xd = np.empty((m, k // 32), dtype=np.float32)
    xs = np.empty((m, k // 16), dtype=np.float32)
    quantize_acts(x, xq, xd, xs)
    if threads > 1:
        imatmul(fmt, xq, xd, xs, w, scale, y, threads)
    else:
        imatmul_serial(fmt, xq, xd, xs, w, scale, y)


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
    _run(3, x, w, scale, y, threads)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def im_q6_k(x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    _run(4, x, w, scale, y, threads)


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
    _run(8, x, w, scale, y, threads)


IMATMUL = {"q8_0": im_q8_0, "q4_0": im_q4_0, "q4_1": im_q4_1, "q4_k": im_q4_k, "q6_k": im_q6_k}
IMATMUL |= {"int8": im_int8, "q5_0": im_q5_0, "q5_1": im_q5_1, "q5_k": im_q5_k}
