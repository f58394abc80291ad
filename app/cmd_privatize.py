"""`veil privatize`: make organisation-private head/tail weights and measure what they buy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from app.progress import CliProgress
from engine.errors import VeilError
from engine.loading import DEFAULT_MODEL


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "privatize",
        help="fine-tune the local layers into private weights",
        description="Fine-tune the head and tail layers (the trunk stays public and fixed) so "
        "the activations sent to the server no longer match the public weights, while the "
        "output stays close to the public model. Writes a private-weights file that the client "
        "loads with `veil generate --private-weights FILE`, and a JSON report measuring the "
        "known-weights attack and a learned attacker against it, and the quality cost.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="SPEC")
    p.add_argument("--local-layers", type=int, default=2, metavar="K", help="head layers")
    p.add_argument("--tail-layers", type=int, default=None, metavar="T", help="default: = K")
    p.add_argument("--out", required=True, metavar="FILE", help="private weights (.safetensors)")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument(
        "--margin",
        type=float,
        default=0.3,
        help="target relative distance of the sent states from the public ones",
    )
    p.add_argument("--weight", type=float, default=1.0, help="weight of the distance term")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small corpus (for tests)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: auto)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from app.cmd_audit import default_threads
    from engine.audit.privatize import privatize

    if args.steps < 1 or args.lr <= 0 or args.margin < 0 or args.weight < 0:
        raise VeilError("--steps must be >= 1, --lr > 0, --margin and --weight >= 0")
    out = Path(args.out)
    if out.suffix != ".safetensors":
        raise VeilError("--out must end in .safetensors")
    torch.set_num_threads(args.threads or default_threads())
    progress = CliProgress()
    try:
        res = privatize(
            args.model,
            args.local_layers,
            args.tail_layers if args.tail_layers is not None else args.local_layers,
            out,
            steps=args.steps,
            lr=args.lr,
            margin=args.margin,
            weight=args.weight,
            seed=args.seed,
            quick=args.quick,
            progress=progress,
        )
    finally:
        progress.close()
    report = out.with_suffix(".report.json")
    report.write_text(json.dumps(res, indent=1), encoding="utf-8")
    q = res["quality"]
    print(f"private weights: {out}  (report: {report})")
    print(
        f"quality: perplexity {q['perplexity_private']:.2f} vs public {q['perplexity_public']:.2f}"
        f", greedy agreement {100 * q['greedy_agreement']:.1f}%"
    )
    for label in ("public", "private"):
        a = res["attacks"][label]
        print(
            f"{label} head: known-weights top-1 {100 * a['known_weights']['top1']:.1f}% "
            f"(verified exact {100 * a['known_weights']['verified_exact']:.1f}%), "
            f"ridge trained on public activations {100 * a['ridge_trained_on_public']['top1']:.1f}%"
        )
    return 0
