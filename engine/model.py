"""Veil's transformer math: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP
(and the variations of the families :class:`engine.config.ModelConfig` describes: q/k norms,
Gemma's sandwich norms, GELU gate, query scale, soft-capping, local and global rotary bases),
a KV cache that owns preallocated buffers, and a `LayerStack` that runs a contiguous range of
decoder layers over a *block* of tokens described by explicit positions and tree parents.

Torch only. Shapes: B = tokens in the block, H = hidden size, nh/nkv = query/kv heads,
hd = head dim, T = cached tokens after the block is appended.

A block is a tree in topological order: ``parents[i] < i`` is the index of node i's parent in
the block, or -1 when node i hangs directly off the cached prefix. A chain (prefill, one token)
is the special case ``parents[i] = i - 1``. Node i attends to the whole cached prefix and to its
own ancestors in the block (and itself).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import ModelConfig
from engine.kernels import linear
from engine.kernels.layer_args import fused_args
from engine.quant import QuantWeight, fuse, weight_bytes

# A matrix [out, in]: a float tensor, a QuantWeight or a Stacked of them. Typed Any so code
# written for float tensors (the privacy audit, which always loads float weights) type-checks.
Weight = Any

LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
BIAS_TENSORS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
QK_NORM_TENSORS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# Gemma: post_attention_layernorm norms the attention output; the MLP input has its own norm.
SANDWICH_TENSORS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")


def layer_tensor_names(config: ModelConfig, index: int) -> list[str]:
    """Checkpoint names of the tensors decoder layer ``index`` needs."""
    names = list(LAYER_TENSORS) + (list(BIAS_TENSORS) if config.attn_bias else [])
    names += list(QK_NORM_TENSORS) if config.qk_norm else []
    names += list(SANDWICH_TENSORS) if config.sandwich_norms else []
    return [f"model.layers.{index}.{n}" for n in names]


def norm_vector(t: torch.Tensor, config: ModelConfig | None) -> torch.Tensor:
    """A stored norm weight as the math multiplies by it: Gemma stores ``w`` for ``1 + w``
    (added in float32, as transformers computes it)."""
    if config is not None and config.norm_plus_one:
        return (t.float() + 1.0).to(t.dtype)
    return t


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rope_inv_freq(config: ModelConfig, kind: str = "global") -> torch.Tensor:
    """Inverse frequencies [hd/2] incl. linear and Llama-3 scaling; ``kind`` "local": the
    sliding-window layers' own base, unscaled (:meth:`ModelConfig.layer_rope`)."""
    hd = config.head_dim
    local = kind == "local" and config.local_rope_theta is not None
    theta = config.local_rope_theta if local and config.local_rope_theta else config.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    rs = config.rope_scaling or {}
    rtype = "default" if local else config.rope_type
    if rtype == "linear":
        inv = inv / float(rs["factor"])
    elif rtype == "llama3":
        factor = float(rs["factor"])
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [B, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [heads, B, hd]; cos/sin: [B, hd]
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Preallocated K/V buffers for a range of layers, batch size 1.

    ``k``/``v``: [n_layers, nkv, capacity, hd]; ``pos``: [capacity] absolute position of each slot.
    Slots [0, length) are live. The most recent block occupies [block_start, length) until the
    next :meth:`compact` keeps a subset of it.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.capacity = 0
        self.k = torch.empty(0)
        self.v = torch.empty(0)
        self.pos = torch.empty(0, dtype=torch.long)
        self.length = 0
        self.block_start = 0
        self._alloc(max(capacity, 1))

    def _alloc(self, capacity: int) -> None:
        shape = (self.n_layers, self.n_kv_heads, capacity, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        pos = torch.zeros(capacity, dtype=torch.long, device=self.device)
        if self.length:
            k[:, :, : self.length] = self.k[:, :, : self.length]
            v[:, :, : self.length] = self.v[:, :, : self.length]
            pos[: self.length] = self.pos[: self.length]
        self.k, self.v, self.pos, self.capacity = k, v, pos, capacity

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2 + self.pos.numel() * 8

    def reserve(self, extra: int) -> None:
        """Grow (doubling) so that ``extra`` more slots fit."""
        need = self.length + extra
        if need > self.capacity:
            cap = self.capacity
            while cap < need:
                cap *= 2
            self._alloc(cap)

    def compact(self, keep: Sequence[int]) -> None:
        """Keep only nodes ``keep`` (ascending indices into the last block), moved into place."""
        n_block = self.length - self.block_start
        idx = list(keep)
        if any(b <= a for a, b in itertools.pairwise(idx)):
            raise ValueError("keep indices must be strictly ascending")
        if idx and (idx[0] < 0 or idx[-1] >= n_block):
            raise ValueError(f"keep index out of range for a block of {n_block}")
        if idx == list(range(len(idx))):
            self.length = self.block_start + len(idx)  # already in place: just drop the rest
            return
        src = torch.tensor(idx, dtype=torch.long, device=self.device) + self.block_start
        dst = slice(self.block_start, self.block_start + len(idx))
        # idx[j] >= j, so gathering first and then writing never reads a slot already overwritten.
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]
        self.pos[dst] = self.pos[src]
        self.length = self.block_start + len(idx)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} to {length}")
        self.length = length
        self.block_start = min(self.block_start, length)

    def reset(self) -> None:
        self.length = 0
        self.block_start = 0

    def append_block(self, positions: torch.Tensor) -> int:
        """Reserve slots for a block; returns the first slot."""
        n = positions.shape[0]
        self.reserve(n)
        start = self.length
        self.pos[start : start + n] = positions
        self.length = start + n
        self.block_start = start
        return start


def is_chain(parents: Sequence[int] | None) -> bool:
    """True for a plain causal block (no parents, or each node's parent is the node before)."""
    return parents is None or all(p == i - 1 for i, p in enumerate(parents))


def block_mask(
    positions: torch.Tensor,
    parents: Sequence[int] | None,
    cache_pos: torch.Tensor,
    start: int,
    window: int | None,
    first: int = 0,
) -> torch.Tensor | None:
    """Boolean attention mask [B, T] (True = attend) for rows ``first .. first + B`` of a block
    appended at slot ``start`` (``first = 0``: the whole block; more: a chunk of a long one).

    ``cache_pos`` holds the positions of the T slots the rows may see (the cache up to the last
    row, block included); ``parents`` are the whole block's. Returns None when every row may see
    every key (one row with no window that sees all earlier rows), so SDPA takes its fast path.
    """
    n = positions.shape[0]
    total = cache_pos.shape[0]
    chain = parents is None or all(p == i - 1 for i, p in enumerate(parents))
    if n == 1 and window is None and (chain or first == 0):
        return None
    dev = positions.device
    mask = torch.ones(n, total, dtype=torch.bool, device=dev)
    if chain:
        # causal; earlier chunks of the block are all ancestors, like the cached prefix
        block = torch.ones(n, n, dtype=torch.bool, device=dev).tril_()
        mask[:, start + first :] = block
    else:
        assert parents is not None
        anc = torch.zeros(first + n, first + n, dtype=torch.bool)
        for i, p in enumerate(parents[: first + n]):
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        mask[:, start:] = anc[first:].to(dev)
    if window is not None:
        mask &= (positions[:, None] - cache_pos[None, :]) < window
    return mask


@dataclass
class LayerWeights:
    """One decoder layer's weights in checkpoint layout ([out, in]), fused (q|k|v, gate|up) so a
    block needs three projections and one output projection. Every product goes through
    :func:`engine.kernels.linear`, which streams each weight row once for all the block's rows;
    the matrices may be float tensors or quantized rows (:class:`engine.quant.QuantWeight`)."""

    ln1: torch.Tensor  # [H]
    wqkv: Weight  # [(nh + 2 nkv) hd, H]
    wo: Weight  # [H, nh hd]
    ln2: torch.Tensor  # [H]
    wgu: Weight  # [2 I, H]
    wdown: Weight  # [H, I]
    bqkv: torch.Tensor | None = None  # [(nh + 2 nkv) hd]
    q_norm: torch.Tensor | None = None  # [hd] (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [hd]
    post_attn_norm: torch.Tensor | None = None  # [H] (Gemma: on the attention output)
    post_mlp_norm: torch.Tensor | None = None  # [H] (Gemma: on the MLP output)

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor | QuantWeight],
        index: int,
        config: ModelConfig | None = None,
    ) -> LayerWeights:
        """Pick layer ``index`` out of a name -> tensor map with checkpoint names (``config``
        says how the family's norm weights are stored; None: as they are used)."""
        p = f"model.layers.{index}."
        t = {k[len(p) :]: v for k, v in tensors.items() if k.startswith(p)}
        qkv = fuse(
            [
                t["self_attn.q_proj.weight"],
                t["self_attn.k_proj.weight"],
                t["self_attn.v_proj.weight"],
            ]
        )  # [(nh + 2 nkv) hd, H]
        gu = fuse([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]])  # [2 I, H]
        bias = None
        if "self_attn.q_proj.bias" in t:
            bias = torch.cat(
                [_vector(t[f"self_attn.{n}_proj.bias"]) for n in "qkv"]
            )  # [(nh + 2 nkv) hd]
        wo, wdown = t["self_attn.o_proj.weight"], t["mlp.down_proj.weight"]

        def norm(name: str) -> torch.Tensor | None:
            return norm_vector(_vector(t[name]), config) if name in t else None

        sandwich = "pre_feedforward_layernorm.weight" in t
        ln2 = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
        return cls(
            ln1=norm_vector(_vector(t["input_layernorm.weight"]), config),
            wqkv=qkv,
            wo=wo.contiguous() if isinstance(wo, torch.Tensor) else wo,
            ln2=norm_vector(_vector(t[f"{ln2}.weight"]), config),
            wgu=gu,
            wdown=wdown.contiguous() if isinstance(wdown, torch.Tensor) else wdown,
            bqkv=bias,
            q_norm=norm("self_attn.q_norm.weight"),
            k_norm=norm("self_attn.k_norm.weight"),
            post_attn_norm=norm("post_attention_layernorm.weight") if sandwich else None,
            post_mlp_norm=norm("post_feedforward_layernorm.weight"),
        )

    def nbytes(self) -> int:
        return sum(weight_bytes(t) for t in vars(self).values() if t is not None)


def _vector(t: torch.Tensor | QuantWeight) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError("norm weights and biases must be float tensors")
    return t


def qkv_heads(
    x: torch.Tensor, w: LayerWeights, cfg: ModelConfig, *, invariant: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm and the fused q|k|v projection of a block's rows, split into heads (no rope).

    ``invariant``: use the batch-invariant kernel for every row count (the batching worker)."""
    n = x.shape[0]
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = rms_norm(x, w.ln1, cfg.rms_eps)  # [B, H]
    qkv = linear(h, w.wqkv, invariant=invariant)  # [B, (nh + 2 nkv) hd]
    if w.bqkv is not None:
        qkv = qkv + w.bqkv
    q = qkv[:, : nh * hd].view(n, nh, hd).transpose(0, 1)  # [nh, B, hd]
    k = qkv[:, nh * hd : (nh + nkv) * hd].view(n, nkv, hd).transpose(0, 1)  # [nkv, B, hd]
    v = qkv[:, (nh + nkv) * hd :].view(n, nkv, hd).transpose(0, 1)  # [nkv, B, hd]
    if w.q_norm is not None and w.k_norm is not None:  # per head, before the rotary embedding
        q = rms_norm(q, w.q_norm, cfg.rms_eps)
        k = rms_norm(k, w.k_norm, cfg.rms_eps)
    return q, k, v


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    layer: int,
    start: int,
    mask: torch.Tensor | None,
    cfg: ModelConfig | None = None,
) -> torch.Tensor:
    """One session's attention: writes the rows' K/V (rope applied) into cache slots
    [start, start + B) of ``layer`` and attends to slots [0, start + B) under ``mask`` (with
    ``cfg``'s query scale and score soft-capping, where it sets them).

    q: [nh, B, hd]; k, v: [nkv, B, hd] -> [B, nh hd]."""
    nh, n, hd = q.shape
    end = start + n
    cache.k[layer, :, start:end] = k
    cache.v[layer, :, start:end] = v
    scale = cfg.query_scale if cfg is not None else None
    softcap = cfg.attn_softcap if cfg is not None else None
    # CPU float32: each row walks only the keys it may see, so a row verified in a tree block
    # gets the bits of the same row decoded alone (torch's SDPA rounds differently with masked
    # keys present); elsewhere SDPA.
    att = kernels.attention(
        q, cache.k[layer], cache.v[layer], end, mask, scale=scale, softcap=softcap
    )  # [B, nh hd]
    if att is not None:
        return att
    keys = cache.k[layer, :, :end]  # [nkv, T, hd]
    vals = cache.v[layer, :, :end]  # [nkv, T, hd]
    if softcap is not None:
        return _capped_attention(q, keys, vals, mask, scale or hd**-0.5, softcap)
    sdpa = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        keys.unsqueeze(0),
        vals.unsqueeze(0),
        attn_mask=mask,
        enable_gqa=nh != keys.shape[0],
        scale=scale,
    )  # [1, nh, B, hd]
    return sdpa[0].transpose(0, 1).reshape(n, nh * hd)  # [B, nh hd]


def _capped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    vals: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Attention with soft-capped scores (transformers' eager order: scale, cap, mask, softmax)
    where the compiled kernel does not run: q [nh, B, hd], keys/vals [nkv, T, hd] -> [B, nh hd]."""
    nh, n, hd = q.shape
    group = nh // keys.shape[0]
    k = keys.repeat_interleave(group, dim=0)  # [nh, T, hd]
    v = vals.repeat_interleave(group, dim=0)
    scores = torch.tanh((q @ k.transpose(1, 2)) * scale / softcap) * softcap  # [nh, B, T]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    att = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v  # [nh, B, hd]
    return att.transpose(0, 1).reshape(n, nh * hd)


def out_and_mlp(
    x: torch.Tensor,
    att: torch.Tensor,
    w: LayerWeights,
    cfg: ModelConfig,
    *,
    invariant: bool = False,
) -> torch.Tensor:
    """Output projection, residual, post-attention norm and gated MLP (SiLU, or Gemma's GELU
    with its norms on both outputs): [B, H] -> [B, H]."""
    o = linear(att, w.wo, invariant=invariant)  # [B, H]
    if w.post_attn_norm is not None:
        o = rms_norm(o, w.post_attn_norm, cfg.rms_eps)
    x = x + o
    h = rms_norm(x, w.ln2, cfg.rms_eps)
    gate, up = linear(h, w.wgu, invariant=invariant).chunk(2, dim=-1)  # [B, I] each
    act = F.gelu(gate, approximate="tanh") if cfg.mlp_act == "gelu_tanh" else F.silu(gate)
    m = linear(act * up, w.wdown, invariant=invariant)  # [B, H]
    if w.post_mlp_norm is not None:
        m = rms_norm(m, w.post_mlp_norm, cfg.rms_eps)
    return x + m


def decoder_layer(
    x: torch.Tensor,
    w: LayerWeights,
    cfg: ModelConfig,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    layer: int,
    start: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One pre-norm decoder layer on a block; writes the block's K/V into ``cache``.

    (The batching worker runs the same three pieces with the projections over many sessions'
    rows at once: :mod:`engine.ragged`.)"""
    q, k, v = qkv_heads(x, w, cfg)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    att = attend(q, k, v, cache, layer, start, mask, cfg)
    return out_and_mlp(x, att, w, cfg)


# Rows per piece when a long chain block (a prompt) runs through a LayerStack: the compiled
# layer and its attention keep a piece's buffers in cache. A 4k-token prompt on the 2-core
# Zen 5 machine, SmolLM2 fully local: 238 tok/s as one block, 300 tok/s in 256-row pieces.
PIECE_ROWS = 256


class LayerStack:
    """Decoder layers [start, end) with their own KV cache.

    ``forward(hidden, positions, parents, keep)`` is the one narrow interface shared by head,
    trunk and tail: first the previous block is compacted to ``keep`` (None keeps all of it),
    then the new block is appended and run.
    """

    def __init__(
        self,
        config: ModelConfig,
        start: int,
        layers: Sequence[LayerWeights],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        capacity: int = 256,
    ) -> None:
        self.config = config
        self.start = start
        self.layers = list(layers)
        self.dtype = dtype
        self.device = torch.device(device)
        self.inv_freq = rope_inv_freq(config).to(self.device)  # the global layers'
        # the rotary table of each layer ("global" / "local": Gemma 3's sliding-window layers)
        self.ropes = [config.layer_rope(start + i) for i in range(len(self.layers))]
        self.inv_freqs = {r: rope_inv_freq(config, r).to(self.device) for r in set(self.ropes)}
        self.windows = [config.layer_windows[start + i] for i in range(len(self.layers))]
        self.cache = KVCache(
            len(self.layers), config.n_kv_heads, config.head_dim, capacity, dtype, device
        )
        self._fused: list[tuple[Any, ...]] | None = None  # one-call layers (quantized weights)
        # the cache tensor and numpy views of its K and V buffers, remade when it grows
        self._kv_arrays: tuple[torch.Tensor, np.ndarray, np.ndarray] | None = None
        if self.layers and self.device.type == "cpu" and dtype == torch.float32:
            args = [fused_args(w, config) for w in self.layers]
            if all(a is not None for a in args) and kernels.quant_available():
                self._fused = args  # type: ignore[assignment]

    @property
    def end(self) -> int:
        return self.start + len(self.layers)

    def param_bytes(self) -> int:
        return sum(w.nbytes() for w in self.layers)

    def reset(self) -> None:
        self.cache.reset()

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        if not self.layers:
            return hidden
        n = hidden.shape[0]
        if n <= PIECE_ROWS or not is_chain(parents):
            return self._forward_block(hidden, positions, parents, keep)
        # A long chain (a prompt) runs as consecutive pieces: each attends to everything cached
        # before it, which for a chain is its prefix, so the rows are the same computation;
        # the cache still sees one block (a later ``keep`` indexes all of it).
        if keep is not None:
            self.cache.compact(keep)
        self.cache.reserve(n)
        first = self.cache.length
        outs = [
            self._forward_block(hidden[lo : lo + PIECE_ROWS], positions[lo : lo + PIECE_ROWS])
            for lo in range(0, n, PIECE_ROWS)
        ]
        self.cache.block_start = first
        return torch.cat(outs)  # [B, H]

    def _forward_block(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        if keep is not None:
            self.cache.compact(keep)
        x = hidden.to(device=self.device, dtype=self.dtype)  # [B, H]
        positions = positions.to(self.device)
        start = self.cache.append_block(positions)
        cache_pos = self.cache.pos[: self.cache.length]
        ropes = {r: rope_cos_sin(f, positions, self.dtype) for r, f in self.inv_freqs.items()}
        if self._fused is not None:
            return self._forward_fused(x, ropes, positions, parents, cache_pos, start)
        masks: dict[int | None, torch.Tensor | None] = {}
        for i, w in enumerate(self.layers):
            win = self.windows[i]
            cos, sin = ropes[self.ropes[i]]  # [B, hd]
            if win not in masks:
                masks[win] = block_mask(positions, parents, cache_pos, start, win)
            x = decoder_layer(x, w, self.config, cos, sin, self.cache, i, start, masks[win])
        return x

    def _forward_fused(
        self,
        x: torch.Tensor,
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
        positions: torch.Tensor,
        parents: Sequence[int] | None,
        cache_pos: torch.Tensor,
        start: int,
    ) -> torch.Tensor:
        """The block through every layer as one-call quantized layers (``kernels.fused_layers``):
        the arrays each layer reads are made once per block, not once per layer."""
        assert self._fused is not None
        x = x.contiguous().clone()  # [B, H], updated in place layer after layer
        if self._kv_arrays is None or self._kv_arrays[0] is not self.cache.k:
            self._kv_arrays = (self.cache.k, self.cache.k.numpy(), self.cache.v.numpy())
        _, k_all, v_all = self._kv_arrays  # [L, nkv, capacity, hd], views of the cache
        rope_arrays = {r: (c.numpy(), s.numpy()) for r, (c, s) in ropes.items()}  # [B, hd]
        mask_arrays: dict[int | None, np.ndarray | None] = {}
        calls = []
        for i, args in enumerate(self._fused):
            win = self.windows[i]
            if win not in mask_arrays:
                m = block_mask(positions, parents, cache_pos, start, win)
                mask_arrays[win] = None if m is None else m.numpy()  # [B, T]
            cos, sin = rope_arrays[self.ropes[i]]
            calls.append((args, cos, sin, k_all[i], v_all[i], mask_arrays[win]))
        kernels.fused_layers(x.numpy(), calls, start, self.config.rms_eps)
        return x
