"""`run_audit`: collect what the server sees, run every attack at every split depth, measure
the noise defense, and write results.json, a plot and a plain-language report."""

from __future__ import annotations

import datetime as _dt
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.audit import attacks as A
from engine.audit.collect import AuditModel, add_generated_replies, collect, logits_from
from engine.audit.corpus import (
    Document,
    pii_documents,
    prompt_documents,
    split_by_document,
    stdlib_texts,
    tokenize,
)
from engine.audit.metrics import score
from engine.errors import Cancelled, SplitError
from engine.loading import Progress, ResolvedModel, resolve

SCHEMA_VERSION = 1


@dataclass
class AuditSettings:
    n_stdlib: int = 80
    n_pii: int = 80
    n_generated: int = 10
    max_tokens: int = 48
    gen_new_tokens: int = 32
    test_fraction: float = 0.25
    mlp_epochs: int = 6
    mlp_hidden: int = 256
    sipit_docs: int = 16
    sipit_stages: tuple[int, ...] = (1, 7, 24, 32)
    sipit_fallback: int = 192
    noise_sigmas: tuple[float, ...] = (0.0, 0.1, 0.3, 1.0)
    noise_sipit_docs: int = 4
    quality_docs: int = 8
    n_boot: int = 1000
    extra: dict[str, Any] = field(default_factory=dict)


QUICK = AuditSettings(
    n_stdlib=24,
    n_pii=24,
    n_generated=4,
    max_tokens=32,
    gen_new_tokens=12,
    mlp_epochs=5,
    mlp_hidden=192,
    sipit_docs=4,
    sipit_stages=(1, 7, 24),
    sipit_fallback=0,
    noise_sigmas=(0.0, 0.3),
    noise_sipit_docs=2,
    quality_docs=4,
    n_boot=300,
)


def deepest_sending_depth(n_layers: int) -> int:
    """The largest k at which a symmetric split still sends something to a server.

    With k layers at each end the server runs layers [k, L - k); from k = L/2 (rounded up) on
    that range is empty, the model runs fully locally and there is nothing to attack, so the
    audit never measures such a depth."""
    return max(0, (n_layers - 1) // 2)


def audit_depths(n_layers: int, ks: Sequence[int]) -> list[int]:
    """The split depths to audit, sorted and checked against what a model of ``n_layers``
    sends at all."""
    top = deepest_sending_depth(n_layers)
    depths = sorted(set(int(k) for k in ks))
    if not depths or any(not 1 <= k <= top for k in depths):
        raise SplitError(
            f"audit depths must be between 1 and {top} for this model, got {depths}",
            hint=f"at k >= {(n_layers + 1) // 2} all {n_layers} layers run locally and nothing "
            "is sent",
        )
    return depths


def _cat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(xs))


def run_audit(
    model: str | ResolvedModel,
    ks: Sequence[int],
    out_dir: str | Path | None,
    quick: bool = False,
    progress: Progress | None = None,
    cancel: Callable[[], bool] | None = None,
    *,
    seed: int = 0,
    settings: AuditSettings | None = None,
    noise_k: int | None = None,
    save: bool = True,
    threads: int | None = None,
) -> dict[str, Any]:
    """Run the privacy audit; returns the results dict (also written to ``out_dir`` if given,
    and stored as the model's latest audit when ``save``). ``progress(stage, fraction)`` is
    called along the way; ``cancel()`` returning True stops it with :class:`Cancelled`.
    Safe to call from a background thread (no Qt). ``threads`` sets torch's (process-wide)
    thread count for the duration; None leaves it alone."""
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run_audit(
            model, ks, out_dir, quick, progress, cancel, seed, settings, noise_k, save
        )
    finally:
        torch.set_num_threads(old_threads)


def _run_audit(
    model: str | ResolvedModel,
    ks: Sequence[int],
    out_dir: str | Path | None,
    quick: bool,
    progress: Progress | None,
    cancel: Callable[[], bool] | None,
    seed: int,
    settings: AuditSettings | None,
    noise_k: int | None,
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
    n = am.n_layers
    ks = audit_depths(n, ks)
    noise_k = noise_k if noise_k is not None else (2 if 2 in ks else ks[0])
    if noise_k not in ks:
        raise SplitError(f"noise depth {noise_k} is not among the audited depths {ks}")
    torch.manual_seed(seed)

    # --- corpus -------------------------------------------------------------------------
    docs, train, test = build_corpus(am, st, seed, check, report)

    # --- what the server sees ------------------------------------------------------------
    layers = sorted({k for k in ks} | {n - k for k in ks} | {noise_k})
    check()
    tr_states, _ = collect(
        am, train, layers, lambda f: report("audit: collecting states", f / 2), logits=False
    )
    check()
    te_states, te_top5 = collect(
        am, test, layers, lambda f: report("audit: collecting states", 0.5 + f / 2)
    )
    ids_tr = [torch.tensor(d.ids) for d in train]
    ids_te = [torch.tensor(d.ids) for d in test]
    pii_te = [torch.tensor(d.pii_mask, dtype=torch.bool) for d in test]
    results: list[dict[str, Any]] = []
    timing: dict[str, float] = {}
    cfg = am.config
    embed = am.embed_weight

    def add(
        k: int,
        attack: str,
        side: str,
        top5: Sequence[torch.Tensor],
        tgt: Any,
        pii: Any,
        extra: dict[str, Any] | None = None,
        docs_: Sequence[Document] = test,
    ) -> None:
        row: dict[str, Any] = {"k": k, "attack": attack, "side": side}
        row.update(score(top5, tgt, pii, seed, st.n_boot))
        if side == "output":
            gen_sub = [
                (torch.arange(len(t)) + 1 >= d.generated_from)
                if d.generated_from >= 0
                else torch.zeros(len(t), dtype=torch.bool)
                for t, d in zip(tgt, docs_, strict=True)
            ]
            if any(bool(g.any()) for g in gen_sub):
                g = score(top5, tgt, pii, seed, st.n_boot, subset=gen_sub)
                row["top1_generated"] = g["top1"]
                row["top1_generated_ci"] = g["top1_ci"]
        row.update(extra or {})
        results.append(row)

    steps = len(ks) * 2 + 1
    step = 0
    for k in ks:
        # --- input side: the head's output, target = the token itself ---------------------
        t0 = time.perf_counter()
        report(f"audit: attacks at k={k} (input)", step / steps)
        x_tr, y_tr = _cat(tr_states[k]), _cat(ids_tr)
        obs = te_states[k]
        prior = A.prior_top5(ids_tr)
        add(k, "prior", "input", [prior.expand(len(t), -1) for t in ids_te], ids_te, pii_te)
        near = A.nearest_embedding(obs, embed, 32)
        add(k, "nearest_embedding", "input", [r[:, :5] for r in near], ids_te, pii_te)
        check()
        ridge = A.RidgeDecoder(x_tr, y_tr)
        ridge_rank = [ridge.ranked(s, 32) for s in obs]
        add(k, "ridge", "input", [r[:, :5] for r in ridge_rank], ids_te, pii_te)
        check()
        ereg = A.EmbeddingRegressor(x_tr, y_tr, embed)
        depth = sum(st.sipit_stages) + st.sipit_fallback
        emb_rank = [ereg.ranked(s, depth) for s in obs]
        add(k, "ridge_embedding", "input", [r[:, :5] for r in emb_rank], ids_te, pii_te)
        check()
        mlp = A.MLPDecoder(
            x_tr, y_tr, seed, hidden=st.mlp_hidden, epochs=st.mlp_epochs, cancel=cancel
        )
        check()
        add(k, "mlp", "input", [mlp.ranked(s, 5) for s in obs], ids_te, pii_te)
        head = am.stack(0, k)
        inv = []
        sub = list(range(min(st.sipit_docs, len(test))))
        for j in sub:
            check()
            inv.append(
                A.invert_known_weights(
                    head,
                    embed,
                    obs[j],
                    A.candidate_order_fn(ridge_rank[j], emb_rank[j], near[j]),
                    st.sipit_stages,
                    fallback=st.sipit_fallback,
                )
            )
        ver = torch.cat([r.verified for r in inv])
        marg = torch.cat([r.margin for r in inv])
        fin = marg[torch.isfinite(marg)]
        hits = torch.cat([r.top5[:, 0] == ids_te[j] for r, j in zip(inv, sub, strict=True)])
        add(
            k,
            "known_weights",
            "input",
            [r.top5 for r in inv],
            [ids_te[j] for j in sub],
            [pii_te[j] for j in sub],
            {
                "verified_exact": float(ver.float().mean()),
                "verified_correct": float((ver & hits).float().mean()),
                "best_guess_unverified_correct": float((~ver & hits).float().mean()),
                "margin_median": float(fin.median()) if len(fin) else None,
                "candidates_max": sum(st.sipit_stages) + st.sipit_fallback,
                "candidates_mean": float(sum(sum(r.tried) for r in inv) / max(1, len(ver))),
            },
            [test[j] for j in sub],
        )
        timing[f"input_k{k}"] = time.perf_counter() - t0
        step += 1

        # --- output side: the trunk's output, target = the next token ---------------------
        t0 = time.perf_counter()
        report(f"audit: attacks at k={k} (output)", step / steps)
        lo = n - k
        o_tr = [s[:-1] for s in tr_states[lo]]
        o_te = [s[:-1] for s in te_states[lo]]
        y_o_tr = [t[1:] for t in ids_tr]
        y_o_te = [t[1:] for t in ids_te]
        p_o_te = [p[1:] for p in pii_te]
        oprior = A.prior_top5(y_o_tr)
        add(k, "prior", "output", [oprior.expand(len(t), -1) for t in y_o_te], y_o_te, p_o_te)
        lens = A.logit_lens(o_te, am.client.norm_weight, am.client.lm_head, cfg.rms_eps)
        add(k, "logit_lens", "output", lens, y_o_te, p_o_te)
        oridge = A.RidgeDecoder(_cat(o_tr), _cat(y_o_tr))
        add(k, "ridge", "output", [oridge.ranked(s, 5) for s in o_te], y_o_te, p_o_te)
        add(k, "public_tail", "output", [t[:-1] for t in te_top5], y_o_te, p_o_te)
        timing[f"output_k{k}"] = time.perf_counter() - t0
        step += 1

    # --- defense: calibrated Gaussian noise on the head's output ---------------------------
    t0 = time.perf_counter()
    noise_rows = noise_sweep(
        am,
        train,
        test,
        tr_states,
        te_states,
        ids_tr,
        ids_te,
        pii_te,
        noise_k,
        st,
        seed,
        check,
        lambda f: report("audit: noise defense", (step + f) / steps),
    )
    timing["noise"] = time.perf_counter() - t0
    timing["total"] = time.perf_counter() - t_start

    out: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "model": resolved.name,
        "date": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
        "n_layers": n,
        "ks": ks,
        "seed": seed,
        "quick": quick,
        "settings": asdict(st),
        "data": {
            "train_docs": len(train),
            "test_docs": len(test),
            "train_tokens": sum(len(d.ids) for d in train),
            "test_tokens": sum(len(d.ids) for d in test),
            "train_ids": [d.doc_id for d in train],
            "test_ids": [d.doc_id for d in test],
            "sources": sorted({d.source for d in docs}),
        },
        "results": results,
        "noise": noise_rows,
        "timing_s": {k: round(v, 2) for k, v in timing.items()},
    }
    report("audit: writing results", 1.0)
    from engine.audit.store import results_dir, save_results

    files: dict[str, Path] = {}
    if out_dir is not None:
        files = write_outputs(out, Path(out_dir))
    elif save:
        files = write_outputs(out, results_dir(resolved.name))
    if save:
        save_results(out, files)
    return out


def build_corpus(
    am: AuditModel,
    st: AuditSettings,
    seed: int,
    check: Callable[[], None],
    report: Progress,
) -> tuple[list[Document], list[Document], list[Document]]:
    """The audit's documents (stdlib, personal data, generated chats), tokenised, and their
    train/test split by document: (all, train, test)."""
    report("audit: preparing text", 0.0)
    tok = am.tokenizer
    docs: list[Document] = [
        Document(f"stdlib-{i}", "stdlib", t) for i, t in enumerate(stdlib_texts(st.n_stdlib))
    ]
    docs += pii_documents(st.n_pii, seed)
    for d in docs:
        tokenize(d, tok, st.max_tokens)
    gen = prompt_documents(st.n_generated, seed)
    for i, d in enumerate(gen):
        check()
        add_generated_replies(am, [d], st.gen_new_tokens, st.max_tokens)
        report("audit: generating text", (i + 1) / max(1, len(gen)))
    docs = [d for d in docs + gen if len(d.ids) >= 4]
    train, test = split_by_document(docs, st.test_fraction, seed)
    return docs, train, test


def noise_sweep(
    am: AuditModel,
    train: Sequence[Document],
    test: Sequence[Document],
    tr_states: dict[int, list[torch.Tensor]],
    te_states: dict[int, list[torch.Tensor]],
    ids_tr: Sequence[torch.Tensor],
    ids_te: Sequence[torch.Tensor],
    pii_te: Sequence[torch.Tensor],
    k: int,
    st: AuditSettings,
    seed: int,
    check: Callable[[], None],
    report: Callable[[float], None],
) -> list[dict[str, Any]]:
    """Gaussian noise N(0, (sigma * s)^2 I) added to the head's output, s = median per-token
    RMS of the head's output on the training text. The attacker knows sigma (trains on noisy
    states and searches with the public head); quality is measured against the clean model."""
    x_tr = _cat(tr_states[k])
    scale = float(x_tr.pow(2).mean(-1).sqrt().median())
    y_tr = _cat(ids_tr)
    g = torch.Generator().manual_seed(seed + 1)
    rows: list[dict[str, Any]] = []
    q_docs = list(range(min(st.quality_docs, len(test))))
    clean_logits = [logits_from(am, k, te_states[k][j]) for j in q_docs]
    for i, sigma in enumerate(st.noise_sigmas):
        check()
        s_abs = sigma * scale

        def noisy(x: torch.Tensor, s_abs: float = s_abs) -> torch.Tensor:
            return x + s_abs * torch.randn(x.shape, generator=g)  # [T, H]

        n_tr = noisy(x_tr)
        n_te = [noisy(s) for s in te_states[k]]
        near = A.nearest_embedding(n_te, am.embed_weight, 32)
        ridge = A.RidgeDecoder(n_tr, y_tr)
        rr = [ridge.ranked(s, 32) for s in n_te]
        ereg = A.EmbeddingRegressor(n_tr, y_tr, am.embed_weight)
        er = [ereg.ranked(s, 32) for s in n_te]
        base = {"k": k, "sigma": sigma, "sigma_abs": s_abs, "side": "input"}
        for name, top5 in (
            ("nearest_embedding", [r[:, :5] for r in near]),
            ("ridge", [r[:, :5] for r in rr]),
            ("ridge_embedding", [r[:, :5] for r in er]),
        ):
            rows.append({**base, "attack": name, **score(top5, ids_te, pii_te, seed, st.n_boot)})
        head = am.stack(0, k)
        sub = list(range(min(st.noise_sipit_docs, len(test))))
        inv = [
            A.invert_known_weights(
                head,
                am.embed_weight,
                n_te[j],
                A.candidate_order_fn(rr[j], er[j], near[j]),
                (1, 7, 24),
            )
            for j in sub
        ]
        sc = score(
            [r.top5 for r in inv],
            [ids_te[j] for j in sub],
            [pii_te[j] for j in sub],
            seed,
            st.n_boot,
        )
        ver = torch.cat([r.verified for r in inv]).float().mean()
        rows.append({**base, "attack": "known_weights", **sc, "verified_exact": float(ver)})
        # quality: continue the public model from the noisy state
        nll, agree, cnt = 0.0, 0, 0
        nll_clean = 0.0
        for j, cl in zip(q_docs, clean_logits, strict=True):
            lg = logits_from(am, k, n_te[j])  # [T, V]
            tgt = ids_te[j][1:]
            nll += float(F.cross_entropy(lg[:-1], tgt, reduction="sum"))
            nll_clean += float(F.cross_entropy(cl[:-1], tgt, reduction="sum"))
            agree += int((lg.argmax(-1) == cl.argmax(-1)).sum())
            cnt += len(tgt)
        q = {
            "perplexity": math.exp(nll / cnt),
            "perplexity_clean": math.exp(nll_clean / cnt),
            "greedy_agreement": agree / (cnt + len(q_docs)),
        }
        for r in rows[-4:]:
            r.update(q)
        report((i + 1) / len(st.noise_sigmas))
    return rows


def write_outputs(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """results.json, audit.png and report.md in ``out_dir``; returns {name: path}."""
    from engine.audit.report import plot, report_markdown

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "results.json": out_dir / "results.json",
        "audit.png": out_dir / "audit.png",
        "report.md": out_dir / "report.md",
    }
    paths["results.json"].write_text(json.dumps(results, indent=1), encoding="utf-8")
    plot(results, paths["audit.png"])
    paths["report.md"].write_text(report_markdown(results), encoding="utf-8")
    return paths
