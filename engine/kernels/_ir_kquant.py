"""Integer dot products of K-quant super-blocks (Q4_K, Q5_K, Q6_K) with int8 activations
quantized per 256 values (LLVM IR emitters; building blocks in :mod:`engine.kernels._ir_int`).

Each super-block's sub-block products are multiplied by their integer scales and summed in
int32 lanes (``vpmaddubsw`` then ``vpdpwssd``; two sub-blocks per 512-bit instruction where
:func:`engine.kernels._ir_int._wide`), and the minimums or offsets meet the activations'
16-value sums in one ``vpmaddwd``, so a row pair is converted to float and scaled once per
super-block. (An 8-way interleave of the sub-blocks with one ``vpdpbusd`` each measured slower
on a Zen 4 than this scale-in-the-pair-sums form.) Integer sums are the same on every path.
"""

from __future__ import annotations

from collections.abc import Sequence

from llvmlite import ir

from engine.kernels._ir import (
    F32,
    I8,
    I32,
    _nibbles,
    byte_ptr,
    const_vec,
    fma,
    load_half,
    load_vec,
    splat,
    vec,
)
from engine.kernels._ir_int import (
    I16,
    Acc,
    Acts,
    _avx2,
    _cat,
    _fold,
    _pairs,
    _wide,
    _x86,
    acc_pairs,
    pairs_u8s8,
)

K_CODES = frozenset((3, 4, 8))  # q4_k, q6_k, q5_k: activations in blocks of 256 (Q8_K)
"""Formats whose activations are quantized per block of 256 (one scale per super-block, and
integer sums of every 16 values), as llama.cpp's Q8_K does for the K-quants: a super-block's
sub-block products are then scaled and added in integers and converted to float once, instead
of once per 32 values, and its minimums or offsets meet the activations' sums in one product.
For these formats ``Acts.d`` points at the per-256 scales and ``Acts.s`` at int16 sums."""


def pairs_i16(b: ir.IRBuilder, a: ir.Value, c: ir.Value) -> ir.Value:
    """<16 x i16> a, c -> <8 x i32>: lane j = a[2j] * c[2j] + a[2j + 1] * c[2j + 1]
    (``vpmaddwd``)."""
    if _avx2():
        return _x86(b, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [a, c])
    return _pairs(b, b.mul(b.sext(a, vec(I32, 16)), b.sext(c, vec(I32, 16))))


def _pairs_acc_wide(
    b: ir.IRBuilder, acc: ir.Value, u: ir.Value, x: ir.Value, w: ir.Value
) -> ir.Value:
    """The 512-bit :func:`pairs_u8s8` then :func:`acc_pairs`: acc <16 x i32> + pair sums of
    (u <64 x i8> unsigned x x <64 x i8> signed, 16-bit pair sums) times w <32 x i16>."""
    p = _x86(b, "llvm.x86.avx512.pmaddubs.w.512", vec(I16, 32), [u, x])
    args = [acc, b.bitcast(p, vec(I32, 16)), b.bitcast(w, vec(I32, 16))]
    return _x86(b, "llvm.x86.avx512.vpdpwssd.512", vec(I32, 16), args)


def _int_k(
    b: ir.IRBuilder, p: ir.Value, xs: Sequence[Acts], accs: Sequence[Acc], five: bool
) -> None:
    """Q4_K/Q5_K super-block against per-256 activations, in integers per row pair: the
    values' products times their sub-block's 6-bit scale (``vpmaddubsw`` then ``vpdpwssd``;
    with :func:`_wide` two sub-blocks per 512-bit instruction), summed over the super-block
    in int32 lanes (exact: at most ~8 M); the minimums times the activations' 16-value sums
    (one ``vpmaddwd`` per row); then converted and scaled once. The integer sums are the same
    on every path, so every path gives the same bits."""
    d = load_half(b, p)
    dmin = load_half(b, byte_ptr(b, p, 2))
    scales, mins = _k4_scales_mins(b, byte_ptr(b, p, 4))
    qh = load_vec(b, byte_ptr(b, p, 16), I8, 32) if five else None
    qs = 48 if five else 16
    wide = _wide()
    zero = ir.Constant(vec(I32, 16 if wide else 8), [0] * (16 if wide else 8))
    sums = [zero for _ in xs]
    for pair in range(4):
        lo, hi = _nibbles(b, byte_ptr(b, p, qs + 32 * pair), 32)
        us = []
        for half, u in ((0, lo), (1, hi)):
            j = 2 * pair + half
            if qh is not None:
                top = b.and_(b.lshr(qh, const_vec(I8, 32, j)), const_vec(I8, 32, 1))
                u = b.or_(u, b.shl(top, const_vec(I8, 32, 4)))
            if wide:
                us.append(u)
                continue
            sc16 = b.shuffle_vector(scales, scales, ir.Constant(vec(I32, 16), [j] * 16))
            for i, x in enumerate(xs):
                sums[i] = acc_pairs(b, sums[i], pairs_u8s8(b, u, x.values(32 * j)), sc16)
        if wide:  # sub-blocks 2 * pair and 2 * pair + 1 in one 512-bit step per row
            u64 = _cat(b, us[0], us[1])
            pick = [2 * pair] * 16 + [2 * pair + 1] * 16
            sc32 = b.shuffle_vector(scales, scales, ir.Constant(vec(I32, 32), pick))
            for i, x in enumerate(xs):
                sums[i] = _pairs_acc_wide(b, sums[i], u64, x.values64(64 * pair), sc32)
    if wide:  # lanes 0-7: the values' sums, times d; lanes 8-15: the minimums', times -dmin
        dd = _cat(b, splat(b, d, 8), splat(b, b.fneg(dmin), 8))
    for x, acc, isum in zip(xs, accs, sums, strict=True):
        xd = x.scale(0)
        imin = pairs_i16(b, x.isums(), mins)
        if wide:  # one conversion and one fma per row for both
            both = b.sitofp(_cat(b, _fold(b, isum), imin), vec(F32, 16))
            step = fma(b, both, b.fmul(dd, splat(b, xd, 16)), b.load(acc.w))
            b.store(step, acc.w)
            continue
        acc.add_int(isum, b.fmul(d, xd))
        acc.add_int(imin, b.fneg(b.fmul(dmin, xd)))


def _k4_scales_mins(b: ir.IRBuilder, s: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Q4_K/Q5_K's 12 packed bytes at ``s`` -> (<16 x i16> with the 8 sub-block scales in
    lanes 0-7, <16 x i16> [m0, m0, m1, m1, ..., m7, m7]): the 6-bit fields unpacked four at a
    time in 32-bit words (the values of :func:`engine.kernels._ir._k4_scale_min`)."""
    word = ir.PointerType(I32)
    u = [b.load(b.bitcast(byte_ptr(b, s, 4 * i), word), align=1) for i in range(3)]

    def c(v: int) -> ir.Constant:
        return ir.Constant(I32, v)

    low6, low4, top2 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
    sc_lo = b.and_(u[0], low6)  # scales 0-3
    mn_lo = b.and_(u[1], low6)  # mins 0-3
    sc_hi = b.or_(b.and_(u[2], low4), b.shl(b.and_(b.lshr(u[0], c(6)), top2), c(4)))
    mn_hi = b.or_(b.and_(b.lshr(u[2], c(4)), low4), b.shl(b.and_(b.lshr(u[1], c(6)), top2), c(4)))
    words = ir.Constant(vec(I32, 4), ir.Undefined)
    for i, w in enumerate((sc_lo, sc_hi, mn_lo, mn_hi)):
        words = b.insert_element(words, w, ir.Constant(I32, i))
    both = b.zext(b.bitcast(words, vec(I8, 16)), vec(I16, 16))  # scales 0-7, mins 0-7
    pairs = [8 + i // 2 for i in range(16)]
    return both, b.shuffle_vector(both, both, ir.Constant(vec(I32, 16), pairs))


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
    """Q6_K super-block against per-256 activations: the unsigned values (q + 32, 0..63)
    times the activations, pairs times their 16-value block's int8 scale, summed over the
    super-block in int32 lanes; minus 32 x (scales times the activations' 16-value sums, one
    ``vpmaddwd``); then converted and scaled once per row pair."""
    d = load_half(b, byte_ptr(b, p, 208))
    sc = byte_ptr(b, p, 192)
    three, fifteen = const_vec(I8, 32, 3), const_vec(I8, 32, 15)
    wide = _wide()
    sums = [ir.Constant(vec(I32, 16 if wide else 8), [0] * (16 if wide else 8)) for _ in xs]
    scales = b.sext(load_vec(b, sc, I8, 16), vec(I16, 16))  # the 16 block scales
    for h in range(2):
        ql0 = load_vec(b, byte_ptr(b, p, 64 * h), I8, 32)
        ql1 = load_vec(b, byte_ptr(b, p, 64 * h + 32), I8, 32)
        qh = load_vec(b, byte_ptr(b, p, 128 + 32 * h), I8, 32)
        us, s16s = [], []
        for c in range(4):
            low = ql0 if c % 2 == 0 else ql1
            low = b.and_(low, fifteen) if c < 2 else b.lshr(low, const_vec(I8, 32, 4))
            high = b.and_(b.lshr(qh, const_vec(I8, 32, 2 * c)), three)
            u = b.or_(low, b.shl(high, const_vec(I8, 32, 4)))  # q + 32, 0..63
            first = 128 * h + 32 * c
            k = 8 * h + 2 * c  # the first of this 32's two 16-value blocks
            s16 = b.shuffle_vector(scales, scales, ir.Constant(vec(I32, 16), [k] * 8 + [k + 1] * 8))
            if wide:  # two 32s per 512-bit step per row
                us.append(u)
                s16s.append(s16)
                if c % 2:
                    u64, s32 = _cat(b, us[0], us[1]), _cat(b, s16s[0], s16s[1])
                    us, s16s = [], []
                    for i, x in enumerate(xs):
                        sums[i] = _pairs_acc_wide(b, sums[i], u64, x.values64(first - 32), s32)
                continue
            for i, x in enumerate(xs):
                sums[i] = acc_pairs(b, sums[i], pairs_u8s8(b, u, x.values(first)), s16)
    for x, acc, isum in zip(xs, accs, sums, strict=True):
        offset = b.shl(pairs_i16(b, x.isums(), scales), const_vec(I32, 8, 5))  # 32 x ...
        total = _fold(b, isum) if wide else isum
        acc.add_int(b.sub(total, offset), b.fmul(d, x.scale(0)))
