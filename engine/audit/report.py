"""The audit's plot (matplotlib, Agg) and plain-language report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ATTACK_LABELS = {
    "prior": "frequency prior (floor)",
    "nearest_embedding": "nearest embedding",
    "ridge": "ridge decoder (learned)",
    "ridge_embedding": "ridge to embedding (learned, full vocabulary)",
    "mlp": "MLP decoder (learned)",
    "known_weights": "known-weights inversion",
    "logit_lens": "logit lens (tail private)",
    "public_tail": "public tail + LM head",
}


COLORS = {
    "prior": "tab:gray",
    "nearest_embedding": "tab:olive",
    "ridge": "tab:purple",
    "ridge_embedding": "tab:brown",
    "mlp": "tab:orange",
    "known_weights": "tab:red",
    "logit_lens": "tab:blue",
    "public_tail": "tab:green",
}


def pct(x: float | None) -> str:
    """A share as a percentage with one decimal; "–" when unknown."""
    return "–" if x is None else f"{100 * x:.1f}%"


def _ci(ci: list[float] | None) -> str:
    return "" if not ci else f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["results"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, side in zip(axes[:2], ("input", "output"), strict=True):
        attacks = sorted({r["attack"] for r in rows if r["side"] == side})
        for a in attacks:
            pts = sorted(
                (r["k"], r["top1"], r["top1_ci"])
                for r in rows
                if r["side"] == side and r["attack"] == a
            )
            ks = [p[0] for p in pts]
            gen = sorted(
                (r["k"], r["top1_generated"])
                for r in rows
                if r["side"] == side and r["attack"] == a and "top1_generated" in r
            )
            if a == "public_tail" and gen:
                ax.plot(
                    [g[0] for g in gen],
                    [100 * g[1] for g in gen],
                    ls="--",
                    color=COLORS[a],
                    label="public tail, on the model's own reply",
                )
            ax.errorbar(
                ks,
                [100 * p[1] for p in pts],
                yerr=[[100 * (p[1] - p[2][0]) for p in pts], [100 * (p[2][1] - p[1]) for p in pts]],
                marker="o",
                capsize=3,
                label=ATTACK_LABELS.get(a, a),
                color=COLORS.get(a),
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("local layers k")
        ax.set_ylabel("top-1 token recovery (%)")
        ax.set_ylim(0, 102)
        ax.set_title(
            "server reads the prompt (head output)"
            if side == "input"
            else "server reads the next token (trunk output)"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    noise = results.get("noise", [])
    for a in sorted({r["attack"] for r in noise}):
        pts = sorted(
            (r["sigma"], r["top1"], r["greedy_agreement"]) for r in noise if r["attack"] == a
        )
        ax.plot(
            [100 * p[2] for p in pts],
            [100 * p[1] for p in pts],
            marker="o",
            label=ATTACK_LABELS.get(a, a),
            color=COLORS.get(a),
        )
        for s, y, x in pts:
            ax.annotate(f"σ={s:g}", (100 * x, 100 * y), fontsize=6)
    k = noise[0]["k"] if noise else "?"
    ax.set_xlabel("greedy agreement with the undefended model (%)")
    ax.set_ylabel("top-1 token recovery (%)")
    ax.set_title(f"noise defense at k={k}: privacy vs quality")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(f"Veil privacy audit — {results['model']} — {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[dict[str, Any]], side: str) -> str:
    lines = [
        "| k | attack | top-1 [95% CI] | top-5 | personal-data top-1 |",
        "|---|---|---|---|---|",
    ]
    for r in sorted((r for r in rows if r["side"] == side), key=lambda r: (r["k"], r["attack"])):
        extra = ""
        if r["attack"] == "known_weights":
            extra = f" (verified exact {pct(r.get('verified_exact'))})"
        if "top1_generated" in r:
            extra = f" (on generated reply tokens: {pct(r['top1_generated'])})"
        lines.append(
            f"| {r['k']} | {ATTACK_LABELS.get(r['attack'], r['attack'])}{extra} | "
            f"{pct(r['top1'])}{_ci(r['top1_ci'])} | {pct(r['top5'])} | "
            f"{pct(r.get('pii_top1'))} |"
        )
    return "\n".join(lines)


def noise_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| σ (× activation RMS) | attack | top-1 [95% CI] | personal-data top-1 | "
        "greedy agreement | perplexity (clean) |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["sigma"], r["attack"])):
        lines.append(
            f"| {r['sigma']:g} | {ATTACK_LABELS.get(r['attack'], r['attack'])} | "
            f"{pct(r['top1'])}{_ci(r['top1_ci'])} | {pct(r.get('pii_top1'))} | "
            f"{pct(r['greedy_agreement'])} | {r['perplexity']:.2f} "
            f"({r['perplexity_clean']:.2f}) |"
        )
    return "\n".join(lines)


def report_markdown(results: dict[str, Any]) -> str:
    rows = results["results"]
    d = results["data"]
    worst: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["k"] not in worst or r["top1"] > worst[r["k"]]["top1"]:
            worst[r["k"]] = r
    lines = [
        f"# Privacy audit: {results['model']}",
        "",
        f"Date: {results['date']} · split depths k = {results['ks']} · seed {results['seed']}"
        f"{' · quick mode' if results.get('quick') else ''}",
        "",
        f"Text: {d['train_docs']} training documents ({d['train_tokens']} tokens) for the "
        f"attacker, {d['test_docs']} held-out documents ({d['test_tokens']} tokens) to attack; "
        "sources: " + ", ".join(d["sources"]) + ". Train and test are split by document.",
        "",
        "## In plain words",
        "",
    ]
    for k, r in sorted(worst.items()):
        lines.append(
            f"- With k = {k} local layers, the best attack "
            f"({ATTACK_LABELS.get(r['attack'], r['attack'])}, {r['side']} side) recovers "
            f"{pct(r['top1'])} of tokens exactly (95% CI{_ci(r['top1_ci'])})."
        )
    lines += [
        "",
        "The server operator has the public model weights. Anyone who does can run the first "
        "k layers on guessed tokens and compare with what your computer sent; this audit does "
        "exactly that (known-weights inversion). A split alone is not encryption.",
        "",
        "## What the server sees on the way in (head output → your prompt)",
        "",
        table(rows, "input"),
        "",
        "## What the server sees on the way back (trunk output → the next token)",
        "",
        table(rows, "output"),
        "",
    ]
    if results.get("noise"):
        lines += [
            f"## Defense: Gaussian noise on the head's output (k = {results['noise'][0]['k']})",
            "",
            noise_table(results["noise"]),
            "",
        ]
    lines += [
        "Confidence intervals: 95% bootstrap over documents. Known-weights inversion is run on "
        "a subset of the held-out documents (see n_seqs in results.json) with a bounded "
        "candidate list per position; tokens it could not verify count as its best guess.",
        "",
        f"Timing (s): {results['timing_s']}",
        "",
    ]
    return "\n".join(lines)
