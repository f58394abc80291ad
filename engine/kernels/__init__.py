"""Small-batch linear layers for CPU decoding: ``y = x @ w.T`` for a few rows of ``x``.

Decoding multiplies a handful of rows (one token, or a draft tree of 2-64 nodes) by every weight
matrix. BLAS libraries are tuned for big matrices: on the CPUs we measured, MKL's GEMM for 4-16
rows costs 3-4x its single-row GEMV, although the weights — which dominate the memory traffic —
are the same. This module's float32 kernel (:mod:`engine.kernels._f32_ir`, LLVM IR through
numba, parallel over tiles of weight rows) reads each weight tile once for all the block's rows
and computes 4 x 4 blocks of outputs where there are four rows to share the loads.

Batch invariance: every output element is one dot product with a fixed order of operations
(16 lanes with fused multiply-adds, a fixed tree, then the tail), whichever block computed it,
so a row's result does not depend on how many other rows share the call. A token verified
inside a tree therefore gets bit-identical projections to the same token decoded alone, and the
trunk worker's batches (:mod:`engine.kernels.batched`) use the same kernel.

Falls back to ``torch.nn.functional.linear`` when numba is missing or fails to compile, for
non-float32 or non-CPU tensors, when autograd is recording, and for blocks above
:data:`MAX_ROWS` rows (prefill), where BLAS is efficient.

Quantized weights (:class:`engine.quant.QuantWeight`) go to the kernels of
:mod:`engine.kernels._quant_mm` for every block size — prefill included — so all their products
come from one batch-invariant code path. Without numba they are decoded tile by tile (numpy,
exact) and multiplied by BLAS: correct, slower, and said so in :func:`status`.

:mod:`engine.kernels.cpu` says what the CPU has (used to choose the default compute dtype).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import marshal
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.quant import QuantWeight, Stacked

log = logging.getLogger(__name__)

# Blocks up to this many rows use the kernel; bigger ones (prefill) use BLAS. Above the
# speculative decoder's largest block (a root and 64 draft nodes), so every verification block
# takes the same batch-invariant path as a single decoded token.
MAX_ROWS = 128

_lock = threading.Lock()
_kernel: Callable[..., None] | None = None
_reason = ""  # why the kernel is unavailable, once a build has failed
_enabled = os.environ.get("VEIL_KERNELS", "1").strip().lower() not in ("0", "off", "false", "no")
_threads: int | None = None  # kernel threads; None: as many as torch uses


def _cache_dir() -> str:
    from platformdirs import user_cache_dir

    return os.path.join(user_cache_dir("veil", appauthor=False), "numba")


def _use_one_cache_dir() -> None:
    """Point numba's on-disk cache at Veil's folder before numba is first imported.

    numba fixes where a cached function lives when the function is defined, from
    ``NUMBA_CACHE_DIR`` as numba last read it (at import, and again at each compile once the
    variable changed). Set only by the first kernel build, as it once was, the same function was
    cached in one place by a process that started with the variable set (the built-in server
    child inherits it) and in another (beside its source) by one that did not, so a start
    whose order of first uses differed compiled the decoder layer again."""
    os.environ.setdefault("NUMBA_CACHE_DIR", _cache_dir())
    numba = sys.modules.get("numba")
    if numba is not None and not getattr(numba.config, "CACHE_DIR", ""):
        numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]


_use_one_cache_dir()


def _build() -> Callable[..., None]:
    """Compile (or load from numba's on-disk cache) the kernel. Raises on any failure."""
    from engine.kernels._f32_ir import f32_times_weight

    kernel: Callable[..., None] = f32_times_weight
    # smoke-check the compiled code against torch before trusting it
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(5, 37, generator=g)
    ws = torch.randn(11, 37, generator=g)
    ys = torch.empty(5, 11)
    kernel(xs.numpy(), ws.numpy(), ys.numpy())
    if not torch.allclose(ys, xs @ ws.t(), atol=1e-4, rtol=1e-4):
        raise RuntimeError("the compiled kernel disagrees with torch")
    return kernel


def available() -> bool:
    """Whether the kernel is usable (compiles it on first call, ~1 s; cached on disk after)."""
    global _kernel, _reason
    if not _enabled:
        return False
    if _kernel is None and not _reason:
        with _lock:
            if _kernel is None and not _reason:
                threads = torch.get_num_threads()
                try:
                    _kernel = _build()
                except Exception as exc:  # numba missing, no LLVM target, frozen-app quirks...
                    _reason = f"{type(exc).__name__}: {exc}"
                    log.info("float32 row kernel unavailable, using BLAS: %s", _reason)
                finally:
                    # Starting numba's OpenMP pool sets the process's OpenMP thread count to the
                    # pool size, and torch reads that count: without this, a process told to use
                    # one thread (the bench's client and trunk, `veil-trunk --threads 1`) ran its
                    # torch ops, and then the kernel, on every core after the first product.
                    _restore_threads(threads)
    return _kernel is not None


_compiles = 0  # numba compilations started in this process since compiles() was first called
_watching = False


def compiles() -> int:
    """How many numba compilations (machine code built, not loaded from numba's disk cache)
    this process has started since the first call: a count that changes while a piece of work
    runs says its time includes a first-use compile (~0.1-3 s each), which is not what that
    work costs. The speculative decoder's cost model and mode chooser leave such rounds out
    (:mod:`engine.speculative`): on a fresh install one compile inside the first drafted round
    made drafting look ten times dearer than it is, and kept it off for the whole session."""
    global _watching
    if not _watching:
        with _lock:
            if not _watching:
                _watching = True
                if _enabled and importlib.util.find_spec("numba") is not None:
                    from numba.core import event

                    class _Counter(event.Listener):  # type: ignore[misc]
                        def on_start(self, ev: Any) -> None:
                            global _compiles
                            _compiles += 1

                        def on_end(self, ev: Any) -> None:
                            pass

                    event.register("numba:compile", _Counter())
    return _compiles


def _restore_threads(n: int) -> None:
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def status() -> str:
    """One line for diagnostics: which path small blocks take."""
    if not _enabled:
        return "BLAS (kernels disabled by VEIL_KERNELS=0)"
    if available():
        return "numba float32 row kernel (batch-invariant)"
    return f"BLAS ({_reason})"


def set_enabled(on: bool) -> None:
    """Turn the kernel on or off (tests, benchmarks of the BLAS path)."""
    global _enabled
    _enabled = on


_local = threading.local()


def set_threads(n: int | None) -> None:
    """Threads for the kernel, independent of torch's (``None``: follow torch). When the client
    and the trunk share a machine they compute in turn, so each side's kernel — the bulk of its
    time — may use every core while torch's small elementwise ops stay on one."""
    global _threads
    if n is not None and n < 1:
        raise ValueError("kernel threads must be at least 1")
    _threads = n


def threads() -> int:
    """How many threads the kernel runs on in this thread."""
    return _threads or torch.get_num_threads()


def _sync_threads(n: int) -> None:
    """Run the kernel on ``n`` threads. numba's count is per calling thread, so each thread that
    runs the kernel sets its own."""
    if getattr(_local, "threads", None) != n:
        import numba

        numba.set_num_threads(max(1, min(n, int(getattr(numba.config, "NUMBA_NUM_THREADS", n)))))
        _local.threads = n


def linear(
    x: torch.Tensor, w: torch.Tensor | QuantWeight | Stacked, *, invariant: bool = False
) -> torch.Tensor:
    """``x @ w.T``: x [B, in], w [out, in] (a float tensor, quantized rows, or several of them
    side by side) -> [B, out].

    ``invariant``: the batching worker's call — a row's result must not depend on how many rows
    share the call, at any row count (:mod:`engine.kernels.batched`; the quantized kernels
    compute each row on its own and are invariant as they are)."""
    if not isinstance(w, torch.Tensor):
        parts = getattr(w, "parts", None)
        if parts is not None:
            return torch.cat([linear(x, p, invariant=invariant) for p in parts], dim=-1)
        return _quant_linear(x, w)  # type: ignore[arg-type]
    if invariant:
        from engine.kernels import batched

        return batched.linear(x, w)
    if x.dtype in (torch.bfloat16, torch.float16) and x.dtype == w.dtype:
        return _half_linear(x, w)
    if (
        x.shape[0] > MAX_ROWS
        or x.dtype != torch.float32
        or w.dtype != torch.float32
        or x.device.type != "cpu"
        or w.device.type != "cpu"
        or x.dim() != 2
        or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        or not w.is_contiguous()
        or x.shape[0] == 0
        or not available()
    ):
        return F.linear(x, w)
    assert _kernel is not None
    xc = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)  # [B, out]
    n = torch.get_num_threads()
    with _lock:  # numba's fallback threading layer is not re-entrant
        _sync_threads(_threads or n)  # = threads()
        _kernel(xc.numpy(), w.numpy(), y.numpy())
    _restore_threads(n)  # in case numba's pool (re)started in this call; see available()
    return y


# --- bfloat16 / float16 ---------------------------------------------------------------------

PAD_ROWS = 32  # low-precision products on CPUs with bf16/fp16 hardware run at this fixed shape


def _half_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 products. Where the CPU has native bf16/fp16 units, oneDNN picks its GEMM
    kernel (and so the order of the sums) by the number of rows; there every block up to
    MAX_ROWS is computed in slices of exactly PAD_ROWS rows (zero-padded), so a row's result
    does not depend on the block it came in. Elsewhere torch widens to float32 per row, which
    we measured to be batch-invariant already, and the padding would only cost time."""
    from engine.kernels import cpu

    n = x.shape[0]
    fast = cpu.has_fast_bf16() if x.dtype == torch.bfloat16 else cpu.has_fast_fp16()
    if (
        not fast
        or n > MAX_ROWS
        or x.device.type != "cpu"
        or x.dim() != 2
        or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    ):
        return F.linear(x, w)
    out = []
    for m0 in range(0, n, PAD_ROWS):
        xm = x[m0 : m0 + PAD_ROWS]
        rows = xm.shape[0]
        if rows < PAD_ROWS:
            xm = torch.cat([xm, xm.new_zeros(PAD_ROWS - rows, x.shape[1])])  # [PAD_ROWS, in]
        out.append(F.linear(xm, w)[:rows])
    return torch.cat(out)


# --- helper kernels (attention, top-k): compiled on first use --------------------------------

_built: dict[str, Callable[..., None]] = {}  # helper kernels compiled so far, by name
_failed: dict[str, str] = {}  # why a helper kernel is unavailable, by name


def _helper(name: str, build: Callable[[], Callable[..., None]], fallback: str) -> Any:
    """The compiled helper kernel ``name`` (built and checked on first use), or None when it
    cannot be built here (then the caller uses ``fallback``, and the reason is logged once)."""
    kern = _built.get(name)
    if kern is not None or name in _failed:
        return kern
    with _lock:
        if name not in _built and name not in _failed:
            threads = torch.get_num_threads()
            try:
                _built[name] = build()
            except Exception as exc:  # numba missing, no LLVM target, a failed check...
                _failed[name] = f"{type(exc).__name__}: {exc}"
                log.info("%s kernel unavailable, using %s: %s", name, fallback, _failed[name])
            finally:
                _restore_threads(threads)
    return _built.get(name)


def _build_attention() -> Callable[..., None]:
    from engine.kernels._attention import attend_rows

    kernel: Callable[..., None] = attend_rows
    # smoke-check against torch before trusting it: 2 rows, 4 query heads over 2 K/V heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 2, 8, generator=g)  # [nh, B, hd]
    kc = torch.randn(2, 9, 8, generator=g)  # [nkv, capacity, hd]
    vc = torch.randn(2, 9, 8, generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 0], [1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out = torch.empty(2, 32)
    rows = q.transpose(0, 1).reshape(2, 32).contiguous()  # [B, nh hd]
    kernel(rows.numpy(), kc.numpy(), vc.numpy(), 7, mask.numpy(), True, 4, 0.0, 0.0, out.numpy(), 1)
    ref = (
        F.scaled_dot_product_attention(
            q.unsqueeze(0),
            kc[:, :7].unsqueeze(0),
            vc[:, :7].unsqueeze(0),
            attn_mask=mask,
            enable_gqa=True,
        )[0]
        .transpose(0, 1)
        .reshape(2, 32)
    )
    if not torch.allclose(out, ref, atol=1e-5, rtol=1e-4):
        raise RuntimeError("the compiled attention disagrees with torch")
    return kernel


def attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    end: int,
    mask: torch.Tensor | None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor | None:
    """Row-invariant attention of ``q`` [nh, B, hd] over slots [0, end) of one layer's cache
    buffers ``kc``/``vc`` [nkv, capacity, hd] under ``mask`` [B, end] (None: every slot) ->
    [B, nh hd]; ``scale``: the score scale (None: 1 / sqrt(hd)); ``softcap``: scores capped
    at softcap * tanh(score / softcap). None where it does not apply (not CPU float32, no
    numba, autograd), and the caller uses SDPA (:mod:`engine.kernels._attention` says why it
    exists)."""
    if (
        not _enabled
        or q.dtype != torch.float32
        or kc.dtype != torch.float32
        or q.device.type != "cpu"
        or kc.device.type != "cpu"
        or (torch.is_grad_enabled() and q.requires_grad)
        or not (kc.is_contiguous() and vc.is_contiguous())
        or (mask is not None and tuple(mask.shape) != (q.shape[1], end))
    ):
        return None
    kern = _helper("row-invariant attention", _build_attention, "SDPA")
    if kern is None:
        return None
    nh, n, hd = q.shape
    rows = q.transpose(0, 1).reshape(n, nh * hd).contiguous()  # [B, nh hd]
    out = torch.empty(n, nh * hd, dtype=torch.float32)  # [B, nh hd]
    m = mask.contiguous() if mask is not None else torch.ones(1, 1, dtype=torch.bool)
    sc, cap = np.float32(scale or 0.0), np.float32(softcap or 0.0)
    _run(
        lambda: kern(
            rows.numpy(),
            kc.numpy(),
            vc.numpy(),
            end,
            m.numpy(),
            mask is not None,
            nh,
            sc,
            cap,
            out.numpy(),
            _threads or torch.get_num_threads(),
        )
    )
    return out


# --- top-k successors ----------------------------------------------------------------------


def _build_topk() -> Callable[..., None]:
    from engine.kernels._topk import top_k_softmax as kernel

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 301, generator=g)
    ids = torch.empty(3, 5, dtype=torch.long)
    probs = torch.empty(3, 5)
    kernel(x.numpy(), ids.numpy(), probs.numpy())
    vals, ref = x.topk(5, dim=-1)
    if not torch.equal(ids, ref) or not torch.allclose(
        probs, (vals - x.logsumexp(-1, keepdim=True)).exp(), rtol=1e-5, atol=1e-7
    ):
        raise RuntimeError("the compiled top-k disagrees with torch")
    return kernel  # type: ignore[no-any-return]


def top_k_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``k`` largest logits of each row of ``logits`` [B, V] -> (token ids [B, k], their
    softmax probabilities [B, k]) on the kernel threads; None where the kernel does not apply
    (not CPU float32, no numba, k > V) and the caller uses torch."""
    if (
        not _enabled
        or logits.dtype != torch.float32
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or not 0 < k <= logits.shape[1]
        or logits.requires_grad
    ):
        return None
    kern = _helper("top-k", _build_topk, "torch")
    if kern is None:
        return None
    x = logits.contiguous()
    ids = torch.empty(x.shape[0], k, dtype=torch.long)  # [B, k]
    probs = torch.empty(x.shape[0], k, dtype=torch.float32)  # [B, k]
    _run(lambda: kern(x.numpy(), ids.numpy(), probs.numpy()))
    return ids, probs


# --- quantized weights ---------------------------------------------------------------------

_qlock = threading.Lock()
_qmod: Any = None
_qreason = ""
QUANT_ROWS = 256  # rows per kernel call (prefill is split into calls of this many rows)
# Quantized products with int8 activations (llama.cpp's rule, engine.kernels._int_mm): the
# default, ~2-3x faster than float activations for one row; they change the numbers slightly
# (the activations are rounded to 8 bits per block of 32; docs/performance.md has the quality
# measured). ``--exact-float`` (VEIL_INT8_ACTIVATIONS=0) decodes quantized weights to float and
# multiplies in float instead: exactly the dequantized model's arithmetic.
_int_acts = os.environ.get("VEIL_INT8_ACTIVATIONS", "1").strip().lower() not in (
    "0",
    "off",
    "false",
    "no",
)
EXACT_FLOAT_HELP = (
    "multiply quantized weights with float activations: exactly the dequantized model's "
    "arithmetic, ~2x slower on a CPU (default: activations rounded to int8 per block of 32, "
    "llama.cpp's rule; speculative output equals sequential output either way)"
)


def set_int8_activations(on: bool) -> None:
    """Quantized products with int8 activations (the default: faster, approximate) or float
    ones (exact to float rounding). Process-wide: switch it only between generations."""
    global _int_acts
    _int_acts = on


def int8_activations() -> bool:
    return _int_acts


def _quant_cache_dir() -> str:
    """numba's cache for the quantized kernels, keyed by the source that generates their
    machine code (the IR emitters live in another file than the cached functions, and numba
    checks only the latter's timestamp), by the CPU features hidden from the emitters and by
    the int8 kernels' vector width."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in (
        "_attention.py",
        "_f32_ir.py",
        "_ir.py",
        "_ir_int.py",
        "_ir_kquant.py",
        "_quant_mm.py",
        "_int_mm.py",
        "_fused_layer.py",
    ):
        try:
            h.update((here / name).read_bytes())
        except OSError:  # a frozen app holds bytecode only: key by that
            mod = f"{__name__}.{name[:-3]}"
            spec = importlib.util.find_spec(mod)
            get_code = getattr(spec.loader if spec is not None else None, "get_code", None)
            code = get_code(mod) if get_code is not None else None
            h.update(marshal.dumps(code) if code is not None else name.encode())
    from engine.kernels import cpu

    h.update(",".join(sorted(cpu.features_off())).encode())  # the emitters choose by feature
    h.update(b"512" if cpu.wide_int8() else b"256")  # ... and the int8 kernels by width
    return os.path.join(_cache_dir(), "quant-" + h.hexdigest()[:12])


def _build_quant() -> Any:
    import numba

    old = getattr(numba.config, "CACHE_DIR", "")
    folder = _quant_cache_dir()
    numba.config.CACHE_DIR = folder  # type: ignore[attr-defined]
    try:
        from engine.kernels import _fused_layer, _int_mm, _quant_mm
    finally:
        numba.config.CACHE_DIR = old  # type: ignore[attr-defined]
    _quant_mm.entry = _fused_layer.entry  # type: ignore[attr-defined]
    _quant_mm.layers_dir = os.path.join(folder, "layers")  # type: ignore[attr-defined]
    _quant_mm.IMATMUL = _int_mm.IMATMUL  # type: ignore[attr-defined]
    return _quant_mm


def quant_available() -> bool:
    """Whether the quantized kernels are usable (compiled per format on first use)."""
    global _qmod, _qreason
    if not _enabled:
        return False
    if _qmod is None and not _qreason:
        with _qlock:
            if _qmod is None and not _qreason:
                threads = torch.get_num_threads()
                try:
                    _qmod = _build_quant()
                except Exception as exc:
                    _qreason = f"{type(exc).__name__}: {exc}"
                    log.info("quantized kernels unavailable, decoding tiles for BLAS: %s", _qreason)
                finally:
                    _restore_threads(threads)
    return _qmod is not None


def quant_status() -> str:
    if not _enabled:
        return "tile decode + BLAS (kernels disabled by VEIL_KERNELS=0)"
    if quant_available():
        acts = "int8 activations" if _int_acts else "float activations"
        return f"numba quantized kernels ({acts})"
    return f"tile decode + BLAS ({_qreason})"


def _reference_rows(w: QuantWeight, idx: np.ndarray) -> np.ndarray:
    """Rows decoded by the gguf package's numpy reference (no numba)."""
    if w.fmt == "int8":
        q = w.data[idx].view(np.int8).astype(np.float32)
        return q * w.scale[idx, None]  # type: ignore[no-any-return]
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, w.fmt.upper())
    return gguf.quants.dequantize(w.data[idx], qtype).astype(np.float32)  # type: ignore[no-any-return]


def dequantize_rows(w: QuantWeight, idx: np.ndarray) -> torch.Tensor:
    """float32 [len(idx), K]: rows ``idx`` of ``w`` decoded."""
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= w.shape[0]):
        raise IndexError("row index out of range")
    if not quant_available():
        return torch.from_numpy(_reference_rows(w, idx))
    out = np.empty((idx.shape[0], w.k), dtype=np.float32)
    if idx.size:
        _run(lambda: _qmod.ROWS[w.fmt](w.data, w.scale, idx, out))
    return torch.from_numpy(out)


def _run(fn: Callable[[], None]) -> None:
    n = torch.get_num_threads()
    with _lock:  # numba's fallback threading layer is not re-entrant
        _sync_threads(_threads or n)
        fn()
    _restore_threads(n)


def _quant_linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    m = x.shape[0]
    if (
        _qmod is not None
        and _enabled
        and x.dtype == torch.float32
        and x.dim() == 2
        and 0 < m <= QUANT_ROWS
        and x.shape[1] == w.k
        and x.is_contiguous()
        and x.device.type == "cpu"
        and not (x.requires_grad and torch.is_grad_enabled())
    ):  # the decode path, kept short: it runs ~4 times per layer per token
        y = torch.empty(m, w.data.shape[0], dtype=torch.float32)  # [B, out]
        n = torch.get_num_threads()
        nt = _threads or n
        with _lock:
            if getattr(_local, "threads", None) != nt:
                _sync_threads(nt)
            table = _qmod.IMATMUL if _int_acts else _qmod.MATMUL
            table[w.fmt](x.numpy(), w.data, w.scale, y.numpy(), nt)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return y
    return _quant_linear_general(x, w)


def _quant_linear_general(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"cannot multiply {tuple(x.shape)} by quantized {w.shape}")
    if x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return F.linear(x, w.dequantize().to(device=x.device, dtype=x.dtype))
    out_dtype = x.dtype
    xf = x.to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)  # [B, out]
    if x.shape[0] == 0:
        return y.to(out_dtype)
    if not quant_available():
        tile = 1024
        for n0 in range(0, w.shape[0], tile):
            rows = np.arange(n0, min(n0 + tile, w.shape[0]))
            y[:, n0 : n0 + tile] = xf @ torch.from_numpy(_reference_rows(w, rows)).t()
        return y.to(out_dtype)
    fn = (_qmod.IMATMUL if _int_acts else _qmod.MATMUL)[w.fmt]
    xs, ys = xf.numpy(), y.numpy()
    nt = threads()
    for m0 in range(0, x.shape[0], QUANT_ROWS):
        xm, ym = xs[m0 : m0 + QUANT_ROWS], ys[m0 : m0 + QUANT_ROWS]

        def call(xm: np.ndarray = xm, ym: np.ndarray = ym) -> None:
            fn(xm, w.data, w.scale, ym, nt)

        _run(call)
    return y.to(out_dtype)


# (args, cos, sin, k_cache, v_cache, mask or None): one layer of :func:`fused_layers`
FusedCall = tuple[tuple[Any, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray, Any]
_layer_fns: dict[tuple[tuple[int, ...], bool, str], Any] = {}  # the compiled layer, by its codes


def fused_layers(x: np.ndarray, layers: Sequence[FusedCall], start: int, eps: float) -> None:
    """Consecutive one-call quantized layers over the block ``x`` [B, H] (float32, updated in
    place), each ``(args, cos [B, hd], sin [B, hd], k_cache, v_cache, mask [B, T] or None)``
    as numpy arrays: one lock and thread setting for the whole run of layers, so a decode step
    pays ~2 µs of dispatch per layer instead of ~25 µs of tensor-to-array glue (30 layers of
    the demo model: ~0.7 ms of a ~12 ms token on the 2-core Intel machine)."""
    assert _qmod is not None
    n = torch.get_num_threads()
    nt = _threads or n
    with _lock:
        if getattr(_local, "threads", None) != nt:
            _sync_threads(nt)
        for args, cos, sin, kc, vc, mask in layers:
            key = (args[7], _int_acts, _qmod.layers_dir)
            fn = _layer_fns.get(key)
            if fn is None:
                codes = tuple(c + 16 for c in args[7]) if _int_acts else args[7]
                fn = _layer_fns[key] = _qmod.entry(codes, _qmod.layers_dir)
            fn(
                x,
                *args[:7],
                args[8],
                cos,
                sin,
                kc,
                vc,
                start,
                _NO_MASK if mask is None else mask,
                mask is not None,
                args[9],
                eps,
                nt,
            )
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


_NO_MASK = np.ones((1, 1), dtype=np.bool_)
