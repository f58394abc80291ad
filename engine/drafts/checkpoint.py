"""`veil train-draft`'s training checkpoint: one safetensors file, no pickle.

A work folder may come from anywhere (a copied cache, a shared disk), so ``--resume`` must not be
able to run code from it. The checkpoint is ``checkpoint.safetensors``: the head's tensors
(``net/...``), the optimizer's tensors (``opt/...``), the random-number state (``rng/...``) and the
draft vocabulary (``vocab``), with everything else — step count, time spent, the optimizer's
numbers and settings — as JSON in the file's metadata, where each tensor is a ``{"t": name}``
reference. Reading it parses a header and copies bytes; nothing is unpickled.

Veil before this format wrote ``checkpoint.pt`` (a pickle): it is never loaded, and ``--resume``
says how to go on without it (the recorded data is kept).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.errors import VeilError

FILE = "checkpoint.safetensors"
OLD_FILE = "checkpoint.pt"  # a pickle, from Veil before this format: never loaded
FORMAT = "veil-train-checkpoint-1"


class CheckpointError(VeilError):
    """A checkpoint that cannot be resumed from (one line for the user)."""


def refuse_old(work: Path) -> None:
    """CheckpointError when ``work`` holds a pickled checkpoint of an older Veil."""
    old = work / OLD_FILE
    if old.exists():
        raise CheckpointError(
            f"{old} is a checkpoint of an older Veil, which is not loaded because that format "
            "can run code; delete it and run again with --resume to restart training on the "
            "data already recorded (or without --resume to start over)"
        )


def _encode(obj: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` as JSON, its tensors moved to ``tensors`` (dict keys and tuples kept exactly)."""
    if isinstance(obj, torch.Tensor):
        tensors[name] = obj.detach().cpu().contiguous().clone()
        return {"t": name}
    if isinstance(obj, dict):
        if not all(type(k) in (int, str) for k in obj):
            raise TypeError(f"{name}: only int and str keys can be stored")
        return {"d": [[k, _encode(v, f"{name}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"u": [_encode(v, f"{name}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{name}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    raise TypeError(f"{name}: a {type(obj).__name__} cannot be stored in a checkpoint")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"t"}:
            return tensors[obj["t"]]
        if set(obj) == {"d"}:
            return {k: _decode(v, tensors) for k, v in obj["d"]}
        if set(obj) == {"u"}:
            return tuple(_decode(v, tensors) for v in obj["u"])
        raise ValueError("unknown entry")
    return obj


def save(work: Path, net: torch.nn.Module, state: dict[str, Any], vocab: torch.Tensor) -> Path:
    """Write the checkpoint atomically (a reader sees the old file or the new one)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {"vocab": vocab.detach().cpu().contiguous().clone()}
    for k, v in net.state_dict().items():
        tensors[f"net/{k}"] = v.detach().cpu().contiguous().clone()
    meta = {"format": FORMAT, "state": json.dumps(_encode(state, "opt", tensors))}
    path = work / FILE
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def load(work: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], torch.Tensor] | None:
    """(the head's state dict, the training state, the vocabulary) from ``work``'s checkpoint;
    None when there is none. CheckpointError for a file that is not one."""
    from safetensors import safe_open

    path = work / FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - no __iter__
        if meta.get("format") != FORMAT:
            raise ValueError("not a training checkpoint")
        state = _decode(json.loads(meta["state"]), tensors)
        vocab = tensors["vocab"]
        if not isinstance(state, dict):
            raise ValueError("no training state")
    except Exception as exc:  # safetensors, json, a missing or foreign tensor: one line
        raise CheckpointError(
            f"{path} is damaged ({type(exc).__name__}: {' '.join(str(exc).split())[:120]}); "
            "delete it and run "
            "again with --resume to restart training on the data already recorded"
        ) from None
    net = {k[len("net/") :]: v for k, v in tensors.items() if k.startswith("net/")}
    return net, state, vocab
