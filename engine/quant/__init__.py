"""Quantized weights kept quantized in memory.

A :class:`QuantWeight` is a weight matrix ``[N, K]`` stored as its quantized rows: a GGUF
tensor's own blocks (``q8_0``, ``q6_k``, ``q5_k``, ``q5_1``, ``q5_0``, ``q4_k``, ``q4_1``,
``q4_0``), or Veil's per-channel
``int8`` (int8 values and one float32 scale per output row). The matrix products in
:mod:`engine.kernels` decode blocks into registers as they go; nothing holds a float copy.

``--client-quant int4`` quantizes float checkpoints into the ``q4_1`` layout (groups of 32
with a float16 scale and minimum, the GGUF format), so GGUF files and quantized safetensors
share one kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# values per block, bytes per block (int8: one value, one byte; its scales live apart)
BLOCKS: dict[str, tuple[int, int]] = {
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q4_k": (256, 144),
    "q6_k": (256, 210),
    "int8": (1, 1),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q5_k": (256, 176),
}
FORMATS = tuple(BLOCKS)
CLIENT_QUANTS = ("auto", "none", "int8", "int4")


def row_bytes(fmt: str, k: int) -> int:
    per, nbytes = BLOCKS[fmt]
    return k // per * nbytes


def bits_per_weight(fmt: str) -> float:
    """Storage per weight, scales included (int8: its per-row scale is negligible)."""
    per, nbytes = BLOCKS[fmt]
    return 8.0 * nbytes / per


@dataclass(eq=False)
class QuantWeight:
    """A weight matrix [N, K] in quantized rows ``data`` (uint8 [N, row bytes], possibly a
    read-only memory map of the model file)."""

    fmt: str
    data: np.ndarray  # uint8 [N, row_bytes(fmt, K)]
    k: int
    scale: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float32))  # int8: [N]

    def __post_init__(self) -> None:
        if self.fmt not in BLOCKS:
            raise ValueError(f"unknown quantized format {self.fmt}")
        if self.data.dtype != np.uint8 or self.data.ndim != 2:
            raise ValueError("quantized rows must be a 2-D uint8 array")
        if self.k % 32 or self.data.shape[1] != row_bytes(self.fmt, self.k):
            raise ValueError(f"{self.fmt} rows of {self.data.shape[1]} bytes do not hold {self.k}")
        if self.fmt == "int8":
            if self.scale.shape != (self.data.shape[0],):
                raise ValueError("int8 weights need one scale per row")
        else:
            # the kernels take a scale per row for every format; the block formats ignore it
            self.scale = np.ones(self.data.shape[0], dtype=np.float32)
        self.scale = np.ascontiguousarray(self.scale, dtype=np.float32)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.k)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its products are computed in."""
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def nbytes(self) -> int:
        """Bytes held: the quantized rows (and int8's scales)."""
        return int(self.data.nbytes) + (int(self.scale.nbytes) if self.fmt == "int8" else 0)

    def rows(self, index: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        """Rows ``index`` dequantized: float32 [len(index), K]."""
        from engine.kernels import dequantize_rows

        idx = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index, np.int64)
        return dequantize_rows(self, idx.reshape(-1)).reshape(*idx.shape, self.k)

    def __getitem__(self, index: int | Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Row lookup like a float tensor's (the drafter reads embedding rows this way)."""
        if isinstance(index, int | np.integer):
            return self.rows([int(index)])[0]
        return self.rows(index)

    def dequantize(self) -> torch.Tensor:
        """The whole matrix in float32 (tests and the reference path only)."""
        return self.rows(np.arange(self.shape[0]))

    @staticmethod
    def concat(parts: Sequence[QuantWeight]) -> QuantWeight:
        """Stack matrices with the same format and input size along the output dimension
        (the fused q|k|v and gate|up projections)."""
        fmt, k = parts[0].fmt, parts[0].k
        if any(p.fmt != fmt or p.k != k for p in parts):
            raise ValueError("only matrices of one format and input size can be fused")
        return QuantWeight(
            fmt,
            np.concatenate([p.data for p in parts]),
            k,
            np.concatenate([p.scale for p in parts]),
        )

    def permute_rows(self, order: np.ndarray) -> QuantWeight:
        return QuantWeight(
            self.fmt, np.ascontiguousarray(self.data[order]), self.k, self.scale[order]
        )


@dataclass(eq=False)
class Stacked:
    """Matrices multiplied side by side (a fused projection whose parts are stored in
    different formats, as in ``*-Q4_K_M.gguf`` files): outputs concatenated."""

    parts: list[torch.Tensor | QuantWeight]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(int(p.shape[0]) for p in self.parts), int(self.parts[0].shape[1]))

    def nbytes(self) -> int:
        return sum(weight_bytes(p) for p in self.parts)


def weight_bytes(w: torch.Tensor | QuantWeight | Stacked) -> int:
    """Bytes a weight holds in memory, whatever its kind."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.nbytes()


def fuse(parts: Sequence[torch.Tensor | QuantWeight]) -> torch.Tensor | QuantWeight | Stacked:
    """One matrix for projections that share their input (q|k|v, gate|up)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts)).contiguous()  # type: ignore[arg-type]
    if all(isinstance(p, QuantWeight) for p in parts) and len({p.fmt for p in parts}) == 1:  # type: ignore[union-attr]
        return QuantWeight.concat(parts)  # type: ignore[arg-type]
    return Stacked(list(parts))


def quantize_int8(w: torch.Tensor) -> QuantWeight:
    """Per-channel symmetric int8: one scale per output row (max |w| / 127)."""
    wf = w.detach().to(torch.float32)
    amax = wf.abs().amax(dim=1).clamp_min(1e-12)  # [N]
    scale = amax / 127.0
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # [N, K]
    return QuantWeight("int8", q.numpy().view(np.uint8), w.shape[1], scale.numpy())


def quantize_int4(w: torch.Tensor) -> QuantWeight:
    """4-bit groups of 32 with a scale and a minimum (the GGUF ``q4_1`` layout): per group,
    d = (max - min) / 15 and m = min, both stored as float16."""
    wf = w.detach().to(torch.float32)
    n, k = wf.shape
    g = wf.reshape(n, k // 32, 32)
    lo = g.amin(-1, keepdim=True)
    hi = g.amax(-1, keepdim=True)
    d = ((hi - lo) / 15.0).to(torch.float16)
    m = lo.to(torch.float16)
    # quantize against the float16 values actually stored
    df, mf = d.float(), m.float()
    inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
    q = torch.round((g - mf) * inv).clamp_(0, 15).to(torch.uint8)  # [N, K/32, 32]
    packed = q[..., :16] | (q[..., 16:] << 4)  # [N, K/32, 16]: value j low, j + 16 high
    blocks = torch.cat(
        [
            d.view(torch.uint8).reshape(n, k // 32, 2),
            m.view(torch.uint8).reshape(n, k // 32, 2),
            packed,
        ],
        dim=-1,
    )  # [N, K/32, 20]
    return QuantWeight("q4_1", blocks.reshape(n, -1).numpy(), k)


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
