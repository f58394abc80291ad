"""The arguments of the one-call quantized decoder layer (:func:`engine.kernels.fused_layers`,
compiled in :mod:`engine.kernels._fused_layer`), packed once per layer from its weights: the
norms as float32 arrays, the products' quantized blocks and scales, their format codes (which
choose the compiled layer) and the attention dimensions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.quant import QuantWeight, Stacked

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.model import LayerWeights


def fused_args(w: LayerWeights, cfg: ModelConfig) -> tuple[Any, ...] | None:
    """Arguments of the one-call quantized layer (engine.kernels.fused_layers), or None when a
    matrix is not quantized (float) or the family's layer is not the Llama one it computes
    (then the layer runs piece by piece, each product still through the quantized kernels).
    A q|k|v or gate|up stored in several formats (``Stacked``, as in ``*-Q4_K_M.gguf`` files)
    is passed as its parts: seven products instead of four."""
    if not cfg.plain_layers:
        return None
    from engine.kernels._ir import CODES

    def parts(m: Any, n: int) -> list[QuantWeight] | None:
        if isinstance(m, QuantWeight):
            return [m]
        if isinstance(m, Stacked) and len(m.parts) == n:
            ps = [p for p in m.parts if isinstance(p, QuantWeight)]
            return ps if len(ps) == n else None
        return None

    qkv, gu = parts(w.wqkv, 3), parts(w.wgu, 2)
    if qkv is None or gu is None or not isinstance(w.wo, QuantWeight):
        return None
    if not isinstance(w.wdown, QuantWeight):
        return None
    if len(qkv) == 1 and len(gu) == 1:
        mats: list[QuantWeight] = [qkv[0], w.wo, gu[0], w.wdown]
        qkv_w: Any = qkv[0].data
        gu_w: Any = gu[0].data
    else:  # several formats: every part on its own (a single-format one split into rows)
        if len(qkv) == 1:
            qkv = _split_rows(qkv[0], [cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads], cfg.head_dim)
        if len(gu) == 1:
            gu = _split_rows(gu[0], [1, 1], cfg.intermediate_size)
        mats = [*qkv, w.wo, *gu, w.wdown]
        qkv_w = tuple(p.data for p in qkv)
        gu_w = tuple(p.data for p in gu)

    def vec(t: torch.Tensor) -> np.ndarray:
        return t.detach().to(torch.float32).contiguous().numpy()

    bias = vec(w.bqkv) if w.bqkv is not None else np.empty(0, dtype=np.float32)
    dims = np.array([cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size])
    fmts = tuple(CODES[m.fmt] for m in mats)  # the compiled layer is chosen by these
    scales = tuple(m.scale for m in mats)
    return (vec(w.ln1), qkv_w, bias, w.wo.data, vec(w.ln2), gu_w, w.wdown.data, fmts, scales, dims)


def _split_rows(w: QuantWeight, counts: Sequence[int], unit: int) -> list[QuantWeight]:
    """``w``'s output rows cut into consecutive parts of ``count * unit`` rows each."""
    out, r = [], 0
    for c in counts:
        n = c * unit
        out.append(QuantWeight(w.fmt, w.data[r : r + n], w.k, w.scale[r : r + n]))
        r += n
    return out
