"""Readers that hand out weight matrices quantized, with the interface of
:class:`engine.loading.WeightReader` (``names``, ``has``, ``read(names, dtype, device)``).

* :class:`GGUFWeights`: a GGUF file's tensors under Hugging Face names. Matrices in a format
  the kernels know stay in their stored blocks (the LM head and embedding as read-only memory
  maps of the file); the llama family's q/k rows are put back in Hugging Face order (a row
  permutation: the blocks are not touched). Vectors (norms, biases) and matrices in other
  formats are returned as float tensors, dequantized by the gguf package.
* :class:`QuantizingReader`: wraps a float reader and quantizes its matrices to ``int8``
  (per channel) or ``int4`` (``q4_1`` groups of 32) on first use, cached on disk next to the
  GGUF conversions and memory-mapped from there afterwards.

:func:`client_reader` picks one for a ``--client-quant`` choice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import GEMMA_FAMILIES, ModelConfig
from engine.errors import ModelLoadError, ModelSpecError
from engine.quant import BLOCKS, CLIENT_QUANTS, QUANTIZERS, QuantWeight
from engine.quant.gguf import GGUFFile

log = logging.getLogger("veil.quant")

Tensor = torch.Tensor | QuantWeight

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER |= {"self_attn.q_norm.weight": "attn_q_norm.weight"}  # Qwen3, Gemma 3
_LAYER |= {"self_attn.k_norm.weight": "attn_k_norm.weight"}
# Gemma 2 and 3 (llama.cpp's names): their post_attention_layernorm norms the attention output, and
# the MLP's input norm is ffn_norm.
_GEMMA_LAYER = _LAYER | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _layer_names(family: str) -> dict[str, str]:
    return _GEMMA_LAYER if family in GEMMA_FAMILIES else _LAYER


def gguf_name(hf: str, family: str = "llama") -> str | None:
    """The GGUF tensor name for a Hugging Face checkpoint name of a model ``family``."""
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    m = _LAYER_RE.match(hf)
    names = _layer_names(family)
    if m and m.group(2) in names:
        return f"blk.{m.group(1)}.{names[m.group(2)]}"
    return None


def _unpermute_order(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's rotary permutation of q/k (as transformers does)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(2, 1).reshape(-1)


class GGUFWeights:
    """Tensors of one GGUF file under Hugging Face names; kernel formats stay quantized."""

    def __init__(self, path: Path, config: ModelConfig, *, keep_quantized: bool = True) -> None:
        self.path = path
        self.file = GGUFFile(path)
        self.config = config
        self.keep_quantized = keep_quantized
        self.permute = self.file.architecture == "llama"
        # llama.cpp stores Gemma's norm weights as 1 + w; transformers' convention (w) is given
        # out, and the model adds the 1 back (engine.model.norm_vector)
        self.norm_shift = config.norm_plus_one
        self.fallbacks: list[str] = []  # matrices held as float for want of a kernel

    def _gguf(self, name: str) -> str | None:
        return gguf_name(name, self.config.family)

    def names(self) -> list[str]:
        inv = {v: k for k, v in _GLOBAL.items()}
        out = []
        for t in self.file.tensors:
            if t in inv:
                out.append(inv[t])
                continue
            m = re.match(r"^blk\.(\d+)\.(.+)$", t)
            if m:
                for hf, g in _layer_names(self.config.family).items():
                    if g == m.group(2):
                        out.append(f"model.layers.{m.group(1)}.{hf}")
        return out

    def has(self, name: str) -> bool:
        g = self._gguf(name)
        return g is not None and g in self.file.tensors

    def kind(self, name: str) -> str:
        """Stored format of a tensor ("q4_k", "f32", ...)."""
        g = self._gguf(name)
        if g is None or g not in self.file.tensors:
            raise ModelLoadError(f"{self.path} lacks tensor {name}")
        return self.file.tensors[g].kind

    def _heads(self, name: str) -> int | None:
        if not self.permute:
            return None
        if ".self_attn.q_proj." in name:
            return self.config.n_heads
        if ".self_attn.k_proj." in name:
            return self.config.n_kv_heads
        return None

    def read_one(
        self, name: str, dtype: torch.dtype, device: torch.device | str, copy: bool = False
    ) -> Tensor:
        """One tensor; ``copy``: quantized rows read into memory, not viewed in the map."""
        g = self._gguf(name)
        if g is None or g not in self.file.tensors:
            raise ModelLoadError(f"{self.path} lacks tensor {name}")
        info = self.file.tensors[g]
        heads = self._heads(name)
        quantized = len(info.shape) == 2 and info.kind in BLOCKS and info.kind != "int8"
        if quantized and self.keep_quantized and str(device) == "cpu":
            if heads is None and not copy:  # used as stored: a view of the memory map
                return QuantWeight(info.kind, self.file.raw(g), info.shape[1])
            if heads is None:
                return QuantWeight(info.kind, self.file.copy(g), info.shape[1])
            w = QuantWeight(info.kind, self.file.copy(g), info.shape[1])
            return w.permute_rows(_unpermute_order(info.shape[0], heads))
        arr = self._float(g)
        if heads is not None:
            arr = arr[_unpermute_order(arr.shape[0], heads)]
        if self.norm_shift and g.endswith("norm.weight"):
            arr = arr - np.float32(1.0)
        if len(info.shape) == 2 and info.kind not in ("f32", "f16", "bf16"):
            self.fallbacks.append(info.kind)  # said once per load: fallback_summary
            log.debug("%s (%s) held as %s", name, info.kind, dtype)
        return torch.from_numpy(np.ascontiguousarray(arr)).to(device=device, dtype=dtype)

    def edge_rows(self, name: str) -> tuple[tuple[int, ...], list[torch.Tensor]]:
        """(shape, [first row, last row]) in Hugging Face order, float32, decoding only those
        rows (for trunk fingerprints: equal to a float checkpoint's rows bit for bit)."""
        g = self._gguf(name)
        if g is None or g not in self.file.tensors:
            raise ModelLoadError(f"{self.path} lacks tensor {name}")
        info = self.file.tensors[g]
        shape = info.shape
        if not shape or shape[0] == 0:
            return shape, []
        heads = self._heads(name)
        order = _unpermute_order(shape[0], heads) if heads is not None else None
        first, last = (int(order[0]), int(order[-1])) if order is not None else (0, shape[0] - 1)
        if len(shape) == 1:
            arr = self._float(g)
            if self.norm_shift and g.endswith("norm.weight"):
                arr = arr - np.float32(1.0)
            return shape, [torch.from_numpy(arr[[i]].copy()) for i in (first, last)]
        raw = self.file.raw(g)
        return shape, [
            torch.from_numpy(self._decode_rows(info.kind, raw[[i]], shape[1]))
            for i in (first, last)
        ]

    @staticmethod
    def _decode_rows(kind: str, rows: np.ndarray, k: int) -> np.ndarray:
        """Stored rows (uint8 [R, row bytes]) -> float32 [R, K], as the gguf package does."""
        if kind == "f32":
            return rows.view(np.float32).reshape(-1, k).copy()
        if kind == "f16":
            return rows.view(np.float16).astype(np.float32).reshape(-1, k)
        if kind == "bf16":
            bits = rows.view(np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(-1, k)
        import gguf

        qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
        return np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32).reshape(-1, k)

    def _float(self, g: str) -> np.ndarray:
        info = self.file.tensors[g]
        raw = self.file.copy(g)
        if info.kind == "f32":
            return raw.view(np.float32).reshape(info.shape)
        if info.kind == "f16":
            return raw.view(np.float16).astype(np.float32).reshape(info.shape)
        import gguf

        try:
            qtype = getattr(gguf.GGMLQuantizationType, info.kind.upper())
            out = gguf.quants.dequantize(raw.reshape(-1), qtype)
        except Exception as exc:
            raise ModelLoadError(
                f"cannot read GGUF file {self.path}: tensor {g} of type {info.kind}: {exc}"
            ) from exc
        return np.asarray(out, dtype=np.float32).reshape(info.shape)

    def read(
        self,
        names: Iterable[str],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> dict[str, Tensor]:
        names = list(names)
        fused = self._fused_parts(names)
        return {n: self.read_one(n, dtype, device, copy=n in fused) for n in names}

    def _fused_parts(self, names: list[str]) -> set[str]:
        """Matrices among ``names`` that a layer concatenates into one (q|k|v, gate|up, when
        stored in one format): read into memory, since the concatenation copies them anyway —
        through the map their pages would stay resident beside the copy (a trunk of
        Qwen2.5-1.5B held its gate|up weights twice, 0.4 GB)."""
        out: set[str] = set()
        for n in names:
            m = _LAYER_RE.match(n)
            if m is None or m.group(2) not in ("mlp.gate_proj.weight", "self_attn.q_proj.weight"):
                continue
            p = f"model.layers.{m.group(1)}."
            group = (
                [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
                if "gate" in n
                else [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
            )
            stored = all(x in names and self.has(x) for x in group)
            if stored and len({self.kind(x) for x in group}) == 1:
                out.update(group)
        return out


def _is_matrix_name(name: str) -> bool:
    return name.endswith(".weight") and ("_proj." in name or name in _GLOBAL) and "norm" not in name


class QuantizingReader:
    """Quantizes a float reader's matrices (``int8`` or ``int4``), cached in ``cache``."""

    def __init__(self, base: Any, quant: str, cache: Path | None) -> None:
        if quant not in QUANTIZERS:
            raise ValueError(f"unknown quantization {quant}")
        self.base = base
        self.quant = quant
        self.cache = cache

    def names(self) -> list[str]:
        return list(self.base.names())

    def has(self, name: str) -> bool:
        return bool(self.base.has(name))

    def _cached(self, name: str) -> QuantWeight | None:
        if self.cache is None:
            return None
        meta = self.cache / f"{name}.json"
        if not meta.is_file():
            return None
        try:
            m = json.loads(meta.read_text())
            data = np.load(self.cache / f"{name}.data.npy", mmap_mode="r")
            scale = np.load(self.cache / f"{name}.scale.npy")
            return QuantWeight(m["fmt"], data, int(m["k"]), scale)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("ignoring a damaged quantization cache entry %s: %s", name, exc)
            return None

    def _store(self, name: str, w: QuantWeight) -> QuantWeight:
        if self.cache is None:
            return w
        try:
            self.cache.mkdir(parents=True, exist_ok=True)
            for suffix, arr in ((".data.npy", w.data), (".scale.npy", w.scale)):
                fd, tmp = tempfile.mkstemp(dir=self.cache, suffix=".tmp")
                with os.fdopen(fd, "wb") as f:
                    np.save(f, np.ascontiguousarray(arr))
                os.replace(tmp, self.cache / f"{name}{suffix}")
            (self.cache / f"{name}.json").write_text(json.dumps({"fmt": w.fmt, "k": w.k}))
        except OSError as exc:
            log.warning("could not cache quantized %s: %s", name, exc)
            return w
        return self._cached(name) or w  # memory-mapped from the cache from now on

    def read(
        self,
        names: Iterable[str],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> dict[str, Tensor]:
        names = list(names)
        out: dict[str, Tensor] = {}
        floats = [n for n in names if not _is_matrix_name(n) or str(device) != "cpu"]
        out.update(self.base.read(floats, dtype, device))
        for n in names:
            if n in out:
                continue
            w = self._cached(n)
            if w is None:
                t = self.base.read([n], torch.float32, "cpu")[n]
                if t.shape[1] % 32:  # no kernel for this width: keep it float
                    out[n] = t.to(dtype=dtype)
                    continue
                w = self._store(n, QUANTIZERS[self.quant](t))
            out[n] = w
        return out


def gguf_weights_of(reader: Any) -> GGUFWeights | None:
    """The GGUF reader behind a reader (itself, a float reader's, a quantizing reader's)."""
    for r in (reader, getattr(reader, "base", None)):
        if isinstance(r, GGUFWeights):
            return r
        g = getattr(r, "gguf", None)
        if isinstance(g, GGUFWeights):
            return g
    return None


def fallback_summary(kinds: list[str], dtype: torch.dtype, cause: str) -> str:
    """One line for the quantized matrices a load held as float: how many, their formats, the
    dtype they became and why (instead of a line per matrix)."""
    counts: dict[str, int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    what = ", ".join(f"{n} {k}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    name = str(dtype).removeprefix("torch.")
    return f"{len(kinds)} quantized matrices of the file ({what}) are held as {name}: {cause}"


def gguf_source(resolved: Any) -> Path | None:
    src = Path(resolved.source)
    return src if src.suffix.lower() == ".gguf" and src.is_file() else None


def _cache_key(resolved: Any, quant: str) -> str:
    """Identifies a float checkpoint cheaply: the GGUF digest its conversion folder is named by,
    else the safetensors files' paths, sizes and modification times."""
    from engine.loading import cache_root

    folder = Path(resolved.folder)
    h = hashlib.sha256(f"veil-quant-1|{quant}".encode())
    if folder.parent == cache_root() / "models":
        h.update(folder.name.encode())
    else:
        for f in sorted(folder.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def resolve_quant(quant: str, resolved: Any, private: bool = False) -> str:
    """What ``--client-quant`` means for this model: ``auto`` keeps a GGUF file's own formats
    ("gguf") and is ``none`` for float checkpoints (and for organisation-private layers)."""
    q = (quant or "auto").lower()
    if q not in CLIENT_QUANTS:
        raise ModelSpecError(
            f"unknown client quantization '{quant}'", hint="use auto, none, int8 or int4"
        )
    if q == "auto":
        return "gguf" if gguf_source(resolved) is not None and not private else "none"
    return q


def client_reader(float_reader: Any, resolved: Any, config: ModelConfig, quant: str) -> Any:
    """The reader a client (or trunk) loads its tensors through for a resolved ``quant``."""
    from engine.loading import cache_root

    if quant == "none":
        return float_reader
    if quant == "gguf":
        src = gguf_source(resolved)
        if src is None:
            raise ModelSpecError("the GGUF's own quantization needs a .gguf model")
        return GGUFWeights(src, config)
    private = type(float_reader).__name__ == "OverlayReader"
    cache = None if private else cache_root() / "quant" / _cache_key(resolved, quant)
    return QuantizingReader(float_reader, quant, cache)
