"""Organisation-private local weights: a safetensors file of head/tail layer tensors (checkpoint
names) that replace the public ones on the client. The trunk never sees them.

The file's metadata records the model it was made for (config fingerprint) and which layers it
replaces, so loading it against another model or a split that would send a private layer to
the server fails with one clear line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError, SplitError

FORMAT = "veil-private-weights/1"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def save_overlay(
    path: Path, tensors: dict[str, torch.Tensor], config: ModelConfig, info: dict[str, Any]
) -> None:
    from safetensors.torch import save_file

    layers = sorted({int(m.group(1)) for n in tensors if (m := _LAYER.match(n))})
    meta = {
        "format": FORMAT,
        "config_fingerprint": config.fingerprint(),
        "layers": ",".join(map(str, layers)),
        "info": json.dumps(info),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(path), metadata=meta)


def read_overlay(path: Path, config: ModelConfig) -> tuple[dict[str, torch.Tensor], set[int]]:
    """Tensors and the set of layer indices they replace; checked against ``config``."""
    from safetensors import safe_open

    if not path.is_file():
        raise ModelLoadError(f"private weights file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as exc:
        raise ModelLoadError(f"cannot read private weights {path}: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise ModelLoadError(f"{path} is not a Veil private-weights file")
    if meta.get("config_fingerprint") != config.fingerprint():
        raise ModelLoadError(f"private weights {path} were made for a different model")
    layers = {int(m.group(1)) for n in tensors if (m := _LAYER.match(n))}
    return tensors, layers


class OverlayReader:
    """A :class:`engine.loading.WeightReader` look-alike that serves overlay tensors first."""

    def __init__(self, base: Any, path: Path, config: ModelConfig) -> None:
        self.base = base
        self.folder = base.folder
        self.path = path
        self.tensors, self.private_layers = read_overlay(path, config)

    def names(self) -> list[str]:
        return sorted(set(self.base.names()) | set(self.tensors))

    def has(self, name: str) -> bool:
        return name in self.tensors or self.base.has(name)

    def read(
        self,
        names: Iterable[str],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> dict[str, torch.Tensor]:
        names = list(names)
        out = self.base.read([n for n in names if n not in self.tensors], dtype, device)
        for n in names:
            if n in self.tensors:
                out[n] = self.tensors[n].to(device=device, dtype=dtype)
        return out

    def check_plan(self, head: int, tail_start: int) -> None:
        """Every private layer must run locally under this split."""
        remote = sorted(i for i in self.private_layers if head <= i < tail_start)
        if remote:
            raise SplitError(
                f"this split would send private layer(s) {remote} to the server",
                hint="use more local layers, or privatize for this split",
            )

    @property
    def _where(self) -> dict[str, Path]:  # used by engine.loading.weights_fingerprint
        return dict(self.base._where)
