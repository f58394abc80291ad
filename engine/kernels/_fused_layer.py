"""One decoder layer as one compiled call, for quantized weights (numba; imported lazily).

At the small end the time per token goes to the ~25 tensor operations a layer costs in torch
(4-6 µs of dispatch each on the 2-core machine we measured, against ~1 µs to enter a compiled
function), not to arithmetic: SmolLM2-135M spent ~5 ms of a ~13 ms token there. This module
runs the whole pre-norm layer — RMSNorm, the q|k|v product and bias, rotary embeddings, the
K/V cache write, attention over the cache under the block's mask (the row-invariant kernel
of :mod:`engine.kernels._attention`), the output product, RMSNorm,
gate|up, SiLU, down — in one call, for any block size, with the quantized products of
:mod:`engine.kernels._quant_mm`.

Exactness: every row is computed by the same code whatever the block size (norms, rotary
embeddings and attention are per row; the products are batch-invariant), so speculative
verification and sequential decoding give the same bits. The float32 reference path
(``--client-quant none``) keeps the torch layer of :mod:`engine.model`, token-identical to
transformers.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from typing import Any

import numpy as np
from numba import literally, njit, prange, types
from numba.core import errors
from numba.extending import overload

from engine.kernels._attention import attend_rows
from engine.kernels._int_mm import (
    im_int8,
    im_q4_0,
    im_q4_1,
    im_q4_k,
    im_q5_0,
    im_q5_1,
    im_q5_k,
    im_q6_k,
    im_q8_0,
)
from engine.kernels._quant_mm import (
    mm_int8,
    mm_q4_0,
    mm_q4_1,
    mm_q4_k,
    mm_q5_0,
    mm_q5_1,
    mm_q5_k,
    mm_q6_k,
    mm_q8_0,
)

# numba caches a frozen app's functions too (in the user cache, keyed by the executable)
CACHE = True
_OPTS: dict[str, Any] = {"boundscheck": False, "nogil": True, "cache": CACHE}
_ZERO = np.float32(0.0)  # attention's default query scale (1 / sqrt(hd)) and no soft-capping


# format code -> its product (engine.kernels._ir.CODES; from 16 up: int8 activations)
KERNELS: dict[int, Any] = {
    0: mm_q8_0,
    1: mm_q4_0,
    2: mm_q4_1,
    3: mm_q4_k,
    4: mm_q6_k,
    5: mm_int8,
    6: mm_q5_0,
    7: mm_q5_1,
    8: mm_q5_k,
    16: im_q8_0,
    17: im_q4_0,
    18: im_q4_1,
    19: im_q4_k,
    20: im_q6_k,
    21: im_int8,
    22: im_q5_0,
    23: im_q5_1,
    24: im_q5_k,
}


def product(fmt: int, x: Any, w: Any, scale: Any, y: Any, threads: int) -> None:
    """y = x @ dequant(w).T for the format code ``fmt`` (a compile-time constant: only that
    format's kernel is compiled into the caller)."""
    KERNELS[fmt](x, w, scale, y, threads)


@overload(product, prefer_literal=True)
def _product(fmt: Any, x: Any, w: Any, scale: Any, y: Any, threads: Any) -> Any:
    if not isinstance(fmt, types.IntegerLiteral):
        raise errors.RequireLiteralValue(fmt)
    kernel = KERNELS[fmt.literal_value]

    def impl(fmt: Any, x: Any, w: Any, scale: Any, y: Any, threads: Any) -> None:
        kernel(x, w, scale, y, threads)

    return impl


@njit(fastmath=True, **_OPTS)  # type: ignore[untyped-decorator]
def rms_norm_rows(x: Any, weight: Any, eps: float, out: Any) -> None:
    """out[b] = weight * x[b] / sqrt(mean(x[b]^2) + eps), per row."""
    n = x.shape[1]
    for b in range(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(n):
            ss += x[b, i] * x[b, i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(n) + np.float32(eps))
        for i in range(n):
            out[b, i] = weight[i] * (x[b, i] * inv)


@njit(fastmath=True, **_OPTS)  # type: ignore[untyped-decorator]
def rope_rows(v: Any, col: int, heads: int, hd: int, cos: Any, sin: Any) -> None:
    """Rotary embedding (rotate-half layout) in place on ``heads`` heads of ``v`` [B, *]
    starting at column ``col``."""
    half = hd // 2
    tmp = np.empty(hd, dtype=np.float32)
    for b in range(v.shape[0]):
        for h in range(heads):
            o = col + h * hd
            for i in range(hd):
                tmp[i] = v[b, o + i]
            for i in range(half):
                v[b, o + i] = tmp[i] * cos[b, i] - tmp[i + half] * sin[b, i]
                v[b, o + half + i] = tmp[half + i] * cos[b, half + i] + tmp[i] * sin[b, half + i]


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def attend_block(
    qkv: Any,
    bias: Any,
    cos: Any,
    sin: Any,
    kc: Any,
    vc: Any,
    start: int,
    mask: Any,
    masked: bool,
    dims: Any,
    threads: int,
) -> Any:
    """From the block's q|k|v [B, (nh + 2 nkv) hd]: add the bias, rotate q and k, write k and v
    to the cache at ``start`` and attend; returns the attention output [B, nh hd]."""
    nh, nkv, hd = dims[0], dims[1], dims[2]
    rows = qkv.shape[0]
    if bias.shape[0]:
        for b in range(rows):
            for i in range(qkv.shape[1]):
                qkv[b, i] += bias[i]
    rope_rows(qkv, 0, nh, hd, cos, sin)
    rope_rows(qkv, nh * hd, nkv, hd, cos, sin)
    for b in range(rows):
        for g in range(nkv):
            for i in range(hd):
                kc[g, start + b, i] = qkv[b, (nh + g) * hd + i]
                vc[g, start + b, i] = qkv[b, (nh + nkv + g) * hd + i]
    att = np.empty((rows, nh * hd), dtype=np.float32)
    attend_rows(qkv, kc, vc, start + rows, mask, masked, nh, _ZERO, _ZERO, att, threads)
    return att


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def add_rows(x: Any, o: Any) -> None:
    """x += o, row by row (the residual)."""
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[b, i] += o[b, i]


SILU_COLS = 1024  # columns per parallel job of silu_gate


@njit(parallel=True, **_OPTS)  # type: ignore[untyped-decorator]
def silu_gate(g: Any, gc: int, u: Any, uc: int, inter: int, act: Any) -> None:
    """act = silu(g[:, gc:gc+inter]) * u[:, uc:uc+inter], in parallel jobs of
    :data:`SILU_COLS` columns of a row. The sigmoid takes e = exp(-|g|) (the exp of
    ``engine.kernels._attention._softmax_weights``: (e^(y / 1024))^1024, a degree-6 Taylor
    term, float64, plain multiplies the compiler vectorizes; a call to ``exp`` per value was
    ~8 ms of a 256-row layer of Qwen2.5-1.5B) and is 1 / (1 + e) for g >= 0, e / (1 + e)
    below; every value's operations depend on that value alone."""
    per = (inter + SILU_COLS - 1) // SILU_COLS
    for job in prange(act.shape[0] * per):
        b = job // per
        c0 = (job % per) * SILU_COLS
        c1 = min(c0 + SILU_COLS, inter)
        # one-dimensional views: indexing the 2-D arrays kept the compiler from vector code
        # (2.7x slower on a 256-row Qwen2.5-1.5B block); the same operations per value
        gs, us, out = g[b, gc + c0 : gc + c1], u[b, uc + c0 : uc + c1], act[b, c0:c1]
        for i in range(c1 - c0):
            v = np.float64(gs[i])
            y = max(-abs(v), -87.0) * (1.0 / 1024.0)
            e = 1.0 + y * (
                1.0 + y * (0.5 + y * (1.0 / 6 + y * (1.0 / 24 + y * (1.0 / 120 + y / 720))))
            )
            for _ in range(10):  # e^(y / 1024) -> e^y
                e *= e
            sig = (1.0 if v >= 0 else e) / (1.0 + e)
            out[i] = np.float32(v * sig) * us[i]


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def layer_body(
    f_qkv: int,
    f_o: int,
    f_gu: int,
    f_down: int,
    x: Any,
    ln1: Any,
    qkv_w: Any,
    bias: Any,
    wo: Any,
    ln2: Any,
    gu_w: Any,
    down_w: Any,
    scales: Any,
    cos: Any,
    sin: Any,
    kc: Any,
    vc: Any,
    start: int,
    mask: Any,
    masked: bool,
    dims: Any,
    eps: float,
    threads: int,
) -> None:
    """One decoder layer on the block ``x`` [B, H], in place. ``f_*``: format codes of the
    four products, compile-time constants (see :func:`entry`); ``scales``: their per-row scale
    arrays as a tuple; ``dims``: (heads, kv heads, head dim, intermediate size); ``bias``:
    [(nh + 2 nkv) hd] or empty."""
    literally(f_qkv)
    literally(f_o)
    literally(f_gu)
    literally(f_down)
    nh, nkv, hd, inter = dims[0], dims[1], dims[2], dims[3]
    rows, hid = x.shape
    h = np.empty((rows, hid), dtype=np.float32)
    rms_norm_rows(x, ln1, eps, h)
    qkv = np.empty((rows, (nh + 2 * nkv) * hd), dtype=np.float32)
    product(f_qkv, h, qkv_w, scales[0], qkv, threads)
    att = attend_block(qkv, bias, cos, sin, kc, vc, start, mask, masked, dims, threads)
    o = np.empty((rows, hid), dtype=np.float32)
    product(f_o, att, wo, scales[1], o, threads)
    add_rows(x, o)
    rms_norm_rows(x, ln2, eps, h)
    gu = np.empty((rows, 2 * inter), dtype=np.float32)
    product(f_gu, h, gu_w, scales[2], gu, threads)
    act = np.empty((rows, inter), dtype=np.float32)
    silu_gate(gu, 0, gu, inter, inter, act)
    product(f_down, act, down_w, scales[3], o, threads)
    add_rows(x, o)


@njit(**_OPTS)  # type: ignore[untyped-decorator]
def layer_body_parts(
    f_q: int,
    f_k: int,
    f_v: int,
    f_o: int,
    f_g: int,
    f_u: int,
    f_down: int,
    x: Any,
    ln1: Any,
    qkv_w: Any,
    bias: Any,
    wo: Any,
    ln2: Any,
    gu_w: Any,
    down_w: Any,
    scales: Any,
    cos: Any,
    sin: Any,
    kc: Any,
    vc: Any,
    start: int,
    mask: Any,
    masked: bool,
    dims: Any,
    eps: float,
    threads: int,
) -> None:
    """:func:`layer_body` for a layer whose q|k|v and gate|up matrices are stored in more than
    one format (``*-Q4_K_M.gguf`` files): ``qkv_w`` is a tuple (q, k, v) and ``gu_w`` a tuple
    (gate, up), each part multiplied by its own format's product — the same products, in the
    same order of operations per row, as the layer run piece by piece; ``scales`` has seven
    entries (q, k, v, o, gate, up, down)."""
    literally(f_q)
    literally(f_k)
    literally(f_v)
    literally(f_o)
    literally(f_g)
    literally(f_u)
    literally(f_down)
    nh, nkv, hd, inter = dims[0], dims[1], dims[2], dims[3]
    rows, hid = x.shape
    h = np.empty((rows, hid), dtype=np.float32)
    rms_norm_rows(x, ln1, eps, h)
    q = np.empty((rows, nh * hd), dtype=np.float32)
    k = np.empty((rows, nkv * hd), dtype=np.float32)
    v = np.empty((rows, nkv * hd), dtype=np.float32)
    product(f_q, h, qkv_w[0], scales[0], q, threads)
    product(f_k, h, qkv_w[1], scales[1], k, threads)
    product(f_v, h, qkv_w[2], scales[2], v, threads)
    qkv = np.empty((rows, (nh + 2 * nkv) * hd), dtype=np.float32)
    for b in range(rows):
        qkv[b, : nh * hd] = q[b]
        qkv[b, nh * hd : (nh + nkv) * hd] = k[b]
        qkv[b, (nh + nkv) * hd :] = v[b]
    att = attend_block(qkv, bias, cos, sin, kc, vc, start, mask, masked, dims, threads)
    o = np.empty((rows, hid), dtype=np.float32)
    product(f_o, att, wo, scales[3], o, threads)
    add_rows(x, o)
    rms_norm_rows(x, ln2, eps, h)
    g = np.empty((rows, inter), dtype=np.float32)
    u = np.empty((rows, inter), dtype=np.float32)
    product(f_g, h, gu_w[0], scales[4], g, threads)
    product(f_u, h, gu_w[1], scales[5], u, threads)
    act = np.empty((rows, inter), dtype=np.float32)
    silu_gate(g, 0, u, 0, inter, act)
    product(f_down, act, down_w, scales[6], o, threads)
    add_rows(x, o)


_ENTRY = """\"\"\"Generated by Veil (engine.kernels._fused_layer.entry); do not edit: the one-call
decoder layer for the product formats {codes} (numba caches its machine code beside it).\"\"\"

from numba import njit

from engine.kernels._fused_layer import {body}


@njit(cache=True, nogil=True, boundscheck=False)
def layer(x, ln1, qkv_w, bias, wo, ln2, gu_w, down_w, scales, cos, sin, kc, vc, start, mask,
          masked, dims, eps, threads):
    {body}({args}, x, ln1, qkv_w, bias, wo, ln2, gu_w, down_w, scales, cos,
               sin, kc, vc, start, mask, masked, dims, eps, threads)
"""
_entries: dict[tuple[int, ...], Any] = {}


def entry(codes: tuple[int, ...], folder: str) -> Any:
    """The compiled layer for these four format codes (q|k|v, o, gate|up, down), or seven for
    a layer stored in several formats (q, k, v, o, gate, up, down: :func:`layer_body_parts`).

    Each combination is a tiny generated module in ``folder`` that calls :func:`layer_body` with
    the codes as constants, so a model compiles only the kernels it uses (one format: seconds;
    all eighteen: minutes), and numba caches each combination's machine code on disk — which a
    module defined here could not do per combination, and a frozen app could not do at all."""
    fn = _entries.get(codes)
    if fn is not None:
        return fn
    name = "veil_layer_" + "_".join(str(c) for c in codes)
    if len(codes) not in (4, 7):
        raise ValueError(f"a fused layer takes 4 or 7 format codes, not {codes}")
    body = "layer_body" if len(codes) == 4 else "layer_body_parts"
    text = _ENTRY.format(codes=codes, body=body, args=", ".join(str(c) for c in codes))
    try:
        path = _write_once(os.path.join(folder, name + ".py"), text)
    except OSError:  # an unwritable cache folder: compile from a temporary copy, uncached
        path = _write_once(os.path.join(tempfile.mkdtemp(prefix="veil-layer-"), name + ".py"), text)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    fn = module.layer
    _entries[codes] = fn
    return fn


def _write_once(path: str, text: str) -> str:
    """``text`` at ``path``, written only when the file differs (a new timestamp would
    invalidate numba's cache for it); atomic, so concurrent processes agree."""
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text:
                return path
    except OSError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path
