"""Train the default model's draft head on a borrowed GPU inside a fixed time box.

`veil train-draft` makes a fixed amount of data, then trains. On a machine lent for a few
minutes the budget is time, not tokens: this script makes data until ``--data-minutes`` are
spent (one shard of ``--gen-batch`` self-prompts and their greedy replies at a time), then
trains on all of it for about ``--train-minutes`` (the same code as `veil train-draft`, via
``DraftTrainOptions.minutes``), measures the head on held-out self-prompts and writes the head
file plus a JSON summary. Nothing here reads the benchmark prompts.

    python bench/train_draft_gpu.py --model PATH.gguf --out DIR --data-minutes 3 --train-minutes 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", required=True, help="folder for head.safetensors and summary.json")
    ap.add_argument("--work", default=None, help="data folder (default: a fresh one under --out)")
    ap.add_argument("--data-minutes", type=float, default=3.0)
    ap.add_argument("--train-minutes", type=float, default=3.0)
    ap.add_argument("--max-tokens", type=int, default=50_000_000, help="stop making data here")
    ap.add_argument("--gen-batch", type=int, default=0, help="0: the pipeline's default")
    ap.add_argument("--local-layers", type=int, default=2)
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0, help="self-prompt sampling and training seed")
    ap.add_argument("--vocab-size", type=int, default=4096, help="draft vocabulary (0: all)")
    ap.add_argument("--heldout", type=float, default=0.04, help="share of replies kept aside")
    args = ap.parse_args()

    import torch

    from engine.drafts.dataset import DataOptions, make_data
    from engine.drafts.pipeline import (
        DraftTrainOptions,
        default_device,
        default_gen_batch,
        train_draft,
    )
    from engine.drafts.selfgen import BatchModel
    from engine.loading import load_config, resolve
    from engine.split import SplitPlan

    device = args.device or default_device()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else out / "work"
    t0 = time.perf_counter()
    resolved = resolve(args.model)
    cfg = load_config(resolved.folder)
    plan = SplitPlan.symmetric(cfg.n_layers, args.local_layers)
    taps = (plan.head, plan.n_layers - plan.tail, plan.n_layers)
    model = BatchModel(resolved, taps, device=device)
    gen_batch = args.gen_batch or default_gen_batch(device, cfg)
    print(f"device {device} ({torch.cuda.get_device_name() if device.startswith('cuda') else ''})")
    print(f"model loaded in {time.perf_counter() - t0:.1f} s; generating {gen_batch} rows at once")

    # 1. data until the time box is spent (one shard per call)
    t_data = time.perf_counter()
    have = 0
    while time.perf_counter() - t_data < 60 * args.data_minutes and have < args.max_tokens:
        data = DataOptions(tokens=have + 1, batch=gen_batch, seed=args.seed)
        man = make_data(model, work, data)
        have = int(man.data["tokens"])
        mins = (time.perf_counter() - t_data) / 60
        print(f"data: {have} tokens, {man.data.get('samples', 0)} samples ({mins:.2f} min)")
        sys.stdout.flush()
    data_wall = time.perf_counter() - t_data
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    # 2. train on all of it, same pipeline as `veil train-draft --resume` (data already there)
    def report(stage: str, done: float, total: float, info: dict[str, float]) -> None:
        if stage == "training" and (int(done) % 500 == 0 or done == total):
            extra = " ".join(f"{k}={v:.3f}" for k, v in info.items())
            mins = (time.perf_counter() - t0) / 60
            print(f"{stage} {int(done)}/{int(total)} {extra} ({mins:.2f} min)", flush=True)

    opts = DraftTrainOptions(
        tokens=have,
        resume=True,
        local_layers=args.local_layers,
        device=device,
        work_dir=work,
        minutes=args.train_minutes,
        seed=args.seed,
        vocab_size=args.vocab_size,
        heldout=args.heldout,
    )
    info = train_draft(args.model, out / "head.safetensors", opts, report)
    info["data_wall_s_this_run"] = round(data_wall, 1)
    info["gen_batch"] = gen_batch
    info["gpu"] = torch.cuda.get_device_name() if device.startswith("cuda") else None
    (out / "summary.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
    print(json.dumps({k: info[k] for k in ("data_tokens", "train_steps", "heldout_acceptance")}))
    print(f"total {(time.perf_counter() - t0) / 60:.2f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
