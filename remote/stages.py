"""Layers across devices in one box: the trunk's layers as contiguous stages, one per device.

``veil-trunk serve --devices cuda:0,cuda:1`` splits the served layers [lo, hi) into one stage per
device — by free memory, or as ``--stage-layers 14,14`` says. Each stage holds its layers'
weights, and every session's KV cache for those layers, on its device; hidden states move from
stage to stage. ``--devices cpu,cpu`` runs the same code on one CPU (that is how the tests check
that a split trunk gives the same numbers as one device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.loading import WeightReader
from engine.model import LayerWeights
from engine.split import read_layers


@dataclass
class Stage:
    """Layers [lo, hi) of the model on one device."""

    device: torch.device
    lo: int
    hi: int
    layers: dict[int, LayerWeights]

    def covers(self, start: int, end: int) -> tuple[int, int] | None:
        """The part of a session's range [start, end) this stage runs, or None."""
        a, b = max(start, self.lo), min(end, self.hi)
        return (a, b) if a < b else None


def parse_devices(spec: str) -> list[torch.device]:
    """``cpu``, ``cuda``, ``cuda:0,cuda:1`` -> devices; ValueError with a clear message."""
    names = [s.strip() for s in spec.split(",")]
    if not names or any(not n for n in names):
        raise ValueError(f"--devices needs a comma-separated list like cuda:0,cuda:1, not {spec!r}")
    out = []
    for n in names:
        try:
            d = torch.device(n)
        except (RuntimeError, ValueError):
            raise ValueError(f"unknown device {n!r} (use cpu, cuda or cuda:N)") from None
        if d.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {n!r} (use cpu, cuda or cuda:N)")
        if d.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {n!r}: CUDA is not available on this machine")
            if d.index is not None and d.index >= torch.cuda.device_count():
                count = torch.cuda.device_count()
                raise ValueError(f"device {n!r}: this machine has {count} GPU(s)")
        out.append(d)
    return out


def _free_bytes(d: torch.device) -> int:
    if d.type == "cuda":
        free, _ = torch.cuda.mem_get_info(d)
        return int(free)
    return 1  # CPUs share one memory: equal shares


def split_layers(
    lo: int, hi: int, devices: Sequence[torch.device], counts: Sequence[int] | None = None
) -> list[tuple[torch.device, int, int]]:
    """Contiguous [a, b) per device covering [lo, hi): ``counts`` layers each when given, else
    in proportion to each device's free memory (equal shares on CPU), at least one each."""
    n = hi - lo
    k = len(devices)
    if k < 1:
        raise ValueError("no devices")
    if k > n:
        raise ValueError(f"{k} devices but only {n} trunk layers to split")
    if counts is not None:
        if len(counts) != k:
            raise ValueError(f"--stage-layers has {len(counts)} numbers for {k} devices")
        if any(c < 1 for c in counts) or sum(counts) != n:
            raise ValueError(
                f"--stage-layers must be positive and add up to the {n} served layers [{lo}, {hi})"
            )
        sizes = list(counts)
    else:
        free = [_free_bytes(d) for d in devices]
        total = sum(free)
        sizes = [max(1, round(n * f / total)) for f in free]
        while sum(sizes) > n:  # rounding: take from the biggest
            sizes[sizes.index(max(sizes))] -= 1
        while sum(sizes) < n:
            sizes[free.index(max(free))] += 1
    out = []
    a = lo
    for d, c in zip(devices, sizes, strict=True):
        out.append((d, a, a + c))
        a += c
    return out


def load_stages(
    reader: WeightReader,
    config: ModelConfig,
    plan: Sequence[tuple[torch.device, int, int]],
    dtype: torch.dtype,
) -> list[Stage]:
    """Read each stage's layers onto its device."""
    return [Stage(d, a, b, read_layers(reader, config, range(a, b), dtype, d)) for d, a, b in plan]
