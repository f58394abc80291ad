"""Per-depth acceptance of a draft head alone, on fresh self-prompts it was not trained on.

    python bench/draft_head_acceptance.py [--model smollm2-135m-instruct] [--head FILE]
                                          [--tokens 12000] [--seed 777] [--out FILE.json]

Makes held-out data the way `veil train-draft` does (the model writes user messages from its
chat template alone and answers them greedily), but with a seed training never uses, then runs
the head as a chain drafter from every position of the greedy replies: at depth d, how often its
top-1 is the model's next token when depths 1..d-1 were right. No benchmark prompt is involved.
Default head: the one shipped for the model. When the training data of `veil train-draft` is
still in the user cache, the report says how many held-out self-prompts also occur there (by
the same content hash training uses to drop duplicates); they are left out of the measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.drafts.dataset import DataOptions, Manifest, load_samples, make_data  # noqa: E402
from engine.drafts.head import find_shipped_head, load_head, model_fingerprint  # noqa: E402
from engine.drafts.pipeline import load_frozen  # noqa: E402
from engine.drafts.selfgen import BatchModel, Sample, user_turn_prefix  # noqa: E402
from engine.drafts.train import depth_acceptance, vocab_coverage  # noqa: E402
from engine.loading import (  # noqa: E402
    DEFAULT_MODEL,
    WeightReader,
    cache_root,
    load_config,
    load_tokenizer,
    resolve,
)
from engine.model import rope_inv_freq  # noqa: E402


def prompt_hash(sample: Sample, prefix_len: int, eos: list[int], tokenizer: object) -> str:
    """The content hash `make_data` keeps of a self-prompt: its user message, decoded."""
    ids = sample.tokens.tolist()[prefix_len:]
    end = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    text = tokenizer.decode(ids[:end], skip_special_tokens=True).strip()  # type: ignore[attr-defined]
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--head", default=None, help="head file (default: the shipped one)")
    ap.add_argument("--tokens", type=int, default=12_000, help="held-out tokens to make")
    ap.add_argument("--reply-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=777, help="self-prompt seed (training uses 0)")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    ap.add_argument(
        "--data", default=None, help="keep the held-out data in this folder (reused if present)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    resolved = resolve(args.model)
    cfg = load_config(resolved.folder)
    reader = WeightReader(resolved.folder)
    fp = model_fingerprint(reader, cfg)
    path = Path(args.head) if args.head else find_shipped_head(cfg.fingerprint())
    if path is None:
        print(f"no draft head shipped for {args.model}; pass --head FILE", file=sys.stderr)
        return 2
    head = load_head(path, fp)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.data or tmp)
        opts = DataOptions(tokens=args.tokens, reply_tokens=args.reply_tokens, seed=args.seed)
        if Manifest(folder).data["tokens"] < args.tokens:
            make_data(BatchModel(resolved, head.feature_layers), folder, opts)
        held_hashes = set(Manifest(folder).data.get("prompt_hashes", []))
        samples = [s for s in load_samples(folder) if s.kind == "reply"]
    taps = head.feature_layers
    work = cache_root() / "draft-train" / f"{fp[0]}-{fp[1]}-{taps[0]}-{taps[1]}"
    trained = Manifest(work).data.get("prompt_hashes")
    shared = len(held_hashes & set(trained)) if trained is not None else None
    if shared:
        tok = load_tokenizer(resolved.folder)
        plen, seen = len(user_turn_prefix(tok)), set(trained or [])
        eos = list(cfg.eos_token_ids)
        samples = [s for s in samples if prompt_hash(s, plen, eos, tok) not in seen]
    frozen = load_frozen(reader, cfg, head.vocab, "cpu")
    ids = head.vocab if head.vocab is not None else torch.arange(cfg.vocab_size)
    report = depth_acceptance(head.net, frozen, samples, rope_inv_freq(cfg), depth=args.depth)
    report.update(
        {
            "model": args.model,
            "head": str(path),
            "samples": len(samples),
            "vocab_coverage": round(vocab_coverage(samples, ids, cfg.vocab_size), 4),
            "seed": args.seed,
            "prompts_shared_with_training": shared,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    )
    print(f"{args.model}, head {path}: {report['positions']} positions of {len(samples)} replies")
    if shared is None:
        print("(training data not in the cache: overlap with it not checked)")
    else:
        print(f"held-out self-prompts also in the training data: {shared} (left out)")
    print("depth  conditional  cumulative")
    for d, (c, u) in enumerate(zip(report["conditional"], report["cumulative"], strict=True), 1):
        print(f"{d:>5}  {c:>11.3f}  {u:>10.3f}")
    print(
        f"mean accepted chain {report['mean_chain']:.2f} tokens; true token in the head's top-4 "
        f"at depth 1: {report['top4_depth1']:.3f}; draft vocabulary covers "
        f"{report['vocab_coverage']:.3f} of the model's choices"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
