"""Block decoders for the quantized weight formats (numba, inlined into the kernels).

Each ``dec_<fmt>(row, b0, nb, out)`` expands blocks ``b0 .. b0 + nb`` of one stored weight row
(uint8 bytes, the format's own block layout) into float32 values ``out[0 : nb * block]``. The
values are exactly those of ``gguf.quants.dequantize`` (the reference every test compares with):
scales are converted from float16 by table (no rounding), products of a scale and a small
integer are exact in float32, and where the reference rounds (a final add, Q6_K's ``d*sc*q``)
the same operation rounds here.

Formats (values per block, bytes per block):

* ``q8_0`` (32, 34): f16 d, int8 q[32]; w = d*q
* ``q4_0`` (32, 18): f16 d, nibbles; w = d*(q - 8); low nibbles are values 0-15, high 16-31
* ``q4_1`` (32, 20): f16 d, f16 m, nibbles; w = d*q + m
* ``q4_k`` (256, 144): f16 d, f16 dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks of 32,
  nibbles; w = (d*sc)*q - dmin*mn
* ``q6_k`` (256, 210): 4 low bits (128 B), 2 high bits (64 B), int8 scales per 16 (16 B), f16 d;
  w = (d*sc)*(q - 32)
* ``int8`` (1, 1): int8 per value, one float32 scale per row (Veil's per-channel int8)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

# numba caches a frozen app's functions too (in the user cache, keyed by the executable)
CACHE = True

# 2**(e - 25) for a float16 exponent field e (e = 0: subnormal, scale 2**-24 without the
# implicit bit). value = (1024 * (e != 0) + mantissa) * POW2[e]: exact in float32.
POW2 = np.array([2.0**-24] + [2.0 ** (e - 25) for e in range(1, 31)] + [np.inf], dtype=np.float32)


@njit(inline="always", boundscheck=False, cache=CACHE)  # type: ignore[untyped-decorator]
def half(lo: Any, hi: Any, pow2: Any) -> Any:
    """float16 (two little-endian bytes) -> float32, exactly."""
    h = np.int32(lo) | (np.int32(hi) << 8)
    e = (h >> 10) & 31
    mant = np.float32((h & 1023) + (1024 if e != 0 else 0))
    v = mant * pow2[e]
    return -v if h & 0x8000 else v


@njit(inline="always", boundscheck=False, fastmath=True, cache=CACHE)  # type: ignore[untyped-decorator]
def dec_q8_0(row: Any, b0: int, nb: int, out: Any, pow2: Any, scale: float) -> None:
    for b in range(nb):
        o = (b0 + b) * 34
        d = half(row[o], row[o + 1], pow2)
        for j in range(32):
            out[b * 32 + j] = d * np.float32(np.int8(row[o + 2 + j]))


@njit(inline="always", boundscheck=False, fastmath=True, cache=CACHE)  # type: ignore[untyped-decorator]
def dec_q4_0(row: Any, b0: int, nb: int, out: Any, pow2: Any, scale: float) -> None:
    for b in range(nb):
        o = (b0 + b) * 18
        d = half(row[o], row[o + 1], pow2)
        for j in range(16):
            q = np.int32(row[o + 2 + j])
            out[b * 32 + j] = d * np.float32((q & 15) - 8)
            out[b * 32 + 16 + j] = d * np.float32((q >> 4) - 8)


@njit(inline="always", boundscheck=False, fastmath=True, cache=CACHE)  # type: ignore[untyped-decorator]
def dec_q4_1(row: Any, b0: int, nb: int, out: Any, pow2: Any, scale: float) -> None:
    for b in range(nb):
        o = (b0 + b) * 20
        d = half(row[o], row[o + 1], pow2)
        m = half(row[o + 2], row[o + 3], pow2)
        for j in range(16):
            q = np.int32(row[o + 4 + j])
            out[b * 32 + j] = d * np.float32(q & 15) + m
            out[b * 32 + 16 + j] = d * np.float32(q >> 4) + m


@njit(inline="always", boundscheck=False, fastmath=True, cache=CACHE)  # type: ignore[untyped-decorator]
def dec_q4_k(row: Any, b0: int, nb: int, out: Any, pow2: Any, scale: float) -> None:
    for b in range(nb):
        o = (b0 + b) * 144
        d = half(row[o], row[o + 1], pow2)
        dmin = half(row[o + 2], row[o + 3], pow2)
        s = o + 4  # 12 bytes of packed 6-bit scales and mins
        q = o + 16  # 128 bytes of nibbles
        for p in range(4):  # 64 values: sub-blocks 2p (low nibbles) and 2p + 1 (high)
            j = 2 * p
            if j < 4:
                sc0 = np.int32(row[s + j]) & 63
                mn0 = np.int32(row[s + j + 4]) & 63
                sc1 = np.int32(row[s + j + 1]) & 63
                mn1 = np.int32(row[s + j + 5]) & 63
            else:
                sc0 = (np.int32(row[s + j + 4]) & 15) | ((np.int32(row[s + j - 4]) >> 6) << 4)
                mn0 = (np.int32(row[s + j + 4]) >> 4) | ((np.int32(row[s + j]) >> 6) << 4)
                sc1 = (np.int32(row[s + j + 5]) & 15) | ((np.int32(row[s + j - 3]) >> 6) << 4)
                mn1 = (np.int32(row[s + j + 5]) >> 4) | ((np.int32(row[s + j + 1]) >> 6) << 4)
            d0 = d * np.float32(sc0)
            m0 = dmin * np.float32(mn0)
            d1 = d * np.float32(sc1)
            m1 = dmin * np.float32(mn1)
            base = b * 256 + p * 64
            for l in range(32):
                v = np.int32(row[q + p * 32 + l])
                out[base + l] = d0 * np.float32(v & 15) - m0
                out[base + 32 + l] = d1 * np.float32(v >> 4) - m1


@njit(inline="always", boundscheck=False, fastmath=True, cache=CACHE)  # type: ignore[untyped-decorator]
def dec_q6_k(row: Any, b0: int, nb: int, out: Any, pow2: Any, scale: float) -> None:
    for b in range(nb):
        o = (b0 + b) * 210
        d = half(row[o + 208], row[o + 209], pow2)
        for h in range(2):  # two halves of 128 values
            ql = o + 64 * h
            qh = o + 128 + 32 * h
            sc = o + 192 + 8 * h
            base = b * 256 + 128 * h
            for c in range(8):  # 16 values per scale
                dsc = d * np.float32(np.int8(row[sc + c]))
                # values [16c, 16c + 16) of this half: chunk of 32 = c // 2
                chunk = c // 2
                for l0 in range(16):
                    l = (c % 2) * 16 + l0
                    lo = np.int32(row[ql + l + 32 * (chunk % 2)])
                    lo = (lo >> 4) if chunk >= 2 else (lo & 15)
                    hi = (np.int32(row[qh + l]) >> (2 * chunk)) & 3
                    out[base + 32 * chunk + l] = dsc * np.float32((lo | (hi << 4)) - 32)


@njit(inline="always", boundscheck=False, fastmath=True, cache=CACHE)  # type: ignore[untyped-decorator]
def dec_int8(row: Any, b0: int, nb: int, out: Any, pow2: Any, scale: float) -> None:
    for j in range(nb):
        out[j] = scale * np.float32(np.int8(row[b0 + j]))
