"""Small-batch linear layers for CPU decoding: ``y = x @ w.T`` for a few rows of ``x``.

Decoding multiplies a handful of rows (one token, or a draft tree of 2-64 nodes) by every weight
matrix. BLAS libraries are tuned for big matrices: on the CPUs we measured, MKL's GEMM for 4-16
rows costs 3-4x its single-row GEMV, although the weights — which dominate the memory traffic —
are the same. This module streams each weight row once and computes its dot products with four
input rows at a time (a numba kernel, vectorized by LLVM, parallel over tiles of weight rows),
so a block of up to ~4 rows costs about what one row costs and a 16-node tree about 3x.

Batch invariance: every output element is computed by the same code (rows are taken four at a
time; a short last group repeats its last row and discards the copies), so a row's result does not
depend on how many other rows share the call. A token verified inside a tree therefore gets
bit-identical projections to the same token decoded alone.

Falls back to ``torch.nn.functional.linear`` when numba is missing or fails to compile, for
non-float32 or non-CPU tensors, when autograd is recording, and for blocks above
:data:`MAX_ROWS` rows (prefill), where BLAS is efficient.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_ROWS = 64  # blocks up to this many rows use the kernel; bigger ones (prefill) use BLAS

_lock = threading.Lock()
_kernel: Callable[..., None] | None = None
_reason = ""  # why the kernel is unavailable, once a build has failed
_enabled = os.environ.get("VEIL_KERNELS", "1").strip().lower() not in ("0", "off", "false", "no")
_threads: int | None = None  # kernel threads; None: as many as torch uses


def _cache_dir() -> str:
    from platformdirs import user_cache_dir

    return os.path.join(user_cache_dir("veil", appauthor=False), "numba")


def _build() -> Callable[..., None]:
    """Compile (or load from numba's on-disk cache) the kernel. Raises on any failure."""
    os.environ.setdefault("NUMBA_CACHE_DIR", _cache_dir())
    from engine.kernels._small_rows import rows_times_weight

    kernel: Callable[..., None] = rows_times_weight
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
                    log.info("small-batch kernel unavailable, using BLAS: %s", _reason)
                finally:
                    # Starting numba's OpenMP pool sets the process's OpenMP thread count to the
                    # pool size, and torch reads that count: without this, a process told to use
                    # one thread (the bench's client and trunk, `veil-trunk --threads 1`) ran its
                    # torch ops, and then the kernel, on every core after the first product.
                    _restore_threads(threads)
    return _kernel is not None


def _restore_threads(n: int) -> None:
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def status() -> str:
    """One line for diagnostics: which path small blocks take."""
    if not _enabled:
        return "BLAS (kernels disabled by VEIL_KERNELS=0)"
    if available():
        return "numba small-batch kernel"
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


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T``: x [B, in], w [out, in] -> [B, out]."""
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
