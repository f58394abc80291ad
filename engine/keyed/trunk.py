"""A keyed trunk folder: the trunk layers of a public model in an organisation's secret basis.

``veil-trunk keyed-model prepare`` writes one (:func:`prepare_keyed_trunk`):

- ``trunk-00005.safetensors`` ...: one file per layer of [start, end), the tensors under their
  checkpoint names (``model.layers.5.self_attn.q_proj.weight`` ...), every norm weight folded
  into the matrices (the stored norms are all ones), and ``model.safetensors.index.json``, so
  :class:`engine.loading.WeightReader` reads the folder like any sharded checkpoint (and
  ``prepare`` holds one layer in memory at a time);
- ``keyed.json`` (:class:`KeyedInfo`): the format version, the public model's label, config
  fingerprint and weights fingerprint, the key's public id, the layer range, the noise and the
  keyed weights' own fingerprint.

The transform is derived with ``model_fp`` = the public model's weights fingerprint
(:func:`public_model_fp`), which a client computes from its own copy of the public model (or
reads from the signed manifest of the client part a server shipped), so both sides derive the
same rotation without ever exchanging it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.keyed.transform import (
    KeyedError,
    KeyedTransform,
    OrgKey,
    check_supported,
    derive,
    key_layers,
)
from engine.model import LayerWeights, layer_tensor_names

FORMAT_VERSION = 1
INDEX_FILE = "model.safetensors.index.json"


def layer_file(index: int) -> str:
    return f"trunk-{index:05d}.safetensors"


INFO_FILE = "keyed.json"

Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class KeyedInfo:
    """What ``keyed.json`` records (nothing in it is secret)."""

    model: str  # the public model's label
    config_fp: str
    model_fp: str  # the public model's weights fingerprint (the transform's ``model_fp``)
    key_id: str
    start: int
    end: int
    noise: float
    trunk_fp: str  # fingerprint of the keyed weights (the layer files)
    format: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def public_model_fp(reader: Any) -> str:
    """The public model's weights fingerprint: every tensor of the checkpoint (an organisation's
    private head/tail overlay is looked through: the trunk is the public one)."""
    from engine.loading import weights_fingerprint

    base = getattr(reader, "base", reader)
    return weights_fingerprint(base, base.names())


def client_model_fp(folder: Path, reader: Any) -> str:
    """``model_fp`` as a client computes it: a client part a server shipped records the whole
    model's fingerprint in its signed manifest (the part lacks the trunk tensors); a model file
    of its own is hashed."""
    from engine.delivery.fetch import part_info

    info = part_info(folder)
    fp = info.get("model_fp") if info else None
    if isinstance(fp, list) and len(fp) == 2:
        return str(fp[1])
    return public_model_fp(reader)


def read_info(folder: Path) -> KeyedInfo:
    """``folder``'s keyed.json, checked; one-line :class:`KeyedError` otherwise."""
    path = folder / INFO_FILE
    if not folder.is_dir():
        raise KeyedError(f"{folder} is not a keyed trunk folder (it does not exist)")
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise KeyedError(f"{folder} is not a keyed trunk folder (no {INFO_FILE})") from None
    except (OSError, ValueError) as exc:
        raise KeyedError(f"{path} is damaged ({type(exc).__name__})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT_VERSION:
        raise KeyedError(f"{path} is not a keyed trunk description this Veil reads")
    try:
        info = KeyedInfo(
            model=str(d["model"]),
            config_fp=str(d["config_fp"]),
            model_fp=str(d["model_fp"]),
            key_id=str(d["key_id"]),
            start=int(d["start"]),
            end=int(d["end"]),
            noise=float(d["noise"]),
            trunk_fp=str(d["trunk_fp"]),
        )
    except (KeyError, TypeError, ValueError):
        raise KeyedError(f"{path} is damaged (a field is missing or wrong)") from None
    if not 0 <= info.start < info.end:
        raise KeyedError(f"{path} is damaged (layer range [{info.start}, {info.end}))")
    return info


def layer_tensors(w: LayerWeights, config: ModelConfig, index: int) -> dict[str, torch.Tensor]:
    """A float layer back under its checkpoint names (the inverse of
    :meth:`LayerWeights.from_tensors` for the families a keyed trunk supports)."""
    nh, nkv, hd = config.n_heads, config.n_kv_heads, config.head_dim
    inter = config.intermediate_size
    mats = (w.wqkv, w.wo, w.wgu, w.wdown)
    if not all(isinstance(m, torch.Tensor) for m in mats):
        raise KeyedError("a keyed trunk is built from float weights")
    assert isinstance(w.wqkv, torch.Tensor) and isinstance(w.wgu, torch.Tensor)
    p = f"model.layers.{index}."
    qkv = w.wqkv
    out: dict[str, torch.Tensor] = {
        p + "input_layernorm.weight": w.ln1,
        p + "self_attn.q_proj.weight": qkv[: nh * hd],
        p + "self_attn.k_proj.weight": qkv[nh * hd : (nh + nkv) * hd],
        p + "self_attn.v_proj.weight": qkv[(nh + nkv) * hd :],
        p + "self_attn.o_proj.weight": w.wo,  # type: ignore[dict-item]
        p + "post_attention_layernorm.weight": w.ln2,
        p + "mlp.gate_proj.weight": w.wgu[:inter],
        p + "mlp.up_proj.weight": w.wgu[inter:],
        p + "mlp.down_proj.weight": w.wdown,  # type: ignore[dict-item]
    }
    if w.bqkv is not None:
        b = w.bqkv
        out[p + "self_attn.q_proj.bias"] = b[: nh * hd]
        out[p + "self_attn.k_proj.bias"] = b[nh * hd : (nh + nkv) * hd]
        out[p + "self_attn.v_proj.bias"] = b[(nh + nkv) * hd :]
    if w.q_norm is not None and w.k_norm is not None:
        out[p + "self_attn.q_norm.weight"] = w.q_norm
        out[p + "self_attn.k_norm.weight"] = w.k_norm
    want = set(layer_tensor_names(config, index))
    if set(out) != want:
        raise KeyedError("this model family's layers cannot be written as a keyed trunk")
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def trunk_fp(folder: Path, config: ModelConfig, start: int, end: int) -> str:
    """Fingerprint of the keyed weights in ``folder`` (as the trunk server checks them)."""
    from engine.errors import ModelLoadError
    from engine.loading import WeightReader, weights_fingerprint

    try:
        reader = WeightReader(folder)
        names = [n for i in range(start, end) for n in layer_tensor_names(config, i)]
        return weights_fingerprint(reader, names)
    except ModelLoadError as exc:
        raise KeyedError(f"the keyed trunk in {folder} is damaged: {exc}") from None


def prepare_keyed_trunk(
    spec: str,
    key: OrgKey,
    local_layers: int,
    out: Path,
    *,
    noise: float = 0.0,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
) -> KeyedInfo:
    """Key the public model ``spec``'s trunk layers [K, L - K) and write the folder ``out``
    (which must not exist or be empty)."""
    from safetensors.torch import save_file

    from engine.loading import WeightReader, load_config, model_label, resolve
    from engine.quant.load import client_reader
    from engine.split import read_layers

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KeyedError(f"{out} already exists and is not empty; choose a new folder")
    resolved = resolve(spec, progress)
    config = load_config(resolved.folder)
    check_supported(config)
    n = config.n_layers
    top = (n - 1) // 2
    if not 1 <= local_layers <= top:
        raise KeyedError(
            f"--local-layers must be between 1 and {top} for this model ({n} layers), "
            f"got {local_layers}"
        )
    if noise < 0:
        raise KeyedError("--noise must be >= 0")
    start, end = local_layers, n - local_layers
    base = WeightReader(resolved.folder)
    if progress is not None:
        progress("fingerprinting the public model", 0.0)
    model_fp = public_model_fp(base)
    reader = client_reader(base, resolved, config, "none")
    transform = derive(key, config, model_fp, start, end, noise)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for j, i in enumerate(range(start, end)):
        if progress is not None:
            progress("keying the trunk layers", j / (end - start))
        w = read_layers(reader, config, [i], torch.float32, "cpu")[i]
        one = replace(transform, start=i, end=i + 1, layers=[transform.layers[j]])
        kw = key_layers([w], config, one, key, model_fp)[0]  # (one layer in memory at a time)
        tensors = {k: v.to(dtype) for k, v in layer_tensors(kw, config, i).items()}
        save_file(tensors, str(out / layer_file(i)), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, layer_file(i)))
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if progress is not None:
        progress("keying the trunk layers", 1.0)
    info = KeyedInfo(
        model=model_label(resolved),
        config_fp=config.fingerprint(),
        model_fp=model_fp,
        key_id=key.key_id,
        start=start,
        end=end,
        noise=float(noise),
        trunk_fp=trunk_fp(out, config, start, end),
    )
    tmp = out / (INFO_FILE + ".tmp")
    tmp.write_text(info.to_json())
    os.replace(tmp, out / INFO_FILE)
    return info


def check_keyed_trunk(folder: Path, config: ModelConfig, model_fp: str) -> KeyedInfo:
    """The keyed trunk in ``folder``, checked against the public model it is served with
    (config and weights fingerprints) and against its own weights fingerprint."""
    info = read_info(folder)
    if info.config_fp != config.fingerprint() or info.model_fp != model_fp:
        raise KeyedError(
            f"the keyed trunk in {folder} was prepared for another model ({info.model}, "
            f"fingerprint {info.model_fp}); this one's is {model_fp}"
        )
    if info.end > config.n_layers:
        raise KeyedError(f"{folder / INFO_FILE} is damaged (layer range past the model)")
    got = trunk_fp(folder, config, info.start, info.end)
    if got != info.trunk_fp:
        raise KeyedError(
            f"the keyed trunk in {folder} is damaged: its weights do not match {INFO_FILE}"
        )
    return info


def load_keyed_trunk(
    folder: Path,
    config: ModelConfig,
    model_fp: str,
    start: int,
    end: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Any:
    """Layers [start, end) of the keyed trunk in ``folder`` as an in-process
    :class:`engine.split.LocalTrunk` (its ``key_id`` set: the runner rotates what it sends)."""
    from engine.loading import WeightReader
    from engine.model import LayerStack
    from engine.split import LocalTrunk, read_layers

    info = check_keyed_trunk(folder, config, model_fp)
    if not info.start <= start < end <= info.end:
        raise KeyedError(
            f"the keyed trunk holds layers [{info.start}, {info.end}); "
            f"layers [{start}, {end}) are outside it"
        )
    layers = read_layers(WeightReader(folder), config, range(start, end), dtype, device)
    stack = LayerStack(
        config, start, [layers[i] for i in range(start, end)], dtype=dtype, device=device
    )
    trunk = LocalTrunk(stack)
    trunk.key_id = info.key_id
    return trunk


def client_transform(key: OrgKey, config: ModelConfig, model_fp: str) -> KeyedTransform:
    """The transform a client needs: only the residual rotation ``q``, which every keyed layer
    of the model shares (so any trunk range a server serves works with it)."""
    return derive(key, config, model_fp, 0, 1)
