"""Batch-invariant float32 linear layers for the batching trunk worker, at every row count.

The trunk worker concatenates the rows of many sessions' steps and runs each projection as one
matrix product. A session's outputs must not depend on who shares its batch, so a row's result
must be the same whether the call has 4 rows or 256. BLAS does not promise that: MKL chooses its
blocking (and for a single row, a different routine) by the matrix sizes, so the same row rounds
differently in different batches. The client's float32 kernel (:mod:`engine.kernels._f32_ir`)
fixes the order of every operation of each output element, whatever the block it is computed
in, so the worker uses the same kernel at every row count (prefill chunks included); see
``docs/performance.md`` ("Continuous batching").

:func:`available` compiles the kernel (or loads it from numba's cache), checks it against
torch, and checks on this CPU that a row's bits do not change with the row count or the row's
position; if any of that fails, :func:`linear` falls back to ``torch.nn.functional.linear`` and
:func:`status` says why (the worker then reports that batches are not bit-identical).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_kernel: Callable[..., None] | None = None
_reason = ""  # why the kernel is unavailable, once a build or check has failed


def _build() -> Callable[..., None]:
    """Compile or load the kernel, then check it; raises on any failure (numba's cache folder
    is set when :mod:`engine.kernels` is imported)."""
    from engine.kernels._f32_ir import f32_times_weight

    kernel: Callable[..., None] = f32_times_weight
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 70, generator=g)  # [N, K]: an odd N exercises a short last tile
    x = torch.randn(13, 70, generator=g)  # [M, K]
    y = torch.empty(13, 37)
    kernel(x.numpy(), w.numpy(), y.numpy())
    if not torch.allclose(y, x @ w.t(), atol=1e-4, rtol=1e-4):
        raise RuntimeError("the compiled batch kernel disagrees with torch")
    problem = self_check(kernel)
    if problem:
        raise RuntimeError(problem)
    return kernel


def self_check(kernel: Callable[..., None]) -> str:
    """'' when every row gets the same bits alone and inside bigger calls at every offset
    (the property the batching worker relies on), else what differed."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(67, 165, generator=g)  # [N, K]: K % 16 != 0 exercises the tail
    x = torch.randn(23, 165, generator=g)  # [M, K]

    def run(rows: torch.Tensor) -> torch.Tensor:
        y = torch.empty(rows.shape[0], w.shape[0])
        kernel(rows.contiguous().numpy(), w.numpy(), y.numpy())
        return y

    alone = torch.cat([run(x[i : i + 1]) for i in range(x.shape[0])])  # [M, N]
    for size in (2, 3, 4, 5, 8, 9, 23):
        for start in range(0, x.shape[0] - size + 1, 3):
            if not torch.equal(run(x[start : start + size]), alone[start : start + size]):
                return f"the batch kernel is not batch-invariant here ({size} rows at {start})"
    return ""


def available() -> bool:
    """Whether the invariant kernel is usable (compiles and checks it on first call)."""
    global _kernel, _reason
    from engine import kernels as K

    if not K._enabled:
        return False
    if _kernel is None and not _reason:
        with K._lock:
            if _kernel is None and not _reason:
                threads = torch.get_num_threads()
                try:
                    _kernel = _build()
                except Exception as exc:  # numba missing, no LLVM target, a failed check...
                    _reason = f"{type(exc).__name__}: {exc}"
                    log.warning("batch-invariant kernel unavailable, using BLAS: %s", _reason)
                finally:
                    K._restore_threads(threads)  # see engine.kernels.available()
    return _kernel is not None


def status() -> str:
    """One line: which path the batching worker's CPU float32 products take."""
    from engine import kernels as K

    if not K._enabled:
        return "BLAS (kernels disabled by VEIL_KERNELS=0): batches are not bit-identical"
    if available():
        return "numba batch-invariant kernel"
    return f"BLAS ({_reason}): batches are not bit-identical"


def invariant(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear` on tensors like these is batch-invariant."""
    return (
        x.dtype == torch.float32
        and w.dtype == torch.float32
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and available()
    )


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` (x [M, in], w [out, in] -> [M, out]), batch-invariant on CPU float32."""
    from engine import kernels as K

    if (
        x.dim() != 2
        or x.shape[0] == 0
        or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        or not w.is_contiguous()
        or not invariant(x, w)
    ):
        return F.linear(x, w)
    assert _kernel is not None
    xc = x.contiguous()
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)  # [M, out]
    n = torch.get_num_threads()
    with K._lock:  # numba's fallback threading layer is not re-entrant
        K._sync_threads(K.threads())
        _kernel(xc.numpy(), w.numpy(), y.numpy())
    K._restore_threads(n)
    return y
