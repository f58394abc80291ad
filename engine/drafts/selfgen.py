"""Training data for a draft head, made by the model itself (no dataset, no internet).

* Self-prompts (the Magpie recipe): the instruct model is given only its chat template's
  user-turn prefix and writes a user message, sampled, until its end-of-turn token.
* Replies: each self-prompt goes through the chat template and the model answers greedily — the
  same text a user would get, so the head learns the distribution it will draft for.
* Optional local text (``--text DIR``): read by the model once, teacher-forced.

Every pass records, per position, the three client-side features a head reads (after the head
layers, after the trunk, final) and the model's top-k next-token log-probabilities, so training
never runs the model again. The whole model runs here over a padded batch (one KV cache per row);
the layer math is :mod:`engine.model`'s, so the features are the ones the client computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.loading import ResolvedModel, WeightReader, load_config, load_tokenizer
from engine.model import LayerWeights, apply_rope, layer_tensor_names, rms_norm, rope_inv_freq

TOPK = 16  # target log-probabilities kept per position


@dataclass
class Sample:
    """One recorded sequence. ``feats[i]`` / ``top_*[i]`` belong to position ``i`` (0 <= i < T-1);
    rows ``i >= start`` are trained (earlier ones, e.g. a fixed system prompt, are context only).
    """

    tokens: torch.Tensor  # [T] int32
    feats: torch.Tensor  # [T-1, 3H] float16
    top_ids: torch.Tensor  # [T-1, K] int32
    top_lp: torch.Tensor  # [T-1, K] float16, log-probabilities
    start: int
    kind: str = "reply"  # reply | text

    def __len__(self) -> int:
        return int(self.tokens.numel())


class BatchModel:
    """The whole model over a left-padded batch, with per-row KV caches: enough to generate
    training data quickly on a CPU (big matrix products) or a GPU."""

    def __init__(
        self,
        resolved: ResolvedModel,
        feature_layers: tuple[int, int, int],
        *,
        device: str = "cpu",
        config: ModelConfig | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.config = cfg = config or load_config(resolved.folder)
        cfg.require_plain_layers("veil train-draft")  # the batched layer below is Llama's
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(resolved.folder)
        self.device = torch.device(device)
        reader = WeightReader(resolved.folder)
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
        if not tied:
            names.append("lm_head.weight")
        t = reader.read(names, device=device)
        self.embed_weight = t["model.embed_tokens.weight"]  # [V, H]
        self.norm_weight = t["model.norm.weight"]  # [H]
        self.lm_head = self.embed_weight if tied else t["lm_head.weight"]  # [V, H]
        self.layers = []
        for i in range(cfg.n_layers):
            lt = reader.read(layer_tensor_names(cfg, i), device=device)
            self.layers.append(LayerWeights.from_tensors(lt, i))
        self.inv_freq = rope_inv_freq(cfg).to(self.device)
        self.taps = feature_layers
        self.k = self.v = torch.empty(0)
        self.key_pos = torch.empty(0, dtype=torch.long)  # [B, T] position of each slot

    def start(self, batch: int, capacity: int) -> None:
        cfg = self.config
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k = torch.zeros(shape, device=self.device)
        self.v = torch.zeros(shape, device=self.device)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows from the caches (``rows``: the ones to keep)."""
        self.k = self.k[:, rows]
        self.v = self.v[:, rows]

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, pos: torch.Tensor, key_ok: torch.Tensor, t0: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run columns [t0, t0 + S) of the batch: ids/pos [B, S]; ``key_ok`` [B, t0 + S] marks
        real (not padding) slots. Returns features [B, S, 3H] and final hidden [B, S, H]."""
        cfg = self.config
        b, s = ids.shape
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x = F.embedding(ids, self.embed_weight)  # [B, S, H]
        freqs = pos.float()[..., None] * self.inv_freq  # [B, S, hd/2]
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [B, 1, S, hd]
        end = t0 + s
        slots = torch.arange(end, device=self.device)
        causal = slots[None, :] <= slots[t0:end, None]  # [S, T]
        mask = causal[None] & key_ok[:, None, :end]  # [B, S, T]
        taps: list[torch.Tensor] = []
        for li, w in enumerate(self.layers):
            win = cfg.layer_windows[li]
            m = mask
            if win is not None:  # sliding window: keys less than ``win`` positions back
                m = mask & ((pos[:, :, None] - self.key_pos[:, None, :end]) < win)
            h = rms_norm(x, w.ln1, cfg.rms_eps)
            qkv = h @ w.wqkv.T  # [B, S, (nh + 2 nkv) hd]
            if w.bqkv is not None:
                qkv = qkv + w.bqkv
            q = qkv[..., : nh * hd].view(b, s, nh, hd).transpose(1, 2)  # [B, nh, S, hd]
            k = qkv[..., nh * hd : (nh + nkv) * hd].view(b, s, nkv, hd).transpose(1, 2)
            v = qkv[..., (nh + nkv) * hd :].view(b, s, nkv, hd).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.k[li, :, :, t0:end] = k
            self.v[li, :, :, t0:end] = v
            att = F.scaled_dot_product_attention(
                q,
                self.k[li, :, :, :end],
                self.v[li, :, :, :end],
                attn_mask=m[:, None],
                enable_gqa=nh != nkv,
            )  # [B, nh, S, hd]
            att = att.transpose(1, 2).reshape(b, s, nh * hd)
            x = x + att @ w.wo.T
            h = rms_norm(x, w.ln2, cfg.rms_eps)
            gate, up = (h @ w.wgu.T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w.wdown.T  # [B, S, H]
            if li + 1 in self.taps:
                taps.append(x)
        feats = torch.cat([taps[self._tap_index(i)] for i in range(3)], -1)  # [B, S, 3H]
        return feats, x

    def _tap_index(self, i: int) -> int:
        """Index into the captured states (a tap layer may repeat, e.g. fully local splits)."""
        distinct = sorted(set(self.taps))
        return distinct.index(self.taps[i])

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        h = rms_norm(final, self.norm_weight, self.config.rms_eps)
        return (h @ self.lm_head.T).float()  # [..., V]

    @torch.inference_mode()
    def run(
        self,
        prompts: Sequence[Sequence[int]],
        max_new: int,
        *,
        eos: Sequence[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        record_from: Sequence[int] | None = None,
    ) -> list[tuple[list[int], Sample | None]]:
        """Continue every prompt (greedy, or sampled at ``temperature`` / ``top_p``) for up to
        ``max_new`` tokens or an EOS token. With ``record_from`` (per prompt: first trained
        position), also record features and top-k log-probabilities at every position.
        Returns (new tokens, sample or None) per prompt, in order.

        The generated positions' records stay on the device until the end (one copy back, not
        one per step), and finished rows leave the batch only once a quarter of it has
        finished (dropping a row copies every layer's KV cache; until then it is computed and
        ignored). A row's tokens never depend on the rows beside it."""
        n = len(prompts)
        lens = [len(p) for p in prompts]
        width = max(lens)
        pad = [width - n_ for n_ in lens]
        dev = self.device
        ids = torch.zeros(n, width, dtype=torch.long, device=dev)
        key_ok = torch.zeros(n, width + max_new, dtype=torch.bool, device=dev)
        for r, p in enumerate(prompts):
            ids[r, pad[r] :] = torch.tensor(list(p), dtype=torch.long)
            key_ok[r, pad[r] : width] = True
        pos = torch.arange(width, device=dev)[None, :] - torch.tensor(pad, device=dev)[:, None]
        pos = pos.clamp(min=0)
        self.key_pos = torch.zeros(n, width + max_new, dtype=torch.long, device=dev)
        self.key_pos[:, :width] = pos
        self.start(n, width + max_new)
        record = record_from is not None
        feats, final = self.forward(ids, pos, key_ok, 0)
        pre: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if record:  # the prompt's positions, one row at a time (logits [T, V] per row)
            for r in range(n):
                ti, tl = _topk_logprobs(self.logits(final[r, pad[r] :]))
                pre.append((feats[r, pad[r] :].to(torch.float16).cpu(), ti.cpu(), tl.cpu()))
            steps = max(max_new - 1, 0)
            gen_f = torch.zeros(n, steps, feats.shape[-1], dtype=torch.float16, device=dev)
            gen_i = torch.zeros(n, steps, TOPK, dtype=torch.int32, device=dev)
            gen_l = torch.zeros(n, steps, TOPK, dtype=torch.float16, device=dev)
        last = self.logits(final[:, -1])  # [B, V]
        out: list[list[int]] = [[] for _ in range(n)]
        rows = list(range(n))  # original index of each batch row
        rows_dev = torch.arange(n, device=dev)
        done = [False] * n
        live = n
        eos_set = {int(e) for e in eos}
        t = width
        cur_pos = pos[:, -1] + 1  # [B]
        for step in range(max_new):
            nxt = _choose(last, temperature, top_p, generator)  # [B]
            for r, tok in zip(rows, nxt.tolist(), strict=True):
                if done[r]:
                    continue
                out[r].append(tok)
                if tok in eos_set or step >= max_new - 1:
                    done[r] = True
                    live -= 1
            if live == 0:
                break
            if live <= 3 * len(rows) // 4:  # finished rows are not computed any further
                keep = [j for j, r in enumerate(rows) if not done[r]]
                sel = torch.tensor(keep, dtype=torch.long, device=dev)
                self.keep_rows(sel)
                key_ok, self.key_pos = key_ok[sel], self.key_pos[sel]
                cur_pos, nxt, rows_dev = cur_pos[sel], nxt[sel], rows_dev[sel]
                rows = [rows[j] for j in keep]
            key_ok[:, t] = True
            self.key_pos[:, t] = cur_pos
            feats, final = self.forward(nxt[:, None], cur_pos[:, None], key_ok, t)
            last = self.logits(final[:, 0])  # [B, V]
            if record:  # a finished row's slots past its end are cut off below
                ti, tl = _topk_logprobs(last)
                gen_f[rows_dev, step] = feats[:, 0].to(torch.float16)
                gen_i[rows_dev, step] = ti
                gen_l[rows_dev, step] = tl
            cur_pos = cur_pos + 1
            t += 1
        results: list[tuple[list[int], Sample | None]] = []
        if record:
            gen_f_c, gen_i_c, gen_l_c = gen_f.cpu(), gen_i.cpu(), gen_l.cpu()
        for r in range(n):
            sample = None
            if record:
                toks = [*prompts[r], *out[r]]
                m = len(out[r]) - 1  # generated positions that were run
                f0, i0, l0 = pre[r]
                sample = Sample(
                    torch.tensor(toks, dtype=torch.int32),
                    torch.cat([f0, gen_f_c[r, :m]])[: len(toks) - 1],
                    torch.cat([i0, gen_i_c[r, :m]])[: len(toks) - 1],
                    torch.cat([l0, gen_l_c[r, :m]])[: len(toks) - 1],
                    int(record_from[r]) if record_from is not None else 0,
                )
            results.append((out[r], sample))
        return results


def _topk_logprobs(logits: torch.Tensor, k: int = TOPK) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids [R, k] int32 and log-probabilities [R, k] float16 of logits [R, V], on the
    logits' device."""
    vals, ids = logits.topk(k, dim=-1)
    lp = vals - logits.logsumexp(-1, keepdim=True)
    return ids.to(torch.int32), lp.to(torch.float16)


def _choose(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Greedy or temperature / nucleus sampling, per row of logits [B, V] -> [B]."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = (logits / temperature).softmax(-1)
    if top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        cut = sp.cumsum(-1) - sp > top_p
        sp = sp.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
    if generator is not None and generator.device.type != probs.device.type:
        probs = probs.cpu()
    return torch.multinomial(probs, 1, generator=generator).flatten().to(logits.device)


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """Token ids of the chat template up to where a user's message begins (Magpie)."""
    mark = "\u2063MAGPIE\u2063"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=False
    )
    head = text[: text.index(mark)]
    return [int(i) for i in tokenizer(head, add_special_tokens=False)["input_ids"]]


def read_text_chunks(folder: Path, tokenizer: Any, chunk: int, limit: int) -> list[list[int]]:
    """Token chunks of up to ``chunk`` tokens from the .txt/.md files under ``folder``, until
    ``limit`` tokens."""
    out: list[list[int]] = []
    total = 0
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".txt", ".md"))
    for p in files:
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
        for i in range(0, len(ids), chunk):
            piece = ids[i : i + chunk]
            if len(piece) < 16:
                continue
            out.append(piece)
            total += len(piece)
            if total >= limit:
                return out
    return out
