"""`veil train-draft`: train a draft head for a model from the model's own generations."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from engine.errors import VeilError
from engine.loading import DEFAULT_MODEL


class TrainDraftError(VeilError):
    """Bad `veil train-draft` input."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train-draft",
        help="train a draft head (faster speculative decoding) for a model",
        description="Train a small draft head that predicts the model's next tokens from the "
        "hidden states the client already computes. The training text is the model's own: it "
        "writes user messages from its chat template alone and answers them (plus any local "
        "text given with --text). Nothing is downloaded. Data and checkpoints go to a work "
        "folder in the user cache, so --resume continues an interrupted run.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="SPEC")
    p.add_argument("--out", required=True, metavar="FILE", help="head file to write (.safetensors)")
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        metavar="N",
        help="tokens of model-written text to record (default 160000)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        metavar="S",
        help="optimizer steps of 2048 tokens (default: 10 passes over the data)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=0.0,
        metavar="M",
        help="train for at most about M minutes (fewer steps; the data is made first)",
    )
    p.add_argument("--resume", action="store_true", help="continue the last run for this model")
    p.add_argument(
        "--text", default=None, metavar="DIR", help="also read the .txt/.md files under DIR"
    )
    p.add_argument(
        "--local-layers",
        type=int,
        default=2,
        metavar="K",
        help="the split the head will draft for (K layers at each end; default 2)",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=4096,
        metavar="N",
        help="draft vocabulary: the N tokens the model writes most (0 = all; default 4096)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--work-dir", default=None, metavar="DIR", help="where data and checkpoints go")
    p.set_defaults(func=run)


DEFAULT_TOKENS = 160_000


def run(args: argparse.Namespace) -> int:
    tokens = DEFAULT_TOKENS if args.tokens is None else args.tokens
    if tokens < 1:
        raise TrainDraftError("--tokens must be at least 1")
    if args.steps < 0:
        raise TrainDraftError("--steps must be >= 0")
    if not args.minutes >= 0:
        raise TrainDraftError("--minutes must be >= 0")
    if args.vocab < 0:
        raise TrainDraftError("--vocab must be >= 0")
    if args.threads is not None and args.threads < 1:
        raise TrainDraftError("--threads must be at least 1")
    if args.device not in (None, "cpu", "cuda") and not str(args.device).startswith("cuda:"):
        raise TrainDraftError(f"unknown device '{args.device}' (use cpu or cuda)")
    text = Path(args.text) if args.text else None
    if text is not None and not text.is_dir():
        raise TrainDraftError(f"--text {text} is not a folder")
    out = Path(args.out)
    if out.is_dir():
        raise TrainDraftError(f"--out {out} is a folder; name the head file to write")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrainDraftError(f"cannot create {out.parent}: {exc.strerror or exc}") from None

    import torch

    from engine.drafts.pipeline import DraftTrainOptions, train_draft

    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise TrainDraftError("--device cuda: no CUDA GPU is available to torch here")
    if args.threads:
        torch.set_num_threads(args.threads)
    opts = DraftTrainOptions(
        tokens=tokens,
        steps=args.steps,
        resume=args.resume,
        text_dir=text,
        local_layers=args.local_layers,
        vocab_size=args.vocab,
        device=args.device,
        minutes=args.minutes,
        work_dir=Path(args.work_dir) if args.work_dir else None,
    )
    bar = _Bar()
    try:
        info = train_draft(args.model, out, opts, bar)
    finally:
        bar.close()
    acc = info.get("heldout_acceptance") or {}
    print(
        f"wrote {out}: {info['data_tokens']} tokens of model-written text "
        f"({info['data_cpu_s'] / 60:.1f} CPU-min), {info['train_steps']} training steps "
        f"({info['train_cpu_s'] / 60:.1f} CPU-min); run took {info['run_wall_s'] / 60:.1f} min"
    )
    if acc:
        cond = " ".join(f"{a:.2f}" for a in acc["conditional"])
        print(
            f"held-out acceptance by depth (given the previous): {cond}; "
            f"mean accepted chain {acc['mean_chain']:.2f}"
        )
    return 0


class _Bar:
    """One tqdm bar per stage, with the latest numbers (loss, accuracy) as its postfix; plain
    lines every 10 % when stderr is not a terminal."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.stage = ""
        self.bar: Any = None
        self.last_pct = -1
        self.t0 = time.perf_counter()

    def __call__(self, stage: str, done: float, total: float, info: dict[str, float]) -> None:
        pct = min(int(100 * done / total), 100) if total else 0
        if not self.tty:
            if stage != self.stage or pct // 10 != self.last_pct // 10:
                extra = " ".join(f"{k}={v:.3f}" for k, v in info.items())
                mins = (time.perf_counter() - self.t0) / 60
                print(f"veil: {stage} {pct}% {extra} ({mins:.1f} min)", file=sys.stderr, flush=True)
            self.stage, self.last_pct = stage, pct
            return
        from tqdm import tqdm

        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = tqdm(total=int(total) or 1, desc=stage, file=sys.stderr, leave=False)
        if self.bar is not None:
            self.bar.n = min(int(done), self.bar.total)
            if info:
                self.bar.set_postfix({k: round(v, 3) for k, v in info.items()}, refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
