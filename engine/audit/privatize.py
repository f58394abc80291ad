"""`veil privatize`: fine-tune the local head and tail layers so the activations sent to the
server no longer match what the public weights would produce, keeping the trunk fixed and the
output close to the public model's.

Objective per training sequence (full fine-tune of the private layers, AdamW):
``KL(public model ‖ private model)`` over next-token distributions, plus
``weight * mean(relu(margin - d))`` where ``d`` is the relative distance between the private and
the public head output per token — a hinge that pushes the transmitted states at least
``margin`` away from anything the public head computes for the same text.

:func:`evaluate` then measures, on held-out documents, the known-weights inversion and a ridge
decoder trained on public-weight activations against the private head, and quality (perplexity,
greedy agreement with the public model).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.audit import attacks as A
from engine.audit.collect import AuditModel
from engine.audit.corpus import Document, pii_documents, split_by_document, stdlib_texts, tokenize
from engine.audit.metrics import score
from engine.audit.overlay import save_overlay
from engine.config import ModelConfig
from engine.errors import Cancelled, SplitError
from engine.loading import Progress, load_config, resolve
from engine.model import KVCache, LayerStack, LayerWeights, block_mask, decoder_layer, rope_cos_sin


def map_weights(w: LayerWeights, fn: Callable[[torch.Tensor], torch.Tensor]) -> LayerWeights:
    """A copy of ``w`` with ``fn`` applied to every tensor."""
    vals = {f.name: getattr(w, f.name) for f in fields(w)}
    return replace(w, **{k: fn(v) for k, v in vals.items() if v is not None})


def trainable_copy(w: LayerWeights) -> LayerWeights:
    return map_weights(w, lambda t: t.detach().clone().requires_grad_(True))


def params(ws: Sequence[LayerWeights]) -> list[torch.Tensor]:
    return [getattr(w, f.name) for w in ws for f in fields(w) if getattr(w, f.name) is not None]


def to_checkpoint(w: LayerWeights, index: int, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Undo :meth:`LayerWeights.from_tensors`: checkpoint names and [out, in] layouts."""
    p = f"model.layers.{index}."
    nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    qkv = w.wqkv.detach()  # [(nh + 2 nkv) hd, H]
    gate, up = w.wgu.detach().chunk(2, dim=0)  # [I, H] each
    out = {
        p + "input_layernorm.weight": w.ln1.detach(),
        p + "self_attn.q_proj.weight": qkv[:nq],
        p + "self_attn.k_proj.weight": qkv[nq : nq + nk],
        p + "self_attn.v_proj.weight": qkv[nq + nk :],
        p + "self_attn.o_proj.weight": w.wo.detach(),
        p + "post_attention_layernorm.weight": w.ln2.detach(),
        p + "mlp.gate_proj.weight": gate,
        p + "mlp.up_proj.weight": up,
        p + "mlp.down_proj.weight": w.wdown.detach(),
    }
    if w.bqkv is not None:
        b = w.bqkv.detach()
        out[p + "self_attn.q_proj.bias"] = b[:nq]
        out[p + "self_attn.k_proj.bias"] = b[nq : nq + nk]
        out[p + "self_attn.v_proj.bias"] = b[nq + nk :]
    return {k: v.contiguous().clone() for k, v in out.items()}


def run_layers(
    x: torch.Tensor, ws: Sequence[tuple[int, LayerWeights]], cfg: ModelConfig, inv: torch.Tensor
) -> torch.Tensor:
    """Differentiable causal forward of a whole sequence [T, H] through (index, weights)."""
    t = x.shape[0]
    pos = torch.arange(t)  # [T]
    cos, sin = rope_cos_sin(inv, pos, x.dtype)  # [T, hd]
    for i, w in ws:
        cache = KVCache(1, cfg.n_kv_heads, cfg.head_dim, t, x.dtype)
        cache.append_block(pos)
        mask = block_mask(pos, None, pos, 0, cfg.layer_windows[i])
        x = decoder_layer(x, w, cfg, cos, sin, cache, 0, 0, mask)  # [T, H]
    return x


def corpus(am: AuditModel, seed: int, n_stdlib: int, n_pii: int, max_tokens: int) -> Any:
    docs = [Document(f"stdlib-{i}", "stdlib", t) for i, t in enumerate(stdlib_texts(n_stdlib))]
    docs += pii_documents(n_pii, seed)
    for d in docs:
        tokenize(d, am.tokenizer, max_tokens)
    return split_by_document([d for d in docs if len(d.ids) >= 4], 0.25, seed)


def privatize(
    model: str,
    head: int,
    tail: int,
    out_path: Path,
    *,
    steps: int = 120,
    lr: float = 3e-5,
    margin: float = 0.3,
    weight: float = 1.0,
    seed: int = 0,
    quick: bool = False,
    progress: Progress | None = None,
    cancel: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Train private head/tail layers, save them to ``out_path``, and return the evaluation."""
    report: Progress = progress or (lambda s, f: None)
    t0 = time.perf_counter()
    resolved = resolve(model, progress)
    # its checkpoint writer undoes the Llama layer's layout
    load_config(resolved.folder).require_plain_layers("veil privatize")
    am = AuditModel(resolved)
    cfg, n = am.config, am.n_layers
    if head < 1 or tail < 1 or head + tail >= n:
        raise SplitError(f"privatize needs 1 <= head, 1 <= tail and head + tail < {n}")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    ns = (24, 24, 32) if quick else (80, 80, 48)
    train, test = corpus(am, seed, *ns)
    head_ids = list(range(head))
    tail_ids = list(range(n - tail, n))
    priv = {i: trainable_copy(am.layers[i]) for i in head_ids + tail_ids}
    opt = torch.optim.AdamW(params(list(priv.values())), lr=lr, weight_decay=0.0)
    inv = am.stacks[0].inv_freq
    embed = am.embed_weight.detach()
    pub_seq = [(i, am.layers[i]) for i in range(n)]
    log = []
    for step in range(steps):
        if cancel is not None and cancel():
            raise Cancelled("privatize cancelled")
        d = train[int(torch.randint(len(train), (1,), generator=g))]
        ids = torch.tensor(d.ids)  # [T]
        x0 = embed[ids]  # [T, H]
        with torch.no_grad():
            h_pub = run_layers(x0, pub_seq[:head], cfg, inv)  # [T, H]
            teacher = am.client.logits(run_layers(h_pub, pub_seq[head:], cfg, inv))  # [T, V]
        with torch.enable_grad():
            h = run_layers(x0, [(i, priv[i]) for i in head_ids], cfg, inv)  # [T, H]
            mid = run_layers(h, pub_seq[head : n - tail], cfg, inv)
            out = run_layers(mid, [(i, priv[i]) for i in tail_ids], cfg, inv)
            logits = am.client.logits(out)  # [T, V]
            kl = F.kl_div(
                F.log_softmax(logits, -1),
                F.log_softmax(teacher, -1),
                log_target=True,
                reduction="batchmean",
            )
            dist = (h - h_pub).norm(dim=-1) / h_pub.norm(dim=-1).clamp_min(1e-6)  # [T]
            push = F.relu(margin - dist).mean()
            loss = kl + weight * push
            opt.zero_grad()
            loss.backward()
            opt.step()
        log.append({"step": step, "kl": float(kl.detach()), "dist": float(dist.detach().mean())})
        report("privatize: training", (step + 1) / steps)
    tensors: dict[str, torch.Tensor] = {}
    for i, w in priv.items():
        tensors.update(to_checkpoint(w, i, cfg))
    info = {
        "head": head,
        "tail": tail,
        "steps": steps,
        "lr": lr,
        "margin": margin,
        "weight": weight,
        "seed": seed,
    }
    save_overlay(out_path, tensors, cfg, info)
    frozen = {i: map_weights(w, lambda t: t.detach()) for i, w in priv.items()}
    result = evaluate(am, frozen, head, tail, train, test, seed, report, quick)
    result.update(
        {
            "model": resolved.name,
            "file": str(out_path),
            "settings": info,
            "train_log": log[:: max(1, steps // 20)],
            "seconds": round(time.perf_counter() - t0, 1),
        }
    )
    return result


@torch.inference_mode()
def evaluate(
    am: AuditModel,
    priv: dict[int, LayerWeights],
    head: int,
    tail: int,
    train: Sequence[Document],
    test: Sequence[Document],
    seed: int,
    report: Progress,
    quick: bool = False,
) -> dict[str, Any]:
    """Attacks by a server with the public weights against the private head, and quality."""
    cfg, n = am.config, am.n_layers
    report("privatize: evaluating", 0.0)
    pub_head = am.stack(0, head)
    tr_states: list[torch.Tensor] = []
    for d in train:  # the public head's output is all the attacker trains on
        pub_head.reset()
        x = am.client.embed(torch.tensor(d.ids))  # [T, H]
        tr_states.append(pub_head.forward(x, torch.arange(len(d.ids))))
    ids_tr = [torch.tensor(d.ids) for d in train]
    ids_te = [torch.tensor(d.ids) for d in test]
    pii_te = [torch.tensor(d.pii_mask, dtype=torch.bool) for d in test]
    ridge = A.RidgeDecoder(torch.cat(tr_states), torch.cat(ids_tr))
    ereg = A.EmbeddingRegressor(torch.cat(tr_states), torch.cat(ids_tr), am.embed_weight)
    p_head = LayerStack(cfg, 0, [priv[i] for i in range(head)])
    p_tail = LayerStack(cfg, n - tail, [priv[i] for i in range(n - tail, n)])
    pub_trunk = am.stack(head, n - tail)
    pub_tail = am.stack(n - tail, n)
    sipit_docs = 4 if quick else 16
    rows: dict[str, Any] = {}
    for label, stack in (("public", pub_head), ("private", p_head)):
        obs = []
        for d in test:
            stack.reset()
            obs.append(
                stack.forward(am.client.embed(torch.tensor(d.ids)), torch.arange(len(d.ids)))
            )
        near = A.nearest_embedding(obs, am.embed_weight, 32)
        rr = [ridge.ranked(s, 32) for s in obs]
        er = [ereg.ranked(s, 32) for s in obs]
        res = {
            "nearest_embedding": score([r[:, :5] for r in near], ids_te, pii_te, seed),
            "ridge_trained_on_public": score([r[:, :5] for r in rr], ids_te, pii_te, seed),
            "ridge_embedding_trained_on_public": score(
                [r[:, :5] for r in er], ids_te, pii_te, seed
            ),
        }
        sub = list(range(min(sipit_docs, len(test))))
        inv = [
            A.invert_known_weights(
                pub_head, am.embed_weight, obs[j], A.candidate_order_fn(rr[j], er[j], near[j])
            )
            for j in sub
        ]
        kw = score([r.top5 for r in inv], [ids_te[j] for j in sub], [pii_te[j] for j in sub], seed)
        kw["verified_exact"] = float(torch.cat([r.verified for r in inv]).float().mean())
        res["known_weights"] = kw
        rows[label] = res
        report("privatize: evaluating", 0.5 if label == "public" else 0.8)
    # quality and the output side
    nll_p = nll_q = 0.0
    agree = read_out = cnt = 0
    for d in test:
        ids = torch.tensor(d.ids)
        pos = torch.arange(len(d.ids))
        x = am.client.embed(ids)
        for s in (pub_head, pub_trunk, pub_tail, p_head, p_tail):
            s.reset()
        pub = am.client.logits(
            pub_tail.forward(pub_trunk.forward(pub_head.forward(x, pos), pos), pos)
        )
        pub_trunk.reset()
        mid = pub_trunk.forward(p_head.forward(x, pos), pos)  # what the server computes
        prv = am.client.logits(p_tail.forward(mid, pos))
        pub_tail.reset()
        server_guess = am.client.logits(pub_tail.forward(mid, pos)).argmax(-1)  # public tail
        tgt = ids[1:]
        nll_p += float(F.cross_entropy(pub[:-1], tgt, reduction="sum"))
        nll_q += float(F.cross_entropy(prv[:-1], tgt, reduction="sum"))
        agree += int((pub.argmax(-1) == prv.argmax(-1)).sum())
        read_out += int((server_guess == prv.argmax(-1)).sum())
        cnt += len(ids)
    n_pred = cnt - len(test)
    report("privatize: evaluating", 1.0)
    return {
        "attacks": rows,
        "quality": {
            "perplexity_public": math.exp(nll_p / n_pred),
            "perplexity_private": math.exp(nll_q / n_pred),
            "greedy_agreement": agree / cnt,
        },
        "output_side_public_tail_reads_private_next_token": read_out / cnt,
        "test_docs": len(test),
        "test_tokens": cnt,
    }
