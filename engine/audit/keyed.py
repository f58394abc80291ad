"""`run_keyed_audit`: the privacy audit of an organisation-keyed split (docs/privacy.md).

The auditor is the organisation: it holds the key, builds the keyed trunk for each noise
level, and produces what the trunk operator would see (keyed head outputs and keyed trunk
outputs). Everything the attacker does goes through :mod:`engine.keyed.attacks` with only
public weights, keyed trunk weights, observed keyed states and the chat template — the key
and transform stay in this module (used for building what is observed, for quality, and to
report how far each attacker estimate ``q_hat`` is from the true ``q``).

Traffic the attacker observes (its budget, the same for every attack): the held-out test
documents, and each of them once more as a chat conversation (chat template with its default
system prompt, user text = the document's text), i.e. 2 x the test documents.

Each estimate ``q_hat`` turns the observed states back, and the plain audit's attacks
(:func:`engine.audit.runner.run_audit`) follow on the sides it runs them, named
``"<estimate>+<plain attack>"``: nearest_embedding, ridge, ridge_embedding, mlp (the plain
decoder trained on public states) and known_weights on the input side; logit_lens,
public_tail and ridge on the output side. The frequency prior needs no q and is scored once
per depth and noise level as ``"prior"``; ``best`` is the top row over all of them.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.audit import attacks as A
from engine.audit.collect import AuditModel, collect, logits_from
from engine.audit.corpus import Document
from engine.audit.metrics import score
from engine.audit.report import pct
from engine.audit.runner import QUICK, AuditSettings, audit_depths, build_corpus
from engine.chat import messages_for, prompt_ids
from engine.errors import Cancelled, SplitError
from engine.keyed import attacks as KA
from engine.keyed import audit_name
from engine.keyed.transform import OrgKey, check_supported, derive, key_layers
from engine.keyed.trunk import public_model_fp
from engine.loading import Progress, ResolvedModel, WeightReader, resolve
from engine.model import LayerStack

SCHEMA_VERSION = 1
DEFAULT_NOISES = (0.0, 0.01, 0.03, 0.1)
VOCAB_STAGES = (32, 96, 384)  # vocabulary matching: at most 512 candidates per position
VOCAB_STAGES_QUICK = (32, 96)


def _cat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(xs))


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def _common_suffix(seqs: Sequence[Sequence[int]], prefix: int) -> int:
    n = min(len(s) for s in seqs) - prefix
    for i in range(n):
        if any(s[-1 - i] != seqs[0][-1 - i] for s in seqs):
            return i
    return max(0, n)


def conversations(am: AuditModel, docs: Sequence[Document], max_tokens: int) -> list[list[int]]:
    """Each document's text (first ``max_tokens`` tokens) as a chat prompt with the template's
    default system prompt."""
    tok = am.tokenizer
    out = []
    for d in docs:
        ids = d.ids[: d.generated_from] if d.generated_from > 0 else d.ids[:max_tokens]
        text = tok.decode(ids, skip_special_tokens=True)
        out.append(prompt_ids(tok, messages_for(text)))
    return out


def template_pairs(
    am: AuditModel,
    public_convs: Sequence[Sequence[int]],
    observed_convs: Sequence[Sequence[int]],
    layer: int,
    observed: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Known-plaintext pairs at ``layer`` (attacker side): the template prefix is identical in
    every conversation (exact public state); the template tokens after the user's text get the
    mean public state of the attacker's own conversations (approximate).
    Returns (public [N, H], observed [N, H], tokens [N]); ``observed_convs`` only gives the
    template's length (the attacker sees how many positions each conversation has)."""
    allc = list(public_convs) + list(observed_convs)
    pre = _common_prefix(allc)
    suf = _common_suffix(allc, pre)
    pub_rows, obs_rows, toks = [], [], []
    if pre:
        st = am.states(allc[0][:pre], [layer], logits=False)[layer]  # [pre, H]
    suffix_mean = None
    if suf:
        acc = torch.zeros(suf, am.config.hidden_size)
        for c in public_convs:
            acc += am.states(c, [layer], logits=False)[layer][-suf:]
        suffix_mean = acc / max(1, len(public_convs))
    for c, o in zip(observed_convs, observed, strict=True):
        if pre:
            pub_rows.append(st)
            obs_rows.append(o[:pre])
            toks += list(c[:pre])
        if suffix_mean is not None:
            pub_rows.append(suffix_mean)
            obs_rows.append(o[len(c) - suf :])
            toks += list(c[len(c) - suf :])
    if not pub_rows:
        h = am.config.hidden_size
        return torch.zeros(0, h), torch.zeros(0, h), torch.zeros(0, dtype=torch.long)
    return _cat(pub_rows), _cat(obs_rows), torch.tensor(toks, dtype=torch.long)


def run_keyed_audit(
    model: str | ResolvedModel,
    ks: Sequence[int],
    key: OrgKey,
    out_dir: str | Path | None,
    noises: Sequence[float] = DEFAULT_NOISES,
    quick: bool = False,
    progress: Progress | None = None,
    cancel: Callable[[], bool] | None = None,
    *,
    seed: int = 0,
    settings: AuditSettings | None = None,
    save: bool = True,
    threads: int | None = None,
) -> dict[str, Any]:
    """Audit the keyed split of ``model`` at depths ``ks`` and keyed-trunk noise levels
    ``noises``; returns the results (stored under ``audit_name(model, key.key_id)`` when
    ``save``, written to ``out_dir`` when given)."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(model, ks, key, out_dir, noises, quick, progress, cancel, seed, settings, save)
    finally:
        torch.set_num_threads(old)


def _run(
    model: str | ResolvedModel,
    ks: Sequence[int],
    key: OrgKey,
    out_dir: str | Path | None,
    noises: Sequence[float],
    quick: bool,
    progress: Progress | None,
    cancel: Callable[[], bool] | None,
    seed: int,
    settings: AuditSettings | None,
    save: bool,
) -> dict[str, Any]:
    t_start = time.perf_counter()
    st = settings or (QUICK if quick else AuditSettings())
    report: Progress = progress or (lambda stage, frac: None)

    def check() -> None:
        if cancel is not None and cancel():
            raise Cancelled("privacy audit cancelled")

    resolved = model if isinstance(model, ResolvedModel) else resolve(model, progress)
    am = AuditModel(resolved)
    cfg = am.config
    check_supported(cfg)
    n = am.n_layers
    ks = audit_depths(n, ks)
    noises = sorted(set(float(s) for s in noises))
    if not noises or any(s < 0 or not math.isfinite(s) for s in noises):
        raise SplitError("keyed noise levels must be finite and >= 0")
    torch.manual_seed(seed)
    _, train, test = build_corpus(am, st, seed, check, report)
    layers = sorted({k for k in ks} | {n - k for k in ks})
    check()
    tr_states, _ = collect(am, train, layers, logits=False)
    te_states, _ = collect(am, test, layers, logits=False)
    obs_convs = conversations(am, test, st.max_tokens)
    pub_convs = conversations(am, train, st.max_tokens)
    conv_docs = [
        Document(f"chat-{d.doc_id}", d.source, "", ids=c)
        for d, c in zip(test, obs_convs, strict=True)
    ]
    cv_states, _ = collect(am, conv_docs, layers, logits=False)
    ids_tr = [torch.tensor(d.ids) for d in train]
    ids_te = [torch.tensor(d.ids) for d in test]
    pii_te = [torch.tensor(d.pii_mask, dtype=torch.bool) for d in test]
    embed = am.embed_weight
    freq = torch.bincount(_cat(ids_tr), minlength=cfg.vocab_size).argsort(descending=True)
    # the fingerprint `veil-trunk keyed-model prepare` keys this model with: the audit measures
    # the transform the organisation deploys (same key, model and split -> the same q)
    model_fp = public_model_fp(WeightReader(resolved.folder))
    results: list[dict[str, Any]] = []
    quality: list[dict[str, Any]] = []
    timing: dict[str, float] = {}
    sip = list(range(min(st.sipit_docs, len(test))))
    q_docs = list(range(min(st.quality_docs, len(test))))
    steps, step = len(ks) * len(noises), 0

    for k in ks:
        lo = n - k
        pub_layers = [am.layers[i] for i in range(k, lo)]
        clean = [logits_from(am, k, te_states[k][j]) for j in q_docs]
        x_tr = _cat(tr_states[k])
        y_tr = _cat(ids_tr)
        ridge = A.RidgeDecoder(x_tr, y_tr)
        ereg = A.EmbeddingRegressor(x_tr, y_tr, embed)
        o_tr = _cat([s[:-1] for s in tr_states[lo]])
        oridge = A.RidgeDecoder(o_tr, _cat([t[1:] for t in ids_tr]))
        y_o = [t[1:] for t in ids_te]
        p_o = [p[1:] for p in pii_te]
        depth = sum(st.sipit_stages) + st.sipit_fallback
        # the plain audit's attacks that need no q (the frequency prior) or are trained once on
        # public states (its MLP decoder, applied below to each estimate's turned-back states)
        prior_in = A.prior_top5(ids_tr)
        prior_out = A.prior_top5([t[1:] for t in ids_tr])
        tm = time.perf_counter()
        plain_mlp = A.MLPDecoder(
            x_tr, y_tr, seed, hidden=st.mlp_hidden, epochs=st.mlp_epochs, cancel=cancel
        )
        timing[f"plain_attacks_k{k}"] = time.perf_counter() - tm
        for s in noises:
            t0 = time.perf_counter()
            report(f"keyed audit: k={k}, noise {s:g}", step / steps)
            check()
            # --- the organisation builds the keyed trunk and the traffic the server sees ----
            tf = derive(key, cfg, model_fp, k, lo, s)
            keyed = key_layers(pub_layers, cfg, tf, key, model_fp)
            trunk = LayerStack(cfg, k, keyed)

            def serve(h: torch.Tensor, trunk: LayerStack = trunk) -> torch.Tensor:
                trunk.reset()
                out = trunk.forward(h, torch.arange(h.shape[0]))
                trunk.reset()
                return out

            with torch.inference_mode():
                obs_in = [tf.rotate_in(x) for x in te_states[k]]
                obs_out = [serve(x) for x in obs_in]
                cv_in = [tf.rotate_in(x) for x in cv_states[k]]
                cv_out = [serve(x) for x in cv_in]
            # quality: the keyed pipeline vs the plain model
            nll = nll_plain = 0.0
            agree = cnt = 0
            for j, cl in zip(q_docs, clean, strict=True):
                lg = logits_from(am, lo, tf.rotate_out(obs_out[j]))
                tgt = ids_te[j][1:]
                nll += float(F.cross_entropy(lg[:-1], tgt, reduction="sum"))
                nll_plain += float(F.cross_entropy(cl[:-1], tgt, reduction="sum"))
                agree += int((lg.argmax(-1) == cl.argmax(-1)).sum())
                cnt += len(tgt)
            quality.append(
                {
                    "k": k,
                    "noise": s,
                    "greedy_agreement": agree / (cnt + len(q_docs)),
                    "perplexity": math.exp(nll / cnt),
                    "perplexity_plain": math.exp(nll_plain / cnt),
                    "n_docs": len(q_docs),
                }
            )

            def add(
                attack: str,
                side: str,
                top5: Sequence[torch.Tensor],
                extra: dict[str, Any],
                sub: Sequence[int] | None = None,
                k: int = k,
                s: float = s,
                y_o: list[torch.Tensor] = y_o,
                p_o: list[torch.Tensor] = p_o,
            ) -> None:
                idx = list(range(len(test))) if sub is None else list(sub)
                tg = ids_te if side == "input" else y_o
                pi = pii_te if side == "input" else p_o
                row: dict[str, Any] = {"k": k, "noise": s, "attack": attack, "side": side}
                row.update(score(top5, [tg[j] for j in idx], [pi[j] for j in idx], seed, st.n_boot))
                if side == "output":  # the model's own reply: what it is about to generate
                    gen = [
                        (torch.arange(len(tg[j])) + 1 >= test[j].generated_from)
                        if test[j].generated_from >= 0
                        else torch.zeros(len(tg[j]), dtype=torch.bool)
                        for j in idx
                    ]
                    if any(bool(g.any()) for g in gen):
                        tgt = [tg[j] for j in idx]
                        g = score(top5, tgt, [pi[j] for j in idx], seed, st.n_boot, subset=gen)
                        row["top1_generated"] = g["top1"]
                        row["top1_generated_ci"] = g["top1_ci"]
                row.update(extra)
                results.append(row)

            # --- the frequency prior: the floor, no q at all ---------------------------------
            tp = time.perf_counter()
            add("prior", "input", [prior_in.expand(len(t), -1) for t in ids_te], {})
            add("prior", "output", [prior_out.expand(len(t), -1) for t in y_o], {})
            timing[f"plain_attacks_k{k}"] += time.perf_counter() - tp
            # --- the attacker: estimates of q ------------------------------------------------
            est: dict[str, torch.Tensor] = {}
            ta = time.perf_counter()
            al = KA.align_weights(pub_layers, keyed, cfg)
            est["weight_alignment"] = al.q_hat
            timing[f"align_k{k}_n{s:g}"] = time.perf_counter() - ta
            est["gram_eigen"] = KA.gram_eigen(pub_layers, keyed, cfg)
            pairs_in = template_pairs(am, pub_convs, obs_convs, k, cv_in)
            pairs_out = template_pairs(am, pub_convs, obs_convs, lo, cv_out)
            if len(pairs_in[0]) + len(pairs_out[0]) >= 2:
                est["known_plaintext"] = KA.procrustes(
                    torch.cat([pairs_in[0], pairs_out[0]]), torch.cat([pairs_in[1], pairs_out[1]])
                )
            est["distribution_match"] = KA.distribution_match(x_tr, _cat(obs_in + cv_in))
            for name, qh in est.items():
                check()
                report(f"keyed audit: k={k}, noise {s:g}: {name}", step / steps)
                qf = qh.float()
                info = {
                    "rotation_error": KA.rotation_error(qh, tf.q),
                    "n_conversations": 2 * len(test),
                }
                if name == "known_plaintext":
                    info["known_pairs"] = len(pairs_in[0]) + len(pairs_out[0])
                un_in = [x @ qf.T for x in obs_in]
                un_out = [x @ qf.T for x in obs_out]
                near = A.nearest_embedding(un_in, embed, 32)
                tp = time.perf_counter()
                add(f"{name}+nearest_embedding", "input", [r[:, :5] for r in near], info)
                t_plain = time.perf_counter() - tp
                rr = [ridge.ranked(x, 32) for x in un_in]
                er = [ereg.ranked(x, depth) for x in un_in]
                add(f"{name}+ridge", "input", [r[:, :5] for r in rr], info)
                add(f"{name}+ridge_embedding", "input", [r[:, :5] for r in er], info)
                tp = time.perf_counter()
                add(f"{name}+mlp", "input", [plain_mlp.ranked(x, 5) for x in un_in], info)
                t_plain += time.perf_counter() - tp
                inv = []
                fallback = st.sipit_fallback
                for j in sip:
                    inv.append(
                        A.invert_known_weights(
                            am.stack(0, k),
                            embed,
                            un_in[j],
                            A.candidate_order_fn(rr[j], er[j], near[j]),
                            st.sipit_stages,
                            fallback=fallback,
                        )
                    )
                    # the attacker's own check, no labels: a q_hat under which not one
                    # position of the first document re-runs to the observed state is wrong;
                    # the extra candidates would be wasted on it
                    if len(inv) == 1 and not bool(inv[0].verified.any()):
                        fallback = 0
                info_inv = {**info, "fallback_used": fallback}
                ver = float(_cat([r.verified for r in inv]).float().mean())
                add(
                    f"{name}+known_weights",
                    "input",
                    [r.top5 for r in inv],
                    {**info_inv, "verified_exact": ver},
                    sip,
                )
                tp = time.perf_counter()
                lens = A.logit_lens(
                    [x[:-1] for x in un_out], am.client.norm_weight, am.client.lm_head, cfg.rms_eps
                )
                add(f"{name}+logit_lens", "output", lens, info)
                t_plain += time.perf_counter() - tp
                timing[f"plain_attacks_k{k}"] += t_plain
                tail = [logits_from(am, lo, x)[:-1].topk(5, dim=-1).indices for x in un_out]
                add(f"{name}+public_tail", "output", tail, info)
                add(f"{name}+ridge", "output", [oridge.ranked(x[:-1], 5) for x in un_out], info)
            # --- vocabulary matching: no q at all ------------------------------------------
            check()
            report(f"keyed audit: k={k}, noise {s:g}: vocabulary matching", step / steps)
            order: list[int] = freq.tolist()

            def by_frequency(_t: int, order: list[int] = order) -> list[int]:
                return order

            vstages = VOCAB_STAGES_QUICK if quick else VOCAB_STAGES
            vm = [
                KA.vocabulary_match(am.stack(0, k), embed, obs_in[j], by_frequency, vstages)
                for j in sip
            ]
            add(
                "vocabulary_match",
                "input",
                [r.top5 for r in vm],
                {
                    "verified_exact": float(_cat([r.verified for r in vm]).float().mean()),
                    "candidates_max": sum(vstages),
                },
                sip,
            )
            # --- learned inverter on keyed-basis data the attacker can make ------------------
            qb = al.q_hat.float()
            xs = [x_tr @ qb]
            ys = [y_tr]
            if len(pairs_in[1]):
                xs.append(pairs_in[1])
                ys.append(pairs_in[2])
            mlp = A.MLPDecoder(
                _cat(xs), _cat(ys), seed, hidden=st.mlp_hidden, epochs=st.mlp_epochs, cancel=cancel
            )
            add(
                "learned_inverter",
                "input",
                [mlp.ranked(x, 5) for x in obs_in],
                {"trained_on": "public states @ q_hat(weight_alignment) + template pairs"},
            )
            timing[f"k{k}_noise{s:g}"] = time.perf_counter() - t0
            step += 1

    best = []
    for k in ks:
        for s in noises:
            for side in ("input", "output"):
                rows = [r for r in results if r["k"] == k and r["noise"] == s and r["side"] == side]
                b = max(rows, key=lambda r: r["top1"])
                best.append(
                    {
                        "k": k,
                        "noise": s,
                        "side": side,
                        "attack": b["attack"],
                        "top1": b["top1"],
                        "top1_ci": b["top1_ci"],
                        "top5": b["top5"],
                        "pii_top1": b["pii_top1"],
                    }
                )
    timing["total"] = time.perf_counter() - t_start
    out: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "model": audit_name(resolved.name, key.key_id),
        "base_model": resolved.name,
        "keyed": True,
        "key_id": key.key_id,
        "model_fp": model_fp,
        "noise": noises,
        "quality": quality,
        "best": best,
        "date": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        "n_layers": n,
        "ks": ks,
        "seed": seed,
        "quick": quick,
        "settings": asdict(st),
        "budget": {"conversations": 2 * len(test), "sipit_docs": len(sip)},
        "data": {
            "train_docs": len(train),
            "test_docs": len(test),
            "train_tokens": sum(len(d.ids) for d in train),
            "test_tokens": sum(len(d.ids) for d in test),
            "test_ids": [d.doc_id for d in test],
        },
        "results": results,
        "timing_s": {k: round(v, 2) for k, v in timing.items()},
    }
    report("keyed audit: writing results", 1.0)
    from engine.audit.store import results_dir, save_results

    files: dict[str, Path] = {}
    target = Path(out_dir) if out_dir is not None else (results_dir(out["model"]) if save else None)
    if target is not None:
        target.mkdir(parents=True, exist_ok=True)
        files = {"results.json": target / "results.json", "report.md": target / "report.md"}
        files["results.json"].write_text(json.dumps(out, indent=1), encoding="utf-8")
        files["report.md"].write_text(keyed_report(out), encoding="utf-8")
    if save:
        save_results(out, files)
    return out


def keyed_report(res: dict[str, Any]) -> str:
    """A markdown summary: best attack per k and noise level, quality, every attack."""
    lines = [
        f"# Keyed-split privacy audit: {res['base_model']} (key {res['key_id']})",
        "",
        f"{res['date']} · {res['data']['test_docs']} held-out documents · "
        f"attacker budget {res['budget']['conversations']} observed conversations",
        "",
        "## Best attack per depth and noise (top-1 token recovery, 95% CI)",
        "",
        "| k | noise | side | best attack | top-1 | 95% CI | top-5 | personal data top-1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in res["best"]:
        lo, hi = b["top1_ci"]
        lines.append(
            f"| {b['k']} | {b['noise']:g} | {b['side']} | {b['attack']} | {pct(b['top1'])} | "
            f"{pct(lo)}–{pct(hi)} | {pct(b['top5'])} | {pct(b['pii_top1'])} |"
        )
    lines += [
        "",
        "## Quality of the keyed model vs the plain model",
        "",
        "| k | noise | greedy agreement | perplexity | plain perplexity |",
        "|---|---|---|---|---|",
    ]
    for q in res["quality"]:
        lines.append(
            f"| {q['k']} | {q['noise']:g} | {pct(q['greedy_agreement'])} | "
            f"{q['perplexity']:.2f} | {q['perplexity_plain']:.2f} |"
        )
    lines += [
        "",
        "## Every attack",
        "",
        "| k | noise | side | attack | top-1 | 95% CI | q error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["results"]:
        lo, hi = r["top1_ci"]
        qe = r.get("rotation_error")
        lines.append(
            f"| {r['k']} | {r['noise']:g} | {r['side']} | {r['attack']} | {pct(r['top1'])} | "
            f"{pct(lo)}–{pct(hi)} | {'' if qe is None else f'{qe:.2g}'} |"
        )
    return "\n".join(lines) + "\n"
