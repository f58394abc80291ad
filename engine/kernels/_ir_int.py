"""Integer dot products of quantized weight blocks with int8 activations (LLVM IR emitters).

The activations of a row are quantized per block of 32 (int8 values, a float32 scale, and the
integer sum of the block, for the formats' offsets and minimums), or per block of 256 for the
K-quants (:mod:`engine.kernels._ir_kquant`: integer sums of every 16), the way llama.cpp
multiplies its blocks.
32 byte products are then one instruction where the host has AVX512-VNNI or AVX-VNNI
(``vpdpbusd``) and two on AVX2 (``vpmaddubsw``: unsigned weight bytes times signed activation
bytes, pairs summed to 16 bits; ``vpmaddwd``: pairs summed to 32 bits), about a quarter of the
work of widening every weight to float. Where the host has no AVX2 the same sums are written
in portable IR (exact integers every way, so all give the same bits).

The per-32 formats go four blocks at a time with weights and activations interleaved in 4-byte
groups (:func:`interleave`), so one accumulator's lanes hold the four blocks' dots: their
scales are applied lane by lane, with no horizontal adds and one conversion to float per four
blocks (eight at a time with 512-bit vectors, :func:`grouped_wide`). This module holds the
building blocks shared with the K-quant emitters and the per-32 formats' emitters.

Each emitter decodes a weight block once and adds its contribution to several activation rows'
accumulators (one ``Acc`` per row): ``acc_v`` (8 floats, integer partial sums times the product
of the weight and activation scales) and ``acc_s`` (a float, offset/minimum terms of the blocks
outside whole groups). Integer sums are exact and every float operation has a fixed order, so
the result of a row depends only on that row (batch invariance).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    _nibbles,
    byte_ptr,
    const_vec,
    fma,
    load_half,
    load_vec,
    reduce_lanes,
    splat,
    vec,
)

I16 = ir.IntType(16)

IntEmitter = Callable[[ir.IRBuilder, ir.Value, Sequence["Acts"], Sequence["Acc"], ir.Value], None]
GroupEmitter = Callable[
    [ir.IRBuilder, Sequence[ir.Value], Sequence["Acts"], Sequence["Acc"], ir.Value], None
]


@cache
def _avx2() -> bool:
    return "avx2" in cpu.features()


@cache
def _vnni() -> bool:
    """256-bit integer dot products (AVX512-VNNI with VL, or AVX-VNNI)."""
    f = cpu.features()
    return ("avx512vnni" in f and "avx512vl" in f) or "avxvnni" in f


@cache
def _wide() -> bool:
    """512-bit integer dot products at full width (:func:`engine.kernels.cpu.wide_int8`): the
    per-32 formats then go eight blocks at a time (:data:`GROUP`) and the K-quants 64 values
    per instruction."""
    return cpu.wide_int8()


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


def acc_pairs(b: ir.IRBuilder, acc: ir.Value, p16: ir.Value, w16: ir.Value) -> ir.Value:
    """acc <8 x i32> + (lane j: p16[2j] * w16[2j] + p16[2j + 1] * w16[2j + 1]): one
    ``vpdpwssd`` with VNNI, ``vpmaddwd`` + add on AVX2."""
    if _vnni():
        args = [acc, b.bitcast(p16, vec(I32, 8)), b.bitcast(w16, vec(I32, 8))]
        return _x86(b, "llvm.x86.avx512.vpdpwssd.256", vec(I32, 8), args)
    if _avx2():
        return b.add(acc, _x86(b, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [p16, w16]))
    return b.add(acc, _pairs(b, b.mul(b.sext(p16, vec(I32, 16)), b.sext(w16, vec(I32, 16)))))


class Acts:
    """Pointers to one activation row's quantized form at a block: int8 values ``q``, the
    scales ``d`` (per 32, or per 256 for the K-quants, :data:`engine.kernels._ir_kquant.K_CODES`)
    and the integer sums ``s`` (int32 of every 32 values, or int16 of every 16 for the
    K-quants), all at element offsets."""

    def __init__(self, b: ir.IRBuilder, q: ir.Value, d: ir.Value, s: ir.Value) -> None:
        self.b, self.q, self.d, self.s = b, q, d, s

    def values(self, first: int) -> ir.Value:
        """<32 x i8> activations ``first .. first + 32``."""
        return load_vec(self.b, byte_ptr(self.b, self.q, first), I8, 32)

    def values64(self, first: int) -> ir.Value:
        """<64 x i8> activations ``first .. first + 64``."""
        return load_vec(self.b, byte_ptr(self.b, self.q, first), I8, 64)

    def scale(self, first: int) -> ir.Value:
        """Scale of the 32-block holding element ``first``."""
        return self.b.load(self.b.gep(self.d, [ir.Constant(I64, first // 32)]))

    def isum32(self, first: int) -> ir.Value:
        """Integer sum of elements ``first .. first + 32`` (the per-32 formats)."""
        return self.b.load(self.b.gep(self.s, [ir.Constant(I64, first // 32)]))

    def isums(self) -> ir.Value:
        """<16 x i16>: the integer sums of a super-block's sixteen 16-value groups
        (the K-quants only; ``s`` points at the super-block's first)."""
        return load_vec(self.b, self.s, I16, 16)


class Acc:
    """A row's accumulators (allocas: SROA keeps them in registers)."""

    def __init__(self, b: ir.IRBuilder) -> None:
        self.b = b
        self.v = cgutils.alloca_once(b, vec(F32, 8))
        self.w = cgutils.alloca_once(b, vec(F32, 16))  # the K-quants' 512-bit path only
        self.s = cgutils.alloca_once(b, F32)
        b.store(ir.Constant(vec(F32, 8), [0.0] * 8), self.v)
        b.store(ir.Constant(vec(F32, 16), [0.0] * 16), self.w)
        b.store(ir.Constant(F32, 0.0), self.s)

    def total(self) -> ir.Value:
        """The row's result: its lanes summed by fixed trees, then the scalar part."""
        b = self.b
        lanes = reduce_lanes(b, b.load(self.v))
        if _wide():
            lanes = b.fadd(lanes, reduce_lanes(b, b.load(self.w)))
        return b.fadd(lanes, b.load(self.s))

    def add_int(self, isum: ir.Value, scale: ir.Value) -> None:
        b = self.b
        b.store(fma(b, b.sitofp(isum, vec(F32, 8)), splat(b, scale, 8), b.load(self.v)), self.v)

    def add(self, value: ir.Value) -> None:
        self.b.store(self.b.fadd(self.b.load(self.s), value), self.s)


def _u32(b: ir.IRBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """Two <16 x i8> halves -> <32 x i8> (values 0-15, then 16-31)."""
    return b.shuffle_vector(lo, hi, ir.Constant(vec(I32, 32), list(range(32))))


def acc_u8s8(b: ir.IRBuilder, acc: ir.Value, u: ir.Value, s: ir.Value) -> ir.Value:
    """acc <8 x i32> + :func:`dot_u8s8` (one ``vpdpbusd`` with VNNI)."""
    if _vnni():
        args = [acc, b.bitcast(u, vec(I32, 8)), b.bitcast(s, vec(I32, 8))]
        return _x86(b, "llvm.x86.avx512.vpdpbusd.256", vec(I32, 8), args)
    return b.add(acc, dot_u8s8(b, u, s))


class Block32:
    """A block of 32 weights decoded once for every activation row: its 32 weight bytes ``w``
    (unsigned, or signed when ``signed``) and scale ``d``. The block's value against
    activations v is ``d * (w . v + ioff * S) + mn * S'`` where S is the activations' integer
    sum and S' their dequantized sum: ``ioff`` is the format's integer offset (Q4_0: -8; 0 if
    none), ``mn`` its float minimum (Q4_1, Q5_1) or None."""

    def __init__(
        self,
        w: ir.Value,
        d: ir.Value,
        ioff: int = 0,
        mn: ir.Value | None = None,
        signed: bool = False,
    ) -> None:
        self.w, self.d, self.ioff, self.mn, self.signed = w, d, ioff, mn, signed

    def acc(self, b: ir.IRBuilder, acc: ir.Value, w: ir.Value, v: ir.Value) -> ir.Value:
        """acc + the integer dot of weight bytes ``w`` (this block's kind) with ``v``."""
        return b.add(acc, dot_s8s8(b, w, v)) if self.signed else acc_u8s8(b, acc, w, v)


def _signed(b: ir.IRBuilder, w: ir.Value, d: ir.Value) -> Block32:
    """Signed weight bytes. With VNNI, whose ``vpdpbusd`` does not saturate, as unsigned
    w + 128 with an offset of -128 (one instruction per row; the offset is one per four
    blocks); elsewhere |w| times the activations carrying w's sign (``vpmaddubsw`` would
    saturate on w + 128)."""
    if _vnni():
        return Block32(b.xor(w, const_vec(I8, 32, -128)), d, -128)  # w + 128, unsigned
    return Block32(w, d, signed=True)


def dec_q8_0(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> Block32:
    return _signed(b, load_vec(b, byte_ptr(b, p, 2), I8, 32), load_half(b, p))


def dec_int8(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> Block32:
    return _signed(b, load_vec(b, p, I8, 32), scale)


def dec_q4_0(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> Block32:
    return Block32(_u32(b, *_nibbles(b, byte_ptr(b, p, 2), 16)), load_half(b, p), -8)


def dec_q4_1(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> Block32:
    u = _u32(b, *_nibbles(b, byte_ptr(b, p, 4), 16))
    return Block32(u, load_half(b, p), 0, load_half(b, byte_ptr(b, p, 2)))


def _q5_u(b: ir.IRBuilder, qs: ir.Value, qh_ptr: ir.Value) -> ir.Value:
    qh = b.load(b.bitcast(qh_ptr, ir.PointerType(I32)), align=1)
    lo, hi = _nibbles(b, qs, 16)
    return _u32(b, b.or_(lo, _high_bits(b, qh, 0, 16)), b.or_(hi, _high_bits(b, qh, 16, 16)))


def dec_q5_0(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> Block32:
    return Block32(_q5_u(b, byte_ptr(b, p, 6), byte_ptr(b, p, 2)), load_half(b, p), -16)


def dec_q5_1(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> Block32:
    u = _q5_u(b, byte_ptr(b, p, 8), byte_ptr(b, p, 4))
    return Block32(u, load_half(b, p), 0, load_half(b, byte_ptr(b, p, 2)))


Decoder = Callable[[ir.IRBuilder, ir.Value, ir.Value], Block32]
ZERO8 = ir.Constant(vec(I32, 8), [0] * 8)


def single(dec: Decoder) -> IntEmitter:
    """One block of 32 against every activation row (the blocks past the last whole group)."""

    def emit(
        b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], scale: ir.Value
    ) -> None:
        blk = dec(b, p, scale)
        for x, acc in zip(xs, accs, strict=True):
            init = ZERO8
            if blk.ioff:  # into lane 0: the lanes are summed at the end
                off = b.mul(x.isum32(0), ir.Constant(I32, blk.ioff))
                init = b.insert_element(ZERO8, off, ir.Constant(I32, 0))
            acc.add_int(blk.acc(b, init, blk.w, x.values(0)), b.fmul(blk.d, x.scale(0)))
            if blk.mn is not None:
                sx = b.fmul(x.scale(0), b.sitofp(x.isum32(0), F32))
                acc.add(b.fmul(blk.mn, sx))

    return emit


def _cat(b: ir.IRBuilder, lo: ir.Value, hi: ir.Value) -> ir.Value:
    """Two vectors of n lanes -> one of 2n (lo's lanes first)."""
    n = lo.type.count
    return b.shuffle_vector(lo, hi, ir.Constant(vec(I32, 2 * n), list(range(2 * n))))


def _fold(b: ir.IRBuilder, v16: ir.Value) -> ir.Value:
    """<16 x i32> -> <8 x i32>: lanes i and i + 8 added (exact integers)."""
    low = ir.Constant(vec(I32, 8), list(range(8)))
    high = ir.Constant(vec(I32, 8), list(range(8, 16)))
    return b.add(b.shuffle_vector(v16, v16, low), b.shuffle_vector(v16, v16, high))


GROUP = 8 if _wide() else 4
"""Blocks of 32 per step of the grouped emitters: 8 with 512-bit VNNI (:func:`grouped_wide`),
else 4 (:func:`grouped`). ``quantize_acts`` stores the activations in the matching order."""


def interleave(b: ir.IRBuilder, ws: Sequence[ir.Value]) -> list[ir.Value]:
    """Four blocks' 32 bytes -> four <32 x i8> chunks: chunk c holds 4-byte groups 2c and
    2c + 1 of each block, as lanes [b0, b1, b2, b3, b0, b1, b2, b3] (the activations are
    stored in this order by ``quantize_acts``). A ``vpdpbusd`` of chunks then sums block j
    into lanes j and j + 4, so four blocks need one accumulator and no horizontal adds."""
    w32 = [b.bitcast(w, vec(I32, 8)) for w in ws]
    out = []
    for c in range(4):
        lo, hi = 2 * c, 2 * c + 1
        ab = b.shuffle_vector(w32[0], w32[1], ir.Constant(vec(I32, 4), [lo, 8 + lo, hi, 8 + hi]))
        cd = b.shuffle_vector(w32[2], w32[3], ir.Constant(vec(I32, 4), [lo, 8 + lo, hi, 8 + hi]))
        chunk = b.shuffle_vector(ab, cd, ir.Constant(vec(I32, 8), [0, 1, 4, 5, 2, 3, 6, 7]))
        out.append(b.bitcast(chunk, vec(I8, 32)))
    return out


def interleave8(b: ir.IRBuilder, ws: Sequence[ir.Value]) -> list[ir.Value]:
    """Eight blocks' 32 bytes -> four <16 x i32> chunks: chunk c holds 4-byte groups 2c of
    blocks 0-7 in lanes 0-7, then groups 2c + 1 in lanes 8-15 (``quantize_acts`` stores the
    activations of a group of 8 blocks in this order). A 512-bit ``vpdpbusd`` of chunks sums
    block j into lanes j and j + 8."""
    w32 = [b.bitcast(w, vec(I32, 8)) for w in ws]
    cat = ir.Constant(vec(I32, 16), list(range(16)))
    pairs = [b.shuffle_vector(w32[2 * i], w32[2 * i + 1], cat) for i in range(4)]  # [16]
    out = []
    for c in range(4):
        lo, hi = 2 * c, 2 * c + 1
        pick = ir.Constant(
            vec(I32, 8), [lo, 8 + lo, 16 + lo, 24 + lo, hi, 8 + hi, 16 + hi, 24 + hi]
        )
        first = b.shuffle_vector(pairs[0], pairs[1], pick)  # blocks 0-3: [lo x 4, hi x 4]
        second = b.shuffle_vector(pairs[2], pairs[3], pick)  # blocks 4-7
        order = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
        out.append(b.shuffle_vector(first, second, ir.Constant(vec(I32, 16), order)))
    return out


def _twice(b: ir.IRBuilder, v4: ir.Value) -> ir.Value:
    """<4 x T> -> <8 x T> [v0, v1, v2, v3, v0, v1, v2, v3]."""
    return b.shuffle_vector(v4, v4, ir.Constant(vec(I32, 8), [0, 1, 2, 3] * 2))


def _lanes(b: ir.IRBuilder, values: Sequence[ir.Value], n: int) -> ir.Value:
    """<n x float>: ``values`` in the first lanes, zeros after."""
    v = ir.Constant(vec(F32, n), [0.0] * n)
    for j, x in enumerate(values):
        v = b.insert_element(v, x, ir.Constant(I32, j))
    return v


def _scale_into(
    b: ir.IRBuilder,
    acc: Acc,
    h: ir.Value,
    ws8: ir.Value,
    xd8: ir.Value,
    mins8: ir.Value | None,
    sums8: ir.Value | None,
) -> None:
    """acc.v += blocks' integer sums ``h`` <8 x i32> x (weight x activation scales), then
    (formats with minimums) + minimums x the activations' dequantized sums, lane by lane."""
    v = fma(b, b.sitofp(h, vec(F32, 8)), b.fmul(ws8, xd8), b.load(acc.v))
    if mins8 is not None:
        assert sums8 is not None
        v = fma(b, b.fmul(mins8, xd8), b.sitofp(sums8, vec(F32, 8)), v)
    b.store(v, acc.v)


def grouped(dec: Decoder) -> GroupEmitter:
    """:data:`GROUP` blocks of 32 against every activation row, their scales applied together:
    with the weights and activations interleaved (:func:`interleave`), four ``vpdpbusd`` leave
    block j's integer sum in lanes j and j + 4 of one vector, which starts from the blocks'
    integer offsets, is converted once and multiplied by the four (weight x activation)
    scales in one ``fma`` — one block at a time costs a zeroing, a conversion, a scalar
    product, a broadcast and an ``fma`` per block and row. Minimums go four at a time too."""
    if GROUP == 8:
        return grouped_wide(dec)

    def emit(
        b: ir.IRBuilder,
        ps: Sequence[ir.Value],
        xs: Sequence[Acts],
        accs: Sequence[Acc],
        scale: ir.Value,
    ) -> None:
        blks = [dec(b, p, scale) for p in ps]
        chunks = interleave(b, [blk.w for blk in blks])
        ws8 = _twice(b, _lanes(b, [blk.d for blk in blks], 4))
        mins8 = _lanes(b, [blk.mn for blk in blks], 8) if blks[0].mn is not None else None
        ioff = blks[0].ioff
        zero4 = ir.Constant(vec(I32, 4), [0] * 4)
        for x, acc in zip(xs, accs, strict=True):
            sums8 = None
            if ioff or mins8 is not None:  # the four blocks' integer sums, then four zeros
                s4 = load_vec(b, x.s, I32, 4)
                sums8 = b.shuffle_vector(s4, zero4, ir.Constant(vec(I32, 8), list(range(8))))
            h = ZERO8 if not ioff else b.mul(sums8, const_vec(I32, 8, ioff))
            for c, chunk in enumerate(chunks):
                h = blks[0].acc(b, h, chunk, x.values(32 * c))
            xd8 = _twice(b, load_vec(b, x.d, F32, 4))
            _scale_into(b, acc, h, ws8, xd8, mins8, sums8)

    return emit


def grouped_wide(dec: Decoder) -> GroupEmitter:
    """Eight blocks of 32 against every activation row with 512-bit ``vpdpbusd``: with the
    weights and activations interleaved (:func:`interleave8`), four instructions leave block
    j's integer sum in lanes j and j + 8; one integer add of the two halves gives the eight
    blocks' sums in 8 lanes, which take their offsets, are converted once and multiplied by
    the eight (weight x activation) scales in one ``fma`` (half the per-row conversions,
    scale products and ``fma`` of :func:`grouped`, per block)."""

    def emit(
        b: ir.IRBuilder,
        ps: Sequence[ir.Value],
        xs: Sequence[Acts],
        accs: Sequence[Acc],
        scale: ir.Value,
    ) -> None:
        blks = [dec(b, p, scale) for p in ps]
        assert not any(blk.signed for blk in blks)  # with VNNI every block is unsigned
        chunks = interleave8(b, [blk.w for blk in blks])
        ws8 = _lanes(b, [blk.d for blk in blks], 8)
        mins8 = _lanes(b, [blk.mn for blk in blks], 8) if blks[0].mn is not None else None
        ioff = blks[0].ioff
        zero16 = ir.Constant(vec(I32, 16), [0] * 16)
        for x, acc in zip(xs, accs, strict=True):
            h16 = zero16
            for c, chunk in enumerate(chunks):
                xv = b.bitcast(x.values64(64 * c), vec(I32, 16))
                h16 = _x86(b, "llvm.x86.avx512.vpdpbusd.512", vec(I32, 16), [h16, chunk, xv])
            h = _fold(b, h16)
            sums8 = None
            if ioff or mins8 is not None:  # the eight blocks' integer sums
                sums8 = load_vec(b, x.s, I32, 8)
                if ioff:
                    h = b.add(h, b.mul(sums8, const_vec(I32, 8, ioff)))
            _scale_into(b, acc, h, ws8, load_vec(b, x.d, F32, 8), mins8, sums8)

    return emit


# by format code (engine.kernels._ir.CODES): the per-32 formats' decoders, which also have a
# grouped emitter (the K-quants' emitters are in engine.kernels._ir_kquant)
DECODERS: dict[int, Decoder] = {
    0: dec_q8_0,
    1: dec_q4_0,
    2: dec_q4_1,
    5: dec_int8,
    6: dec_q5_0,
    7: dec_q5_1,
}
GROUPED: dict[int, GroupEmitter] = {code: grouped(dec) for code, dec in DECODERS.items()}
