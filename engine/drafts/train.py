"""Training a draft head on recorded samples (:mod:`engine.drafts.dataset`).

Loss: soft cross-entropy between the head's distribution over the draft vocabulary and the
model's own (top-k log-probabilities recorded with the features, renormalized over the draft
vocabulary), so the head learns the whole distribution the tree is drawn from, not one token.
It is reported as KL divergence (the cross-entropy minus the target's entropy: the same
gradient, and zero for a perfect head).

Training-time test (EAGLE-3, HASS): drafting deeper than one token feeds the head its own output
in place of features the model has not computed. Training unrolls the same way: step 0 reads the
recorded features of row ``i`` and predicts token ``i + 2``; step ``j`` reads step ``j - 1``'s
output of the same row with the embedding of token ``i + 1 + j`` and predicts token
``i + 2 + j``. Its attention sees the recorded context up to ``i`` (step 0's keys) and its own
earlier steps at row ``i`` — exactly the keys a drafted node sees at inference (the committed
cache and its ancestors). Step losses are weighted ``0.8 ** j``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.drafts.dataset import Report, _no_report, cpu_seconds, trained_tokens
from engine.drafts.head import DraftHeadNet
from engine.drafts.selfgen import Sample
from engine.model import rms_norm


@dataclass
class TrainOptions:
    steps: int = 0  # optimizer steps; 0 = ``epochs`` passes over the data
    epochs: float = 10.0
    batch_tokens: int = 2048  # rows per optimizer step (padding excluded)
    lr: float = 1e-2
    warmup: int = 30
    unroll: int = 3  # training-time-test steps
    step_decay: float = 0.8
    clip: float = 1.0
    reg_weight: float = 0.0  # feature regression next to the soft cross-entropy
    weight_decay: float = 0.1
    dropout: float = 0.1  # on the fused features, while training
    seed: int = 0
    max_len: int = 512  # longer samples are cut (their tail is dropped)
    minutes: float = 0.0  # > 0: fewer steps if the run would take longer (measured as it goes)
    checkpoint_s: float = 300.0  # ``checkpoint`` is called after a step this long after the last


@dataclass
class Frozen:
    """The model's parts the head uses but never trains: embedding, final norm, LM head rows
    of the draft vocabulary."""

    embed: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    lm_rows: torch.Tensor  # [Vd, H]
    eps: float
    to_draft: torch.Tensor  # [V] int64: draft index of each model token, -1 if absent


def draft_vocab(samples: Sequence[Sample], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` tokens the model writes most often (FR-Spec), ascending ids: the model's
    own top choice at every trained position, counted; tokens never seen fill the rest in id
    order (a BPE tokenizer numbers its merges roughly from the most frequent, so low ids are
    the common ones of its training text)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in samples:
        top = s.top_ids[s.start :, 0].long()
        counts += torch.bincount(top, minlength=vocab_size)[:vocab_size].double()
    prior = 0.5 * (vocab_size - torch.arange(vocab_size, dtype=torch.float64)) / vocab_size
    size = min(size, vocab_size)
    return (counts + prior).topk(size).indices.sort().values


def vocab_coverage(samples: Sequence[Sample], vocab: torch.Tensor, vocab_size: int) -> float:
    """Share of trained positions whose top token is in ``vocab``."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab] = True
    hit = total = 0
    for s in samples:
        top = s.top_ids[s.start :, 0].long()
        hit += int(inside[top].sum())
        total += top.numel()
    return hit / max(total, 1)


@dataclass
class Batch:
    feats: torch.Tensor  # [N, S, 3H]
    tokens: torch.Tensor  # [N, S + U] next tokens: tokens[:, i + j] = t_{i+1+j}
    tgt_idx: torch.Tensor  # [N, S + U, K] draft indices of the target's top-k (-1: absent)
    tgt_p: torch.Tensor  # [N, S + U, K] their probabilities, renormalized over the draft vocab
    tgt_has: torch.Tensor  # [N, S + U] the target position exists and is trained
    tgt_ok: torch.Tensor  # [N, S + U] ... and its top-1 is in the draft vocabulary
    greedy: torch.Tensor  # [N, S + U] at index i: token i+1 is the model's top choice after i
    tgt_feat: torch.Tensor | None = None  # [N, S + U, H] the model's final hidden at the target
    rows: int = 0

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.feats.to(device),
            self.tokens.to(device),
            self.tgt_idx.to(device),
            self.tgt_p.to(device),
            self.tgt_has.to(device),
            self.tgt_ok.to(device),
            self.greedy.to(device),
            None if self.tgt_feat is None else self.tgt_feat.to(device),
            self.rows,
        )


def make_batch(samples: Sequence[Sample], frozen: Frozen, unroll: int, max_len: int) -> Batch:
    """Pad samples into one batch. Row ``i`` of a sample (position ``i``) reads token ``i + 1``;
    the step-``j`` target of row ``i`` is the model's distribution at position ``i + 1 + j``,
    kept at index ``i + j`` of the target arrays."""
    rows = [min(len(s) - 1, max_len) for s in samples]
    n, s_len = len(samples), max(rows)
    width = s_len + unroll
    h3 = samples[0].feats.shape[1]
    k = samples[0].top_ids.shape[1]
    feats = torch.zeros(n, s_len, h3)
    tokens = torch.zeros(n, width, dtype=torch.long)
    tgt_idx = torch.full((n, width, k), -1, dtype=torch.long)
    tgt_p = torch.zeros(n, width, k)
    tgt_has = torch.zeros(n, width, dtype=torch.bool)
    tgt_ok = torch.zeros(n, width, dtype=torch.bool)
    greedy = torch.zeros(n, width, dtype=torch.bool)
    hsz = h3 // 3
    tgt_feat = torch.zeros(n, width, hsz)
    for b, (smp, r) in enumerate(zip(samples, rows, strict=True)):
        t = smp.tokens.long()
        feats[b, :r] = smp.feats[:r].float()
        nxt = t[1 : r + 1]  # t_{i+1} for rows i < r
        tokens[b, : nxt.numel()] = nxt
        # target at index i + j is the distribution at position i + 1 + j (< T - 1)
        top_ids = smp.top_ids[1:r].long()  # positions 1 .. r-1
        top_lp = smp.top_lp[1:r].float()
        m = top_ids.shape[0]
        idx = frozen.to_draft[top_ids]  # [m, K]
        p = top_lp.exp() * (idx >= 0)
        mass = p.sum(-1, keepdim=True)
        tgt_idx[b, :m] = idx
        tgt_p[b, :m] = p / mass.clamp(min=1e-9)
        has = torch.ones(m, dtype=torch.bool)
        has[: max(smp.start - 1, 0)] = False  # index start - 1 holds position ``start``
        tgt_has[b, :m] = has
        tgt_ok[b, :m] = has & (idx[:, 0] >= 0)
        greedy[b, :r] = t[1 : r + 1] == smp.top_ids[:r, 0].long()
        tgt_feat[b, :m] = smp.feats[1:r, 2 * hsz :].float()
    return Batch(feats, tokens, tgt_idx, tgt_p, tgt_has, tgt_ok, greedy, tgt_feat, int(sum(rows)))


def _rope(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f = positions.float()[:, None] * inv_freq[None, :]  # [S, hd/2]
    e = torch.cat([f, f], -1)
    return e.cos(), e.sin()  # [S, hd]


def unroll(
    net: DraftHeadNet,
    frozen: Frozen,
    batch: Batch,
    inv_freq: torch.Tensor,
    steps: int,
) -> list[torch.Tensor]:
    """The head's output [N, S, H] at every training-time-test step (see the module
    docstring); :func:`draft_logits` turns rows of it into logits."""
    s = net.shape
    s_len = batch.feats.shape[1]
    dev = batch.feats.device
    scale = 1.0 / math.sqrt(s.head_dim)
    rep = s.n_heads // s.n_kv_heads
    pos = torch.arange(s_len, device=dev)
    causal = torch.ones(s_len, s_len, dtype=torch.bool, device=dev).tril()
    hid = net.fuse(batch.feats)  # [N, S, H]
    keys: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    out: list[torch.Tensor] = []
    for j in range(steps):
        emb = F.embedding(batch.tokens[:, j : j + s_len], frozen.embed)  # [N, S, H]
        cos, sin = _rope(pos + j, inv_freq)
        q, k, v = net.qkv(hid, emb, cos, sin)  # [N, nh|nkv, S, hd]
        k = k.repeat_interleave(rep, dim=1)  # [N, nh, S, hd]
        v = v.repeat_interleave(rep, dim=1)
        keys.append(k)
        vals.append(v)
        sc = (q @ keys[0].transpose(-1, -2)) * scale  # [N, nh, S, S]
        sc = sc.masked_fill(~causal, float("-inf"))
        diag = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # [N, nh, S, 1]
        p = torch.cat([sc, *diag], -1).softmax(-1)
        att = p[..., :s_len] @ vals[0]  # [N, nh, S, hd]
        for i, vv in enumerate(vals[1:]):
            att = att + p[..., s_len + i : s_len + i + 1] * vv
        hid = net.finish(hid, att)  # [N, S, H]
        out.append(hid)
    return out


def draft_logits(hidden: torch.Tensor, frozen: Frozen) -> torch.Tensor:
    """The model's final norm and the draft vocabulary's LM head rows: [R, H] -> [R, Vd]."""
    return rms_norm(hidden, frozen.norm, frozen.eps) @ frozen.lm_rows.T


def step_losses(
    hidden: list[torch.Tensor], batch: Batch, frozen: Frozen, reg_weight: float = 0.0
) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Soft cross-entropy per step (the LM head runs only on rows with a target), plus
    ``reg_weight`` times a feature regression (EAGLE-1: the head's output, normed as the LM
    head sees it, against the model's own final hidden state there — a dense signal that makes
    a small data set go further); and (top-1 hits, rows) per step for the log."""
    s_len = hidden[0].shape[1]
    losses, hits = [], []
    for j, hid in enumerate(hidden):
        ok = batch.tgt_ok[:, j : j + s_len]  # [N, S]
        idx = batch.tgt_idx[:, j : j + s_len][ok]  # [R, K]
        p = batch.tgt_p[:, j : j + s_len][ok]  # [R, K]
        rows = hid[ok]  # [R, H]
        logits = draft_logits(rows, frozen).float()  # [R, Vd]
        picked = logits.log_softmax(-1).gather(-1, idx.clamp(min=0))  # [R, K]
        # KL(target || head) = cross-entropy - target entropy: same gradient, 0 at a perfect fit
        kl = (p * (p.clamp(min=1e-12).log() - picked)).sum(-1)  # [R]
        loss = kl.mean() if kl.numel() else kl.sum()
        if reg_weight and batch.tgt_feat is not None and kl.numel():
            want = rms_norm(batch.tgt_feat[:, j : j + s_len][ok], frozen.norm, frozen.eps)
            got = rms_norm(rows, frozen.norm, frozen.eps)
            loss = loss + reg_weight * F.smooth_l1_loss(got, want)
        losses.append(loss)
        with torch.no_grad():
            hits.append((int((logits.argmax(-1) == idx[:, 0]).sum()), int(kl.numel())))
    return losses, hits


@dataclass
class TrainResult:
    steps: int
    rows_seen: int
    wall_s: float
    cpu_s: float
    losses: list[float] = field(default_factory=list)  # mean loss per logged interval
    final_acc: list[float] = field(default_factory=list)  # top-1 per step, last interval


def batches(samples: Sequence[Sample], batch_tokens: int, rng: random.Random) -> list[list[Sample]]:
    """Groups of similar length (little padding) of about ``batch_tokens`` rows, shuffled."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i]), rng.random()))
    out: list[list[Sample]] = []
    cur: list[Sample] = []
    rows = 0
    for i in order:
        cur.append(samples[i])
        rows += len(samples[i]) - 1
        if rows >= batch_tokens:
            out.append(cur)
            cur, rows = [], 0
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def train_head(
    net: DraftHeadNet,
    frozen: Frozen,
    samples: Sequence[Sample],
    inv_freq: torch.Tensor,
    opts: TrainOptions,
    *,
    report: Report = _no_report,
    state: dict[str, Any] | None = None,
    checkpoint: Any = None,
) -> TrainResult:
    """Train ``net`` in place. ``state`` (from a checkpoint) resumes the optimizer, the step
    count and the random numbers (so the run goes on exactly as it would have), and the time
    already spent (so a resumed run reports the whole training time); ``checkpoint(net, state)``
    is called every ``opts.checkpoint_s`` seconds."""
    torch.manual_seed(opts.seed)
    total_rows = sum(len(s) - 1 for s in samples)
    steps = opts.steps or max(1, int(opts.epochs * total_rows / opts.batch_tokens))
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    net.dropout = opts.dropout
    done = 0
    spent_wall = spent_cpu = 0.0  # time of the run(s) a resumed run continues
    if state:
        opt.load_state_dict(state["optimizer"])
        done = int(state["step"])
        spent_wall = float(state.get("wall_s", 0.0))
        spent_cpu = float(state.get("cpu_s", 0.0))
        rng = state.get("rng") or {}
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if rng.get("cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    warmup = min(opts.warmup, steps // 10 + 1)
    budget_s = 60.0 * opts.minutes
    # a time budget fixes the step count once the first steps have been timed; the learning-rate
    # schedule then runs its whole course over the steps that fit
    probe_at = done + max(20, warmup)

    def lr_at(step: int) -> float:
        if step < warmup:
            return opts.lr * (step + 1) / warmup
        t = (step - warmup) / max(steps - warmup, 1)
        return opts.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    t_wall, t_cpu = time.perf_counter(), cpu_seconds()
    last_ckpt = time.perf_counter()
    weights = [opts.step_decay**j for j in range(opts.unroll)]
    result = TrainResult(steps, 0, 0.0, 0.0)
    window: list[float] = []
    hits_win = [[0, 0] for _ in range(opts.unroll)]
    queue: list[list[Sample]] = []
    epoch = 0
    # skip the batches a resumed run already did (same seed, same order)
    while done > 0 and len(queue) < done:
        queue += batches(samples, opts.batch_tokens, random.Random(opts.seed + epoch))
        epoch += 1
    queue = queue[done:]
    net.train()
    step = done
    while step < steps:
        if budget_s > 0 and step == probe_at:
            per_step = (time.perf_counter() - t_wall) / max(step - done, 1)
            left = budget_s - spent_wall - (time.perf_counter() - t_wall)
            steps = max(step + 1, min(steps, step + int(left / per_step)))
            result.steps = steps
        if not queue:
            queue = batches(samples, opts.batch_tokens, random.Random(opts.seed + epoch))
            epoch += 1
        group = queue.pop(0)
        batch = make_batch(group, frozen, opts.unroll, opts.max_len).to(frozen.embed.device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        hidden = unroll(net, frozen, batch, inv_freq, opts.unroll)
        losses, hits = step_losses(hidden, batch, frozen, opts.reg_weight)
        loss = torch.stack([w * x for w, x in zip(weights, losses, strict=True)]).sum()
        loss = loss / sum(weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, opts.clip)
        opt.step()
        result.rows_seen += batch.rows
        window.append(float(loss.detach()))
        for j, (h, n) in enumerate(hits):
            hits_win[j][0] += h
            hits_win[j][1] += n
        if (step + 1) % 10 == 0 or step + 1 == steps:
            result.losses.append(sum(window) / len(window))
            acc = [h / max(n, 1) for h, n in hits_win]
            result.final_acc = acc
            info = {"loss": result.losses[-1]}
            info.update({f"acc{j + 1}": a for j, a in enumerate(acc[:3])})
            report("training", step + 1, steps, info)
            window = []
            hits_win = [[0, 0] for _ in range(opts.unroll)]
        if checkpoint is not None and time.perf_counter() - last_ckpt >= opts.checkpoint_s:
            spent = {
                "wall_s": spent_wall + time.perf_counter() - t_wall,
                "cpu_s": spent_cpu + cpu_seconds() - t_cpu,
            }
            rng_now: dict[str, Any] = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng_now["cuda"] = torch.cuda.get_rng_state_all()
            checkpoint(
                net, {"optimizer": opt.state_dict(), "step": step + 1, "rng": rng_now, **spent}
            )
            last_ckpt = time.perf_counter()
        step += 1
    net.eval()
    result.wall_s = spent_wall + time.perf_counter() - t_wall
    result.cpu_s = spent_cpu + cpu_seconds() - t_cpu
    return result


@torch.no_grad()
def depth_acceptance(
    net: DraftHeadNet,
    frozen: Frozen,
    samples: Sequence[Sample],
    inv_freq: torch.Tensor,
    depth: int = 6,
    top: int = 4,
) -> dict[str, Any]:
    """The head alone, drafting a chain from every position of greedy text: at depth ``d``,
    how often its top-1 is the model's next token given depths 1..d-1 were right
    (``conditional``), how often all of 1..d were (``cumulative``), and how often the model's
    token is among the head's top ``top`` at depth 1 (what a tree can still catch)."""
    net.eval()
    hit = [0] * depth
    tried = [0] * depth
    top_hit = 0
    chains = 0
    chain_len = 0.0
    for i in range(0, len(samples), 8):
        batch = make_batch(samples[i : i + 8], frozen, depth, 10**9).to(frozen.embed.device)
        hidden = unroll(net, frozen, batch, inv_freq, depth)
        s_len = hidden[0].shape[1]
        # chains that follow greedy text: token i+1+j is the model's choice after i+j
        alive = batch.greedy[:, :s_len].clone()
        for j, hid in enumerate(hidden):
            live = alive & batch.tgt_has[:, j : j + s_len] & batch.greedy[:, j : j + s_len]
            tgt = batch.tgt_idx[:, j : j + s_len, 0][live]  # -1 outside the draft vocabulary
            logits = draft_logits(hid[live], frozen)  # [R, Vd]
            good_rows = logits.argmax(-1) == tgt
            tried[j] += int(live.sum())
            hit[j] += int(good_rows.sum())
            if j == 0:
                topk = logits.topk(top, dim=-1).indices
                top_hit += int((topk == tgt[:, None]).any(-1).sum())
                chains += int(live.sum())
            good = torch.zeros_like(live)
            good[live] = good_rows
            alive = good
            chain_len += float(good_rows.sum())
    cond = [h / t if t else 0.0 for h, t in zip(hit, tried, strict=True)]
    cum = []
    acc = 1.0
    for c in cond:
        acc *= c
        cum.append(acc)
    return {
        "positions": chains,
        "conditional": [round(c, 4) for c in cond],
        "cumulative": [round(c, 4) for c in cum],
        f"top{top}_depth1": round(top_hit / max(chains, 1), 4),
        "mean_chain": round(chain_len / max(chains, 1), 4),
    }


def trained_rows(samples: Sequence[Sample]) -> int:
    return sum(trained_tokens(s) for s in samples)
