"""The learned draft head as a draft source: its own KV cache over the committed context, and an
EAGLE-2 dynamic tree grown level by level from the head's own confidences.

State between rounds. After a verification round, :meth:`HeadDraft.observe` runs the head over
the accepted path with the *real* features the client just computed (row ``i``: features of
position ``i`` + embedding of token ``i + 1``), appends those rows' keys and values to the
head's cache, and keeps the last row's output: it predicts the children of the next root (the
bonus token). The prompt is observed the same way after prefill.

Drafting. Level 1 comes from that kept output. Each further level takes the ``width`` most
likely nodes of the newest level (by path probability), runs them through the head in one block
(input: the output that predicted the node + the node's embedding, position ``root - 1 +
depth``; attention: the committed cache plus the rows of the node's ancestors), and lists each
node's ``top_k`` children. The draft rows' keys live past the cache's end and are simply
overwritten next round. Growing stops at ``max_depth``, or when the newest level's path
probabilities add up to less than ``min_gain`` — what a level must be expected to add to pay
for its drafting time (the decoder sets it from its cost model each round).

Deterministic: the same context and features give the same tree, so sampling stays exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.drafts.head import DraftHead
from engine.drafts.tree import DraftTree, Verified, bucket
from engine.kernels import linear
from engine.model import KVCache, rms_norm, rope_cos_sin, rope_inv_freq

Q_EDGES = (0.05, 0.15, 0.3, 0.5, 0.7, 0.9)


def lm_head_rows(client: Any, ids: torch.Tensor | None) -> torch.Tensor:
    """The LM head's rows for the draft vocabulary ([Vd, H]; all rows when ``ids`` is None),
    through the client so that another weight format can provide them its own way."""
    rows = getattr(client, "lm_head_rows", None)
    if callable(rows):
        out: torch.Tensor = rows(ids)
        return out
    w: torch.Tensor = client.lm_head
    return w if ids is None else w[ids.to(w.device)].contiguous()


class HeadDraft:
    """A :class:`~engine.drafts.tree.DraftSource` backed by a trained :class:`DraftHead`."""

    name = "head"

    def __init__(
        self,
        head: DraftHead,
        client: Any,
        *,
        width: int = 4,  # four rows share each weight load in the float32 kernel (4 x 4 blocks)
        top_k: int = 8,
        max_depth: int = 8,
        max_nodes: int = 64,
    ) -> None:
        self.head = head
        self.net = head.net.float().eval()
        self.net.requires_grad_(False)
        self.layers = head.feature_layers
        self.client = client
        cfg = client.config
        self.eps = cfg.rms_eps
        self.norm = client.norm_weight.float()  # [H]
        self.vocab = head.vocab  # [Vd] model ids, or None
        self.lm_rows = lm_head_rows(client, head.vocab).float()  # [Vd, H]
        self.inv_freq = rope_inv_freq(cfg)
        s = self.net.shape
        self.cache = KVCache(1, s.n_kv_heads, s.head_dim, 256)
        self.width, self.top_k, self.max_depth, self.max_nodes = width, top_k, max_depth, max_nodes
        self.min_gain = 0.0
        self.level_ms = 0.0  # moving average of one drafting level's time
        self.last_depth = 0
        self.last_ms = 0.0
        self._state: tuple[torch.Tensor, int, int] | None = None  # (hidden [H], root, root pos)

    def reset(self) -> None:
        self.cache.reset()
        self._state = None

    def accepts(self, layers: Sequence[int] | None) -> bool:
        """Whether features tapped after ``layers`` are what this head was trained on."""
        return layers is not None and tuple(layers) == self.layers

    # --- learning the context -----------------------------------------------------------------

    @torch.inference_mode()
    def observe(self, verified: Verified) -> None:
        v = verified
        if v.hidden is None or not self.accepts(v.hidden_layers):
            self._state = None
            return
        r = v.root_index
        if self.cache.length != r:  # a round went unobserved: this conversation is lost to us
            self._state = None
            return
        path = v.path
        bonus = v.targets.get(path[-1])
        if bonus is None:
            self._state = None
            return
        nxt = [v.tokens[p] for p in path[1:]] + [bonus]
        feats = v.hidden[path].float()  # [m, 3H]
        m = len(path)
        pos = torch.arange(r, r + m)
        hid = self.net.fuse(feats)  # [m, H]
        emb = self._embed(nxt)  # [m, H]
        cos, sin = rope_cos_sin(self.inv_freq, pos, torch.float32)
        q, k, val = self.net.qkv(hid, emb, cos, sin)  # [nh|nkv, m, hd]
        start = self.cache.append_block(pos)
        end = start + m
        self.cache.k[0, :, start:end] = k
        self.cache.v[0, :, start:end] = val
        mask = torch.ones(m, end, dtype=torch.bool)
        mask[:, start:] = torch.ones(m, m, dtype=torch.bool).tril()
        att = self._attend(q, end, mask)
        out = self.net.finish(hid[-1:], att[:, -1:])  # [1, H]: only the last row is needed
        self._state = (out[0], int(bonus), r + m)

    # --- drafting -------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        st = self._state
        self.last_depth = 0
        if st is None or budget <= 0:
            return DraftTree()
        hid0, root, root_pos = st
        if len(context) - 1 != root_pos or int(context[-1]) != root:
            return DraftTree()
        t0 = time.perf_counter()
        base = self.cache.length  # == root_pos: committed rows
        cap = self.width * self.max_depth
        self.cache.reserve(cap)
        # nodes: token, parent node, q, path log-prob, depth, hidden that predicted it
        tok: list[int] = []
        par: list[int] = []
        qs: list[float] = []
        lps: list[float] = []
        dep: list[int] = []
        src: list[torch.Tensor] = []
        row_of: dict[int, int] = {}  # node -> its draft row (once expanded)
        anc_rows: list[list[int]] = []  # per draft row: rows of its ancestors and itself

        def add_children(parents: list[int], hidden: torch.Tensor, logits: torch.Tensor) -> None:
            """Children of ``parents`` (one row of ``hidden`` [R, H], ``logits`` [R, Vd] each):
            the head's top-k tokens, one softmax and top-k call for all rows."""
            logq = logits.float().log_softmax(-1)  # [R, Vd]
            vals, idx = logq.topk(min(self.top_k, logq.shape[-1]), dim=-1)  # [R, k]
            ids = self.vocab[idx] if self.vocab is not None else idx
            for j, (row_v, row_t) in enumerate(zip(vals.tolist(), ids.tolist(), strict=True)):
                parent = parents[j]
                base_lp = lps[parent] if parent >= 0 else 0.0
                d = dep[parent] + 1 if parent >= 0 else 1
                h = hidden[j]
                for lv, t in zip(row_v, row_t, strict=True):
                    tok.append(int(t))
                    par.append(parent)
                    qs.append(math.exp(lv))
                    lps.append(base_lp + lv)
                    dep.append(d)
                    src.append(h)

        add_children([-1], hid0[None], self._logits(hid0[None]))
        level = list(range(len(tok)))
        depth = 1
        levels = 0
        while depth < self.max_depth and level:
            frontier = sorted(level, key=lambda i: -lps[i])[: self.width]
            if sum(math.exp(lps[i]) for i in frontier) < self.min_gain:
                break
            tl = time.perf_counter()
            rows = [base + len(anc_rows) + j for j in range(len(frontier))]
            hid = torch.stack([src[i] for i in frontier])  # [R, H]
            emb = self._embed([tok[i] for i in frontier])  # [R, H]
            pos = torch.full((len(frontier),), root_pos - 1 + depth)
            cos, sin = rope_cos_sin(self.inv_freq, pos, torch.float32)
            q, k, val = self.net.qkv(hid, emb, cos, sin)
            self.cache.k[0, :, rows[0] : rows[-1] + 1] = k
            self.cache.v[0, :, rows[0] : rows[-1] + 1] = val
            end = rows[-1] + 1
            mask = torch.zeros(len(frontier), end, dtype=torch.bool)
            mask[:, :base] = True
            for j, n in enumerate(frontier):
                p = par[n]
                own = [*(anc_rows[row_of[p] - base] if p >= 0 else []), rows[j]]
                anc_rows.append(own)
                row_of[n] = rows[j]
                mask[j, own] = True
            att = self._attend(q, end, mask)
            out = self.net.finish(hid, att)  # [R, H]
            logits = self._logits(out)  # [R, Vd]
            first_child = len(tok)
            add_children(frontier, out, logits)
            level = list(range(first_child, len(tok)))
            depth += 1
            levels += 1
            ms = (time.perf_counter() - tl) * 1000
            self.level_ms = ms if self.level_ms == 0 else 0.8 * self.level_ms + 0.2 * ms
        self.last_depth = depth
        order = sorted(range(len(tok)), key=lambda i: (-lps[i], dep[i]))
        order = order[: min(budget, self.max_nodes)]
        where: dict[int, int] = {}
        tree = DraftTree()
        for i in order:
            p = par[i]
            if p >= 0 and p not in where:
                continue  # cannot happen (a parent is at least as likely), kept for safety
            where[i] = tree.add(
                tok[i], where[p] if p >= 0 else -1, qs[i], (min(dep[i], 6), bucket(qs[i], Q_EDGES))
            )
        self.last_ms = (time.perf_counter() - t0) * 1000
        return tree

    # --- pieces -----------------------------------------------------------------------------------

    def _embed(self, ids: Sequence[int]) -> torch.Tensor:
        out: torch.Tensor = self.client.embed(torch.tensor(list(ids), dtype=torch.long))
        return out.float()  # [R, H]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        h = rms_norm(hidden, self.norm, self.eps)  # [R, H]
        return linear(h, self.lm_rows)  # [R, Vd]

    def _attend(self, q: torch.Tensor, end: int, mask: torch.Tensor) -> torch.Tensor:
        """q [nh, R, hd] over cache slots [0, end) under ``mask`` [R, end] -> [nh, R, hd]."""
        s = self.net.shape
        keys = self.cache.k[0, :, :end]  # [nkv, T, hd]
        vals = self.cache.v[0, :, :end]
        att = F.scaled_dot_product_attention(
            q[None],
            keys[None],
            vals[None],
            attn_mask=mask,
            enable_gqa=s.n_heads != s.n_kv_heads,
        )  # [1, nh, R, hd]
        return att[0]
