"""`veil audit`: measure how much of your text the trunk server could recover at each split."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from app.progress import CliProgress
from engine.errors import VeilError
from engine.loading import DEFAULT_MODEL


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise VeilError(
            f"--local-layers must be a comma-separated list of integers, got '{text}'"
        ) from None
    if not ks:
        raise VeilError("--local-layers needs at least one depth, e.g. 1,2,4,8")
    return ks


def default_threads() -> int:
    """One thread when the machine is already busy (oversubscribed BLAS threads are several
    times slower than one), otherwise all cores."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return 1 if load >= cores - 0.5 else cores


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "audit",
        help="measure token-recovery risk for each split depth",
        description="Privacy audit: run the attacks a trunk server could run on the activations "
        "it sees (frequency prior, nearest embedding, learned decoders, known-weights inversion, "
        "output-side reading) at each split depth, plus the noise defense. Writes results.json, "
        "audit.png and report.md, and stores the results so the app shows them at the slider.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="SPEC", help="model to audit")
    p.add_argument(
        "--local-layers",
        default="1,2,4,8",
        metavar="K,K,...",
        help="split depths to audit (default 1,2,4,8)",
    )
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: the store)")
    p.add_argument("--quick", action="store_true", help="small corpus, ~2 minutes (for CI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--noise-k", type=int, default=None, metavar="K", help="depth for the noise sweep"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: auto)")
    p.add_argument("--no-store", action="store_true", help="do not update the app's stored audit")
    p.add_argument(
        "--org-key",
        default=None,
        metavar="FILE",
        help="audit the organisation-keyed split made with this key (attacks that know the "
        "scheme, and the keyed model's quality)",
    )
    p.add_argument(
        "--keyed-noise",
        type=float,
        nargs="+",
        default=None,
        metavar="S",
        help="keyed-trunk weight noise levels to measure "
        "(default 0 0.01 0.03 0.1; needs --org-key)",
    )
    p.set_defaults(func=run)


def run_keyed(args: argparse.Namespace, ks: list[int]) -> int:
    from engine.audit.keyed import DEFAULT_NOISES, run_keyed_audit
    from engine.audit.store import results_dir
    from engine.keyed.transform import OrgKey

    key = OrgKey.load(Path(args.org_key))
    noises = args.keyed_noise if args.keyed_noise is not None else list(DEFAULT_NOISES)
    if any(s < 0 for s in noises):
        raise VeilError("--keyed-noise levels must be >= 0")
    progress = CliProgress()
    try:
        res = run_keyed_audit(
            args.model,
            ks,
            key,
            Path(args.out) if args.out else None,
            noises,
            quick=args.quick,
            progress=progress,
            seed=args.seed,
            save=not args.no_store,
            threads=args.threads or default_threads(),
        )
    finally:
        progress.close()
    for b in res["best"]:
        lo, hi = b["top1_ci"]
        print(
            f"k={b['k']} noise={b['noise']:g} {b['side']}: best attack {b['attack']} recovers "
            f"{100 * b['top1']:.1f}% of tokens (95% CI {100 * lo:.1f}-{100 * hi:.1f}%)"
        )
    for q in res["quality"]:
        print(
            f"k={q['k']} noise={q['noise']:g}: "
            f"greedy agreement {100 * q['greedy_agreement']:.1f}%, "
            f"perplexity {q['perplexity']:.2f} (plain {q['perplexity_plain']:.2f})"
        )
    out = Path(args.out) if args.out else results_dir(res["model"])
    print(f"results: {out / 'results.json'} · report: {out / 'report.md'}")
    print(f"took {res['timing_s']['total']:.0f} s")
    return 0


def run(args: argparse.Namespace) -> int:
    from engine.audit.runner import run_audit
    from engine.audit.store import results_dir, worst_case

    ks = parse_ks(args.local_layers)
    if args.threads is not None and args.threads < 1:
        raise VeilError("--threads must be at least 1")
    if args.keyed_noise is not None and not args.org_key:
        raise VeilError("--keyed-noise needs --org-key FILE")
    if args.org_key:
        return run_keyed(args, ks)
    progress = CliProgress()
    try:
        res = run_audit(
            args.model,
            ks,
            Path(args.out) if args.out else None,
            quick=args.quick,
            progress=progress,
            seed=args.seed,
            noise_k=args.noise_k,
            save=not args.no_store,
            threads=args.threads or default_threads(),
        )
    finally:
        progress.close()
    out = Path(args.out) if args.out else results_dir(res["model"])
    if not args.out and args.no_store:
        print("veil: results were neither written (--out) nor stored (--no-store)")
    for k in res["ks"]:
        wc = worst_case(res, k)
        if wc is not None:
            print(f"k={k}: worst-case top-1 token recovery {100 * wc[0]:.1f}% ({wc[1]})")
    print(
        f"results: {out / 'results.json'} · report: {out / 'report.md'} · plot: {out / 'audit.png'}"
    )
    print(f"took {res['timing_s']['total']:.0f} s")
    return 0
