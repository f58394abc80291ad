"""Bytes of weights a client holds for a split, computed without loading it: what the privacy
slider shows as "memory needed here". Equal to :meth:`engine.split.ClientModel.local_param_bytes`
of the client that would be loaded (tests check it): quantized matrices count their stored
blocks, float tensors their dtype's bytes."""

from __future__ import annotations

import functools
from pathlib import Path

from engine.config import ModelConfig
from engine.quant import BLOCKS, row_bytes
from engine.quant.load import gguf_name, gguf_source, resolve_quant

_FLOAT_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def _layer_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    out: list[tuple[str, tuple[int, ...]]] = [
        ("input_layernorm.weight", (h,)),
        ("self_attn.q_proj.weight", (cfg.n_heads * hd, h)),
        ("self_attn.k_proj.weight", (cfg.n_kv_heads * hd, h)),
        ("self_attn.v_proj.weight", (cfg.n_kv_heads * hd, h)),
        ("self_attn.o_proj.weight", (h, cfg.n_heads * hd)),
        ("post_attention_layernorm.weight", (h,)),
        ("mlp.gate_proj.weight", (i, h)),
        ("mlp.up_proj.weight", (i, h)),
        ("mlp.down_proj.weight", (h, i)),
    ]
    if cfg.attn_bias:
        out += [
            ("self_attn.q_proj.bias", (cfg.n_heads * hd,)),
            ("self_attn.k_proj.bias", (cfg.n_kv_heads * hd,)),
            ("self_attn.v_proj.bias", (cfg.n_kv_heads * hd,)),
        ]
    if cfg.qk_norm:
        out += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
    if cfg.sandwich_norms:
        out += [
            ("pre_feedforward_layernorm.weight", (h,)),
            ("post_feedforward_layernorm.weight", (h,)),
        ]
    return out


def client_tensors(
    cfg: ModelConfig, k: int, has_lm_head: bool
) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor a client with ``k`` layers at each end holds."""
    names: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)),
        ("model.norm.weight", (cfg.hidden_size,)),
    ]
    if has_lm_head:
        names.append(("lm_head.weight", (cfg.vocab_size, cfg.hidden_size)))
    n = cfg.n_layers
    local = sorted(set(range(min(k, n))) | set(range(max(n - k, 0), n)))
    for li in local:
        names += [(f"model.layers.{li}.{t}", s) for t, s in _layer_shapes(cfg)]
    return names


@functools.lru_cache(maxsize=8)
def _gguf_kinds(path: str, mtime_ns: int) -> dict[str, str]:
    from engine.quant.gguf import GGUFFile

    f = GGUFFile(path)
    try:
        return {name: t.kind for name, t in f.tensors.items()}
    finally:
        f.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def client_weight_bytes(
    resolved: object, cfg: ModelConfig, k: int, quant: str = "auto", dtype: str = "float32"
) -> int:
    """Bytes of weights on this computer for ``k`` local layers at each end, as the client
    loaded with ``client_quant=quant`` and ``dtype`` would hold them."""
    fb = _FLOAT_BYTES.get(dtype.lower(), 4)
    q = resolve_quant(quant, resolved)
    if q == "gguf":
        src = gguf_source(resolved)
        assert src is not None
        kinds = _gguf_kinds(str(src), Path(src).stat().st_mtime_ns)
        has_head = "output.weight" in kinds and not cfg.tie_word_embeddings
        total = 0
        for name, shape in client_tensors(cfg, k, has_head):
            kind = kinds.get(gguf_name(name, cfg.family) or "", "f32")
            if len(shape) == 2 and kind in BLOCKS and kind != "int8":
                total += shape[0] * row_bytes(kind, shape[1])
            else:
                total += _numel(shape) * fb
        return total
    has_head = not cfg.tie_word_embeddings
    if has_head:  # a float checkpoint may still lack the head (then it is tied)
        from engine.loading import WeightReader

        has_head = WeightReader(Path(resolved.folder)).has("lm_head.weight")  # type: ignore[attr-defined]
    total = 0
    for name, shape in client_tensors(cfg, k, has_head):
        matrix = len(shape) == 2 and (
            name.endswith("_proj.weight") or "embed" in name or "lm_head" in name
        )
        if q in ("int8", "int4") and matrix and shape[1] % 32 == 0:
            if q == "int8":
                total += shape[0] * shape[1] + 4 * shape[0]
            else:
                total += shape[0] * row_bytes("q4_1", shape[1])
        else:
            total += _numel(shape) * fb
    return total
