"""Ragged batches: one forward pass over the rows of many sessions' blocks.

The trunk server's batching worker (``remote/worker.py``) runs every queued step of every
session as one batch. The rows of all steps are concatenated into one flat [R, H] tensor, the
way SGLang and vLLM describe a ragged batch with per-request offsets (``qo_indptr``): here each
:class:`Part` is one session's rows, a contiguous slice of the batch. Per layer:

* the projections (q|k|v, o, gate|up, down) are one matrix product over all rows of the sessions
  whose layer range covers this layer, through the batch-invariant kernel, so a row's result does
  not depend on its neighbours;
* attention runs per session, against that session's own KV cache with its own positions and
  tree mask (a loop of SDPA calls: the sessions' caches are separate tensors).

A part may be a *chunk* of a long block (chunked prefill): the whole block's slots are reserved
when its first chunk starts (:func:`open_block`), and each chunk writes and attends to the slots
up to its last row (:func:`make_part`). Chunk boundaries depend only on the step itself, so a
chunked block gets the same bits alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model import (
    LayerStack,
    apply_rope,
    attend,
    block_mask,
    out_and_mlp,
    qkv_heads,
    rope_cos_sin,
)


@dataclass
class Part:
    """One session's rows in a batch: all of a step, or one chunk of it."""

    stack: LayerStack  # the session's layers on this device, with its KV cache
    hidden: torch.Tensor  # [n, H] on the stack's device and dtype
    positions: torch.Tensor  # [n] absolute positions of these rows
    slot: int  # cache slot of the first row
    masks: dict[int | None, torch.Tensor | None]  # per attention window: [n, slot + n] or None

    @property
    def rows(self) -> int:
        return int(self.hidden.shape[0])


def open_block(
    stack: LayerStack,
    positions: torch.Tensor,
    keep: Sequence[int] | None,
) -> int:
    """Compact the previous block to ``keep`` and reserve slots for a whole new block (the same
    bookkeeping as :meth:`LayerStack.forward`); returns the block's first slot."""
    if keep is not None:
        stack.cache.compact(keep)
    return stack.cache.append_block(positions.to(stack.device))


def make_part(
    stack: LayerStack,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    parents: Sequence[int] | None,
    block_start: int,
    first: int,
) -> Part:
    """Rows ``first .. first + n`` of a block opened at ``block_start`` (``positions`` and
    ``hidden`` are those rows'; ``parents`` the whole block's)."""
    n = hidden.shape[0]
    pos = positions.to(stack.device)
    slot = block_start + first
    cache_pos = stack.cache.pos[: slot + n]
    masks: dict[int | None, torch.Tensor | None] = {}
    for win in stack.windows:
        if win not in masks:
            masks[win] = block_mask(pos, parents, cache_pos, block_start, win, first)
    x = hidden.to(device=stack.device, dtype=stack.dtype)  # [n, H]
    return Part(stack, x, pos, slot, masks)


def forward_parts(parts: Sequence[Part], *, invariant: bool = True) -> list[torch.Tensor]:
    """Run every part through its stack's layers, the projections batched over all parts whose
    range covers the layer; returns each part's output rows [n, H]. Parts must share weights per
    layer index (one server's layers) and live on one device."""
    if not parts:
        return []
    cfg = parts[0].stack.config
    dtype = parts[0].stack.dtype
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + p.rows)
    x = parts[0].hidden if len(parts) == 1 else torch.cat([p.hidden for p in parts])  # [R, H]
    pos = torch.cat([p.positions for p in parts])  # [R]
    freqs = {r: f for p in parts for r, f in p.stack.inv_freqs.items()}  # global / local
    ropes = {r: rope_cos_sin(f, pos, dtype) for r, f in freqs.items()}  # [R, hd] each
    lo = min(p.stack.start for p in parts)
    hi = max(p.stack.end for p in parts)
    for layer in range(lo, hi):
        active = [j for j, p in enumerate(parts) if p.stack.start <= layer < p.stack.end]
        if not active:
            continue
        w = parts[active[0]].stack.layers[layer - parts[active[0]].stack.start]
        cos, sin = ropes[cfg.layer_rope(layer)]  # [R, hd]
        if len(active) == len(parts):
            rows: torch.Tensor | None = None  # every row takes part
            xa, ca, sa = x, cos, sin
        else:
            rows = torch.cat([torch.arange(bounds[j], bounds[j + 1]) for j in active])  # [R']
            xa, ca, sa = x[rows], cos[rows], sin[rows]
        q, k, v = qkv_heads(xa, w, cfg, invariant=invariant)  # [nh|nkv, R', hd]
        q = apply_rope(q, ca, sa)
        k = apply_rope(k, ca, sa)
        atts = []
        a = 0
        for j in active:
            p = parts[j]
            b = a + p.rows
            i = layer - p.stack.start
            mask = p.masks[p.stack.windows[i]]
            # queries as a contiguous copy: the same layout alone or in any batch (k and v are
            # copied into the session's cache, which is what SDPA reads)
            qs = q[:, a:b].contiguous()
            atts.append(attend(qs, k[:, a:b], v[:, a:b], p.stack.cache, i, p.slot, mask, cfg))
            a = b
        att = atts[0] if len(atts) == 1 else torch.cat(atts)  # [R', nh hd]
        out = out_and_mlp(xa, att, w, cfg, invariant=invariant)  # [R', H]
        if rows is None:
            x = out
        else:
            x = x.clone()
            x[rows] = out
    return [x[bounds[j] : bounds[j + 1]] for j in range(len(parts))]
