"""Vector building blocks for the quantized kernels, written as LLVM IR (numba intrinsics).

numba's auto-vectorizer turned the block decoders into scalar code (it cannot prove that the
weight bytes and the float output do not overlap, and numba widens small integers to 64 bits),
about 2-4 cycles per weight on the machines we measured. Spelling the vectors out in LLVM IR —
portable IR, not x86 intrinsics: LLVM lowers it to AVX2, AVX-512 or NEON for the host — made
decoding ~10x faster, and makes the order of every floating-point operation explicit:

* decoders give exactly the values of ``gguf.quants.dequantize`` (float16 scales widened with
  ``fpext``, exact integer-times-scale products, the reference's own roundings);
* dot products use 16 explicit lanes per output (lane l sums the elements k ≡ l mod 16 in
  order with fused multiply-adds, then a fixed tree adds the lanes). No reassociation is left
  to the compiler, so one output's bits depend only on its weight row and its input row — the
  batch invariance the speculative decoder's exactness rests on.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from llvmlite import ir
from numba.core import cgutils

from engine.kernels import cpu

F32 = ir.FloatType()
I8 = ir.IntType(8)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
LANES = 16  # lanes per output in every dot product (two 8-float vectors)


def vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def const_vec(t: ir.Type, n: int, v: int | float) -> ir.Constant:
    return ir.Constant(vec(t, n), [v] * n)


def splat(b: ir.IRBuilder, v: ir.Value, n: int) -> ir.Value:
    t = vec(v.type, n)
    u = b.insert_element(ir.Constant(t, ir.Undefined), v, ir.Constant(I32, 0))
    return b.shuffle_vector(u, ir.Constant(t, ir.Undefined), ir.Constant(vec(I32, n), [0] * n))


def byte_ptr(b: ir.IRBuilder, base: ir.Value, offset: ir.Value | int) -> ir.Value:
    """i8* at ``base + offset`` bytes."""
    p = b.bitcast(base, ir.PointerType(I8))
    off = ir.Constant(I64, offset) if isinstance(offset, int) else offset
    return b.gep(p, [off])


def load_vec(b: ir.IRBuilder, ptr: ir.Value, t: ir.Type, n: int) -> ir.Value:
    return b.load(b.bitcast(ptr, ir.PointerType(vec(t, n))), align=1)


def store_vec(b: ir.IRBuilder, v: ir.Value, ptr: ir.Value) -> None:
    b.store(v, b.bitcast(ptr, ir.PointerType(v.type)), align=4)


def prefetch(b: ir.IRBuilder, ptr: ir.Value, nbytes: int = 1) -> None:
    """Hint that the ``nbytes`` at ``ptr`` are read soon (one prefetch per 64 bytes, into
    every cache level). It reads nothing, so any address is harmless."""
    fn = cgutils.get_or_insert_function(
        b.module,
        ir.FunctionType(ir.VoidType(), [ir.PointerType(I8), I32, I32, I32]),
        "llvm.prefetch.p0i8",
    )
    start = b.bitcast(ptr, ir.PointerType(I8))
    for off in range(0, nbytes, 64):
        at = b.gep(start, [ir.Constant(I64, off)])
        b.call(fn, [at, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def load_half(b: ir.IRBuilder, ptr: ir.Value) -> ir.Value:
    """float16 at ``ptr`` (any alignment) widened to float32, exactly."""
    h = b.load(b.bitcast(ptr, ir.PointerType(ir.HalfType())), align=1)
    return b.fpext(h, F32)


def load_byte(b: ir.IRBuilder, ptr: ir.Value, i: int) -> ir.Value:
    """Unsigned byte ``ptr[i]`` as i32."""
    return b.zext(b.load(b.gep(ptr, [ir.Constant(I64, i)])), I32)


def fma(b: ir.IRBuilder, x: ir.Value, y: ir.Value, z: ir.Value) -> ir.Value:
    n = x.type.count
    fn = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(vec(F32, n), [vec(F32, n)] * 3), f"llvm.fma.v{n}f32"
    )
    return b.call(fn, [x, y, z])


def halves(b: ir.IRBuilder, v: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Split a vector in two (low, high)."""
    n = v.type.count
    lo = b.shuffle_vector(v, v, ir.Constant(vec(I32, n // 2), list(range(n // 2))))
    hi = b.shuffle_vector(v, v, ir.Constant(vec(I32, n // 2), list(range(n // 2, n))))
    return lo, hi


def reduce_lanes(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Sum of a vector's lanes by a fixed halving tree."""
    while v.type.count > 1:
        lo, hi = halves(b, v)
        v = b.fadd(lo, hi)
    return b.extract_element(v, ir.Constant(I32, 0))


# --- block decoders: stored block at ``p`` (i8*) -> list of (element offset, float vector) ----


def _nibbles(b: ir.IRBuilder, p: ir.Value, n: int) -> tuple[ir.Value, ir.Value]:
    q = load_vec(b, p, I8, n)
    return b.and_(q, const_vec(I8, n, 15)), b.lshr(q, const_vec(I8, n, 4))


def block_q8_0(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> list[tuple[int, ir.Value]]:
    d = load_half(b, p)
    q = b.sitofp(load_vec(b, byte_ptr(b, p, 2), I8, 32), vec(F32, 32))
    return [(0, b.fmul(splat(b, d, 32), q))]


@cache
def _width() -> int:
    """Lanes per decoded vector of the Q4_K decoder: 16 where the CPU has AVX-512 (one
    512-bit widening per 16 values), else 8. The values and their order are the same either
    way. (Measured on a Zen 5, float activations: Q4_K rounds 15-21 % faster at 1 and 8
    rows; Q4_0/Q4_1 no faster at 8 rows and 4 % slower fully local at 1 row, so they keep 8.)"""
    return 16 if "avx512f" in cpu.features() else 8


def block_q4_0(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> list[tuple[int, ir.Value]]:
    n = 8
    d = splat(b, load_half(b, p), n)
    eight = const_vec(I32, n, 8)
    out = []
    for first in range(0, 16, n):
        lo, hi = _nibbles_n(b, byte_ptr(b, p, 2), first, n)
        for off, q in ((first, lo), (first + 16, hi)):
            out.append((off, b.fmul(d, b.sitofp(b.sub(q, eight), vec(F32, n)))))
    return sorted(out, key=lambda t: t[0])


def _nibbles_n(b: ir.IRBuilder, p: ir.Value, first: int, n: int) -> tuple[ir.Value, ir.Value]:
    """Bytes ``first .. first + n`` at ``p`` widened to n i32 lanes, then split: their low
    nibbles (values ``first ..``) and high nibbles (values ``first + 16 ..`` of a 16-byte
    block; of the next sub-block for Q4_K's 32 bytes). Widening first costs one byte-to-lane
    shuffle per n values, where splitting bytes first costs three."""
    q = b.zext(load_vec(b, byte_ptr(b, p, first), I8, n), vec(I32, n))
    return b.and_(q, const_vec(I32, n, 15)), b.lshr(q, const_vec(I32, n, 4))


def block_q4_1(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> list[tuple[int, ir.Value]]:
    n = 8
    d = splat(b, load_half(b, p), n)
    m = splat(b, load_half(b, byte_ptr(b, p, 2)), n)
    out = []
    for first in range(0, 16, n):
        lo, hi = _nibbles_n(b, byte_ptr(b, p, 4), first, n)
        for off, q in ((first, lo), (first + 16, hi)):
            out.append((off, fma(b, d, b.sitofp(q, vec(F32, n)), m)))
    return sorted(out, key=lambda t: t[0])


def _k4_scale_min(b: ir.IRBuilder, s: ir.Value, j: int) -> tuple[ir.Value, ir.Value]:
    """6-bit scale and min of sub-block j from Q4_K's 12 packed bytes at ``s``."""
    if j < 4:
        sc = b.and_(load_byte(b, s, j), ir.Constant(I32, 63))
        mn = b.and_(load_byte(b, s, j + 4), ir.Constant(I32, 63))
    else:
        top_sc = b.shl(b.lshr(load_byte(b, s, j - 4), ir.Constant(I32, 6)), ir.Constant(I32, 4))
        top_mn = b.shl(b.lshr(load_byte(b, s, j), ir.Constant(I32, 6)), ir.Constant(I32, 4))
        sc = b.or_(b.and_(load_byte(b, s, j + 4), ir.Constant(I32, 15)), top_sc)
        mn = b.or_(b.lshr(load_byte(b, s, j + 4), ir.Constant(I32, 4)), top_mn)
    return sc, mn


def block_q4_k(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> list[tuple[int, ir.Value]]:
    d = load_half(b, p)
    dmin = load_half(b, byte_ptr(b, p, 2))
    s = byte_ptr(b, p, 4)
    n = _width()
    out = []
    for pair in range(4):
        scales = []
        for half in range(2):
            sc, mn = _k4_scale_min(b, s, 2 * pair + half)
            dsc = b.fmul(d, b.uitofp(sc, F32))  # exact: 11-bit mantissa x 6-bit integer
            neg_m = b.fneg(b.fmul(dmin, b.uitofp(mn, F32)))
            scales.append((splat(b, dsc, n), splat(b, neg_m, n)))
        for first in range(0, 32, n):  # low nibbles: sub-block 2 pair, high: 2 pair + 1
            qs = _nibbles_n(b, byte_ptr(b, p, 16 + 32 * pair), first, n)
            for half, q in enumerate(qs):
                dsc_v, neg_v = scales[half]
                v = fma(b, dsc_v, b.sitofp(q, vec(F32, n)), neg_v)
                out.append((64 * pair + 32 * half + first, v))
    return sorted(out, key=lambda t: t[0])


def block_q6_k(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> list[tuple[int, ir.Value]]:
    d = load_half(b, byte_ptr(b, p, 208))
    sc = byte_ptr(b, p, 192)
    out = []
    three, fifteen = const_vec(I8, 32, 3), const_vec(I8, 32, 15)
    for h in range(2):
        ql0 = load_vec(b, byte_ptr(b, p, 64 * h), I8, 32)
        ql1 = load_vec(b, byte_ptr(b, p, 64 * h + 32), I8, 32)
        qh = load_vec(b, byte_ptr(b, p, 128 + 32 * h), I8, 32)
        for c in range(4):
            low = ql0 if c % 2 == 0 else ql1
            low = b.and_(low, fifteen) if c < 2 else b.lshr(low, const_vec(I8, 32, 4))
            high = b.and_(b.lshr(qh, const_vec(I8, 32, 2 * c)), three)
            q = b.sub(b.or_(low, b.shl(high, const_vec(I8, 32, 4))), const_vec(I8, 32, 32))
            qf = b.sitofp(q, vec(F32, 32))
            # 16 values per scale: scales 8h + 2c and 8h + 2c + 1
            scales = []
            for i in range(2):
                raw = b.load(b.gep(sc, [ir.Constant(I64, 8 * h + 2 * c + i)]))
                scales.append(b.fmul(d, b.sitofp(raw, F32)))  # exact: 11 x 8 bits
            sv = b.shuffle_vector(
                splat(b, scales[0], 16),
                splat(b, scales[1], 16),
                ir.Constant(vec(I32, 32), list(range(32))),
            )
            out.append((128 * h + 32 * c, b.fmul(sv, qf)))
    return out


def _high_bits(b: ir.IRBuilder, qh: ir.Value, first: int, n: int) -> ir.Value:
    """Bits ``first .. first + n`` of the i32 ``qh``, each moved to bit 4 of an i8 lane."""
    shifts = ir.Constant(vec(I32, n), list(range(first, first + n)))
    bits = b.and_(b.lshr(splat(b, qh, n), shifts), const_vec(I32, n, 1))
    return b.shl(b.trunc(bits, vec(I8, n)), const_vec(I8, n, 4))


def _q5_values(b: ir.IRBuilder, qs: ir.Value, qh_ptr: ir.Value) -> tuple[ir.Value, ir.Value]:
    """5-bit values 0..31 of a Q5_0/Q5_1 block: nibbles at ``qs`` plus the 32 high bits."""
    qh = b.load(b.bitcast(qh_ptr, ir.PointerType(I32)), align=1)
    lo, hi = _nibbles(b, qs, 16)
    return b.or_(lo, _high_bits(b, qh, 0, 16)), b.or_(hi, _high_bits(b, qh, 16, 16))


def block_q5_0(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> list[tuple[int, ir.Value]]:
    d = splat(b, load_half(b, p), 16)
    lo, hi = _q5_values(b, byte_ptr(b, p, 6), byte_ptr(b, p, 2))
    sixteen = const_vec(I8, 16, 16)
    return [
        (off, b.fmul(d, b.sitofp(b.sub(q, sixteen), vec(F32, 16))))
        for off, q in ((0, lo), (16, hi))
    ]


def block_q5_1(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> list[tuple[int, ir.Value]]:
    d = splat(b, load_half(b, p), 16)
    m = splat(b, load_half(b, byte_ptr(b, p, 2)), 16)
    lo, hi = _q5_values(b, byte_ptr(b, p, 8), byte_ptr(b, p, 4))
    return [(off, fma(b, d, b.uitofp(q, vec(F32, 16)), m)) for off, q in ((0, lo), (16, hi))]


def block_q5_k(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> list[tuple[int, ir.Value]]:
    d = load_half(b, p)
    dmin = load_half(b, byte_ptr(b, p, 2))
    s = byte_ptr(b, p, 4)
    qh = load_vec(b, byte_ptr(b, p, 16), I8, 32)  # bit j of byte l: value l of sub-block j
    out = []
    for pair in range(4):
        lo, hi = _nibbles(b, byte_ptr(b, p, 48 + 32 * pair), 32)
        for half, q in ((0, lo), (1, hi)):
            j = 2 * pair + half
            top = b.and_(b.lshr(qh, const_vec(I8, 32, j)), const_vec(I8, 32, 1))
            q = b.or_(q, b.shl(top, const_vec(I8, 32, 4)))
            sc, mn = _k4_scale_min(b, s, j)
            dsc = b.fmul(d, b.uitofp(sc, F32))
            neg_m = b.fneg(b.fmul(dmin, b.uitofp(mn, F32)))
            v = fma(b, splat(b, dsc, 32), b.uitofp(q, vec(F32, 32)), splat(b, neg_m, 32))
            out.append((32 * j, v))
    return out


def block_int8(b: ir.IRBuilder, p: ir.Value, scale: ir.Value) -> list[tuple[int, ir.Value]]:
    q = b.sitofp(load_vec(b, p, I8, 32), vec(F32, 32))
    return [(0, b.fmul(splat(b, scale, 32), q))]


Emitter = Callable[[ir.IRBuilder, ir.Value, ir.Value], list[tuple[int, ir.Value]]]

# format code (the kernels' literal argument) -> (name, values per block, bytes per block,
# emitter). int8 goes 32 values at a time: a run of 32 int8 values sharing the row's scale.
FORMATS: tuple[tuple[str, int, int, Emitter], ...] = (
    ("q8_0", 32, 34, block_q8_0),
    ("q4_0", 32, 18, block_q4_0),
    ("q4_1", 32, 20, block_q4_1),
    ("q4_k", 256, 144, block_q4_k),
    ("q6_k", 256, 210, block_q6_k),
    ("int8", 32, 32, block_int8),
    ("q5_0", 32, 22, block_q5_0),
    ("q5_1", 32, 24, block_q5_1),
    ("q5_k", 256, 176, block_q5_k),
)
CODES = {f[0]: i for i, f in enumerate(FORMATS)}
