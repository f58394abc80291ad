"""Integer dot products of quantized weight blocks with int8 activations (LLVM IR emitters).

The activations of a row are quantized per block of 32 (int8 values, a float32 scale, and the
dequantized sum of every 16 values, for the formats' offsets and minimums), or per block of 256
for the K-quants (:data:`K_CODES`), the way llama.cpp multiplies its blocks. A block's 32
products are then one instruction where the host has AVX512-VNNI or AVX-VNNI (``vpdpbusd``)
and two on AVX2 (``vpmaddubsw``: unsigned weight bytes times signed activation bytes, pairs
summed to 16 bits; ``vpmaddwd``: pairs summed to 32 bits), about a quarter of the work of
widening every weight to float. Where the host has no AVX2 the same sums are written in
portable IR (exact integers every way, so all give the same bits).

Each emitter decodes a weight block once and adds its contribution to several activation rows'
accumulators (one ``Acc`` per row): ``acc_v`` (8 floats, integer partial sums times the product
of the weight and activation scales) and ``acc_s`` (a float, offset/minimum terms). Integer
sums are exact and every float operation has a fixed order, so the result of a row depends only
on that row (batch invariance).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import cache

from llvmlite import ir
from numba.core import cgutils

from engine.kernels import cpu
from engine.kernels._ir import (
    F32,
    I8,
    I32,
    I64,
    _high_bits,
    _k4_scale_min,
    _nibbles,
    byte_ptr,
    const_vec,
    fma,
    load_half,
    load_vec,
    splat,
    vec,
)

I16 = ir.IntType(16)


@cache
def _avx2() -> bool:
    return "avx2" in cpu.features()


@cache
def _vnni() -> bool:
    """256-bit integer dot products (AVX512-VNNI with VL, or AVX-VNNI)."""
    f = cpu.features()
    return ("avx512vnni" in f and "avx512vl" in f) or "avxvnni" in f


def _x86(b: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Value]) -> ir.Value:
    fn = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(ret, [a.type for a in args]), name
    )
    return b.call(fn, args)


def _pair_sums16(b: ir.IRBuilder, p: ir.Value) -> ir.Value:
    """<32 x i32> products -> <16 x i32>: sums of lanes (2i, 2i + 1)."""
    ev = b.shuffle_vector(p, p, ir.Constant(vec(I32, 16), list(range(0, 32, 2))))
    od = b.shuffle_vector(p, p, ir.Constant(vec(I32, 16), list(range(1, 32, 2))))
    return b.add(ev, od)


def _pairs(b: ir.IRBuilder, p: ir.Value) -> ir.Value:
    """<16 x i32> -> <8 x i32>: sums of lanes (2i, 2i + 1)."""
    ev = b.shuffle_vector(p, p, ir.Constant(vec(I32, 8), list(range(0, 16, 2))))
    od = b.shuffle_vector(p, p, ir.Constant(vec(I32, 8), list(range(1, 16, 2))))
    return b.add(ev, od)


def pairs_u8s8(b: ir.IRBuilder, u: ir.Value, s: ir.Value) -> ir.Value:
    """<16 x i16>: lane j = u[2j] * s[2j] + u[2j + 1] * s[2j + 1] (u unsigned, s signed; the
    callers keep |sums| < 2^15, so AVX2's saturating ``vpmaddubsw`` is exact)."""
    if _avx2():
        return _x86(b, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [u, s])
    prod = b.mul(b.zext(u, vec(I32, 32)), b.sext(s, vec(I32, 32)))  # [32]
    return b.trunc(_pair_sums16(b, prod), vec(I16, 16))


def _abs_sign(b: ir.IRBuilder, w: ir.Value, s: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Signed bytes w, s -> (|w|, s carrying w's sign): the same products, with the unsigned
    first operand the x86 byte dot products need (AVX2 only)."""
    absw = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(vec(I8, 32), [vec(I8, 32), ir.IntType(1)]), "llvm.abs.v32i8"
    )
    u = b.call(absw, [w, ir.Constant(ir.IntType(1), 0)])
    return u, _x86(b, "llvm.x86.avx2.psign.b", vec(I8, 32), [s, w])


def dot_u8s8(b: ir.IRBuilder, u: ir.Value, s: ir.Value) -> ir.Value:
    """<8 x i32>: lane j = sum of u[i] * s[i] for i in 4j .. 4j + 3 (u unsigned < 128, s
    signed bytes)."""
    if _vnni():  # one instruction: 4 products summed per 32-bit lane
        zero = ir.Constant(vec(I32, 8), [0] * 8)
        args = [zero, b.bitcast(u, vec(I32, 8)), b.bitcast(s, vec(I32, 8))]
        return _x86(b, "llvm.x86.avx512.vpdpbusd.256", vec(I32, 8), args)
    if _avx2():
        p16 = pairs_u8s8(b, u, s)
        return _x86(b, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [p16, const_vec(I16, 16, 1)])
    prod = b.mul(b.zext(u, vec(I32, 32)), b.sext(s, vec(I32, 32)))  # [32]
    return _pairs(b, _pair_sums16(b, prod))


def dot_s8s8(b: ir.IRBuilder, w: ir.Value, s: ir.Value) -> ir.Value:
    """As :func:`dot_u8s8` for signed weights."""
    if _avx2():
        return dot_u8s8(b, *_abs_sign(b, w, s))
    prod = b.mul(b.sext(w, vec(I32, 32)), b.sext(s, vec(I32, 32)))
    return _pairs(b, _pair_sums16(b, prod))


def pairs_s8s8(b: ir.IRBuilder, w: ir.Value, s: ir.Value) -> ir.Value:
    """As :func:`pairs_u8s8` for signed ``w``."""
    if _avx2():
        return pairs_u8s8(b, *_abs_sign(b, w, s))
    prod = b.mul(b.sext(w, vec(I32, 32)), b.sext(s, vec(I32, 32)))  # [32]
    return b.trunc(_pair_sums16(b, prod), vec(I16, 16))


def acc_pairs(b: ir.IRBuilder, acc: ir.Value, p16: ir.Value, w16: ir.Value) -> ir.Value:
    """acc <8 x i32> + (lane j: p16[2j] * w16[2j] + p16[2j + 1] * w16[2j + 1]): one
    ``vpdpwssd`` with VNNI, ``vpmaddwd`` + add on AVX2."""
    if _vnni():
        args = [acc, b.bitcast(p16, vec(I32, 8)), b.bitcast(w16, vec(I32, 8))]
        return _x86(b, "llvm.x86.avx512.vpdpwssd.256", vec(I32, 8), args)
    if _avx2():
        return b.add(acc, _x86(b, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [p16, w16]))
    return b.add(acc, _pairs(b, b.mul(b.sext(p16, vec(I32, 16)), b.sext(w16, vec(I32, 16)))))


def acc_u8s8(b: ir.IRBuilder, acc: ir.Value, u: ir.Value, s: ir.Value) -> ir.Value:
    """acc <8 x i32> + :func:`dot_u8s8` (one ``vpdpbusd`` with VNNI)."""
    if _vnni():
        args = [acc, b.bitcast(u, vec(I32, 8)), b.bitcast(s, vec(I32, 8))]
        return _x86(b, "llvm.x86.avx512.vpdpbusd.256", vec(I32, 8), args)
    return b.add(acc, dot_u8s8(b, u, s))


K_CODES = frozenset((3, 4, 8))  # q4_k, q6_k, q5_k: activations in blocks of 256 (Q8_K)
"""Formats whose activations are quantized per block of 256 (one scale per super-block, and
integer sums of every 16 values), as llama.cpp's Q8_K does for the K-quants: a super-block's
sub-block products are then scaled and added in integers and converted to float once, instead
of once per 32 values. For these formats ``Acts.d`` points at the per-256 scales and ``Acts.s``
at int32 sums."""


class Acts:
    """Pointers to one activation row's quantized form at a block: int8 values ``q``, the
    scales ``d`` (per 32, or per 256 for :data:`K_CODES`) and the sums of every 16 values
    ``s`` (dequantized floats, or int32 for :data:`K_CODES`), all at element offsets."""

    def __init__(self, b: ir.IRBuilder, q: ir.Value, d: ir.Value, s: ir.Value) -> None:
        self.b, self.q, self.d, self.s = b, q, d, s

    def values(self, first: int) -> ir.Value:
        """<32 x i8> activations ``first .. first + 32``."""
        return load_vec(self.b, byte_ptr(self.b, self.q, first), I8, 32)

    def scale(self, first: int) -> ir.Value:
        """Scale of the 32-block holding element ``first``."""
        return self.b.load(self.b.gep(self.d, [ir.Constant(I64, first // 32)]))

    def sum16(self, first: int) -> ir.Value:
        """Dequantized sum of elements ``first .. first + 16``."""
        return self.b.load(self.b.gep(self.s, [ir.Constant(I64, first // 16)]))

    def sum32(self, first: int) -> ir.Value:
        return self.b.fadd(self.sum16(first), self.sum16(first + 16))


class Acc:
    """A row's accumulators (allocas: SROA keeps them in registers)."""

    def __init__(self, b: ir.IRBuilder) -> None:
        self.b = b
        self.v = cgutils.alloca_once(b, vec(F32, 8))
        self.s = cgutils.alloca_once(b, F32)
        b.store(ir.Constant(vec(F32, 8), [0.0] * 8), self.v)
        b.store(ir.Constant(F32, 0.0), self.s)

    def add_int(self, isum: ir.Value, scale: ir.Value) -> None:
        b = self.b
        b.store(fma(b, b.sitofp(isum, vec(F32, 8)), splat(b, scale, 8), b.load(self.v)), self.v)

    def add(self, value: ir.Value) -> None:
        self.b.store(self.b.fadd(self.b.load(self.s), value), self.s)


def _u32(b: ir.IRBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """Two <16 x i8> halves -> <32 x i8> (values 0-15, then 16-31)."""
    return b.shuffle_vector(lo, hi, ir.Constant(vec(I32, 32), list(range(32))))


def _each(
    xs: Sequence[Acts], accs: Sequence[Acc], first: int, dot: Callable[[ir.Value], ir.Value]
) -> Iterator[tuple[Acts, Acc, ir.Value]]:
    """For every activation row: its Acts, its Acc and the integer dot of the decoded block
    with its values ``first .. first + 32`` (the block is decoded once for all rows)."""
    for x, acc in zip(xs, accs, strict=True):
        yield x, acc, dot(x.values(first))


def int_q8_0(
    b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], scale: ir.Value
) -> None:
    w = load_vec(b, byte_ptr(b, p, 2), I8, 32)
    d = load_half(b, p)
    for x, acc, isum in _each(xs, accs, 0, lambda v: dot_s8s8(b, w, v)):
        acc.add_int(isum, b.fmul(d, x.scale(0)))


def int_int8(
    b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], scale: ir.Value
) -> None:
    w = load_vec(b, p, I8, 32)
    for x, acc, isum in _each(xs, accs, 0, lambda v: dot_s8s8(b, w, v)):
        acc.add_int(isum, b.fmul(scale, x.scale(0)))


def int_q4_0(
    b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], scale: ir.Value
) -> None:
    d = load_half(b, p)
    u = _u32(b, *_nibbles(b, byte_ptr(b, p, 2), 16))
    for x, acc, isum in _each(xs, accs, 0, lambda v: dot_u8s8(b, u, v)):
        acc.add_int(isum, b.fmul(d, x.scale(0)))
        acc.add(b.fmul(b.fmul(d, ir.Constant(F32, -8.0)), x.sum32(0)))


def int_q4_1(
    b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], scale: ir.Value
) -> None:
    u = _u32(b, *_nibbles(b, byte_ptr(b, p, 4), 16))
    d, mn = load_half(b, p), load_half(b, byte_ptr(b, p, 2))
    for x, acc, isum in _each(xs, accs, 0, lambda v: dot_u8s8(b, u, v)):
        acc.add_int(isum, b.fmul(d, x.scale(0)))
        acc.add(b.fmul(mn, x.sum32(0)))


def _q5_u(b: ir.IRBuilder, qs: ir.Value, qh_ptr: ir.Value) -> ir.Value:
    qh = b.load(b.bitcast(qh_ptr, ir.PointerType(I32)), align=1)
    lo, hi = _nibbles(b, qs, 16)
    return _u32(b, b.or_(lo, _high_bits(b, qh, 0, 16)), b.or_(hi, _high_bits(b, qh, 16, 16)))


def int_q5_0(
    b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], scale: ir.Value
) -> None:
    d = load_half(b, p)
    u = _q5_u(b, byte_ptr(b, p, 6), byte_ptr(b, p, 2))
    for x, acc, isum in _each(xs, accs, 0, lambda v: dot_u8s8(b, u, v)):
        acc.add_int(isum, b.fmul(d, x.scale(0)))
        acc.add(b.fmul(b.fmul(d, ir.Constant(F32, -16.0)), x.sum32(0)))


def int_q5_1(
    b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], scale: ir.Value
) -> None:
    u = _q5_u(b, byte_ptr(b, p, 8), byte_ptr(b, p, 4))
    d, mn = load_half(b, p), load_half(b, byte_ptr(b, p, 2))
    for x, acc, isum in _each(xs, accs, 0, lambda v: dot_u8s8(b, u, v)):
        acc.add_int(isum, b.fmul(d, x.scale(0)))
        acc.add(b.fmul(mn, x.sum32(0)))


def _int_k(
    b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], five: bool
) -> None:
    """Q4_K/Q5_K super-block against per-256 activations, in integers per row pair: the
    values' products times their sub-block's 6-bit scale (``vpmaddubsw`` then ``vpdpwssd``),
    and the activations times the sub-block's minimum (``vpdpbusd``), each summed over the
    super-block in 8 int32 lanes (exact: at most ~8 M), then converted and scaled once."""
    d = load_half(b, p)
    dmin = load_half(b, byte_ptr(b, p, 2))
    s = byte_ptr(b, p, 4)
    qh = load_vec(b, byte_ptr(b, p, 16), I8, 32) if five else None
    qs = 48 if five else 16
    zero = ir.Constant(vec(I32, 8), [0] * 8)
    sums, mins = [zero for _ in xs], [zero for _ in xs]
    for pair in range(4):
        lo, hi = _nibbles(b, byte_ptr(b, p, qs + 32 * pair), 32)
        for half, u in ((0, lo), (1, hi)):
            j = 2 * pair + half
            if qh is not None:
                top = b.and_(b.lshr(qh, const_vec(I8, 32, j)), const_vec(I8, 32, 1))
                u = b.or_(u, b.shl(top, const_vec(I8, 32, 4)))
            sc, mn = _k4_scale_min(b, s, j)
            sc16 = splat(b, b.trunc(sc, I16), 16)
            mn8 = splat(b, b.trunc(mn, I8), 32)
            for i, x in enumerate(xs):
                v = x.values(32 * j)
                sums[i] = acc_pairs(b, sums[i], pairs_u8s8(b, u, v), sc16)
                mins[i] = acc_u8s8(b, mins[i], mn8, v)
    for x, acc, isum, imin in zip(xs, accs, sums, mins, strict=True):
        xd = x.scale(0)
        acc.add_int(isum, b.fmul(d, xd))
        acc.add_int(imin, b.fneg(b.fmul(dmin, xd)))


def int_q4_k(
    b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], scale: ir.Value
) -> None:
    _int_k(b, p, xs, accs, five=False)


def int_q5_k(
    b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], scale: ir.Value
) -> None:
    _int_k(b, p, xs, accs, five=True)


def int_q6_k(
    b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], scale: ir.Value
) -> None:
    """Q6_K super-block against per-256 activations: the signed values (q - 32, so no offset
    term) times the activations, pairs times their 16-value block's int8 scale, summed over
    the super-block in int32 lanes, then converted and scaled once per row pair."""
    d = load_half(b, byte_ptr(b, p, 208))
    sc = byte_ptr(b, p, 192)
    three, fifteen = const_vec(I8, 32, 3), const_vec(I8, 32, 15)
    sums = [ir.Constant(vec(I32, 8), [0] * 8) for _ in xs]
    for h in range(2):
        ql0 = load_vec(b, byte_ptr(b, p, 64 * h), I8, 32)
        ql1 = load_vec(b, byte_ptr(b, p, 64 * h + 32), I8, 32)
        qh = load_vec(b, byte_ptr(b, p, 128 + 32 * h), I8, 32)
        for c in range(4):
            low = ql0 if c % 2 == 0 else ql1
            low = b.and_(low, fifteen) if c < 2 else b.lshr(low, const_vec(I8, 32, 4))
            high = b.and_(b.lshr(qh, const_vec(I8, 32, 2 * c)), three)
            u = b.or_(low, b.shl(high, const_vec(I8, 32, 4)))  # q + 32, 0..63
            q = b.sub(u, const_vec(I8, 32, 32))  # -32..31
            first = 128 * h + 32 * c
            sa, sb = (b.load(b.gep(sc, [ir.Constant(I64, 8 * h + 2 * c + i)])) for i in range(2))
            s16 = b.shuffle_vector(
                splat(b, b.sext(sa, I16), 8),
                splat(b, b.sext(sb, I16), 8),
                ir.Constant(vec(I32, 16), list(range(16))),
            )
            for i, x in enumerate(xs):
                sums[i] = acc_pairs(b, sums[i], pairs_s8s8(b, q, x.values(first)), s16)
    for x, acc, isum in zip(xs, accs, sums, strict=True):
        acc.add_int(isum, b.fmul(d, x.scale(0)))


IntEmitter = Callable[[ir.IRBuilder, ir.Value, Sequence[Acts], Sequence[Acc], ir.Value], None]

# by format code (engine.kernels._ir.CODES)
INT_FORMATS: tuple[IntEmitter, ...] = (
    int_q8_0,
    int_q4_0,
    int_q4_1,
    int_q4_k,
    int_q6_k,
    int_int8,
    int_q5_0,
    int_q5_1,
    int_q5_k,
)
