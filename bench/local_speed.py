"""Local-only decode speed and exactness vs transformers' `generate` on the benchmark prompts.

    python bench/local_speed.py [--prompts ../shared/bench/prompts.jsonl] [--max-new-tokens 128]
                                [--ks 2,15] [--out bench-out/local_speed.json]

For each prompt: transformers greedy `generate` (fp32, CPU) and Veil's sequential decoder at
each k (in-process trunk; k = L/2 is fully local), checking token ids are identical and timing
decode. Also times a second load of the default model in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.chat import messages_for, prompt_ids  # noqa: E402
from engine.generate import generate  # noqa: E402
from engine.loading import DEFAULT_MODEL  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.split import SplitRunner, load_client, load_trunk  # noqa: E402

LOAD_SNIPPET = (
    "import time; t=time.perf_counter(); from engine.split import load_client; "
    "load_client({model!r}, 2); print(time.perf_counter()-t)"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "bench" / "prompts.jsonl"))
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ks", default="2,15", help="local layers to check (comma-separated)")
    ap.add_argument("--out", default="bench-out/local_speed.json")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    rows = [json.loads(x) for x in Path(args.prompts).read_text().splitlines() if x.strip()]
    ks = [int(k) for k in args.ks.split(",")]
    runners = {}
    for k in ks:
        client = load_client(args.model, k)
        trunk = None
        if not client.plan.fully_local:
            s, e = client.plan.trunk_range
            trunk = load_trunk(client.resolved, s, e)
        runners[k] = SplitRunner(client, trunk)
    first = runners[ks[0]].client
    src = first.resolved.source
    if src.is_file() and src.suffix.lower() == ".gguf":  # the weights stay in the GGUF file
        hf = AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=torch.float32
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(first.resolved.folder), dtype=torch.float32)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    results = []
    print(f"{'prompt':<24} {'hf tok/s':>9} " + " ".join(f"{'k=' + str(k):>14}" for k in ks))
    for row in rows:
        ids = prompt_ids(first.tokenizer, messages_for(row["prompt"]))
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False
            )
        hf_s = time.perf_counter() - t0
        ref = out[0, len(ids) :].tolist()
        entry = {"id": row["id"], "hf_tok_s": len(ref) / hf_s, "veil": {}}
        cells = []
        for k, runner in runners.items():
            t0 = time.perf_counter()
            res = generate(runner, ids, params)
            wall = time.perf_counter() - t0
            same = res.token_ids == ref
            entry["veil"][str(k)] = {
                "tok_s": len(res.token_ids) / wall,
                "decode_tok_s": res.stats.decode_tok_s,
                "identical": same,
            }
            cells.append(f"{len(res.token_ids) / wall:8.1f} {'same' if same else 'DIFF':>5}")
        results.append(entry)
        print(f"{row['id']:<24} {entry['hf_tok_s']:9.1f} " + " ".join(cells), flush=True)

    loads = []
    for _ in range(3):
        p = subprocess.run(
            [sys.executable, "-c", LOAD_SNIPPET.format(model=args.model)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        )
        loads.append(float(p.stdout.strip().splitlines()[-1]))
    summary = {
        "hf_tok_s_mean": statistics.mean(r["hf_tok_s"] for r in results),
        "veil_tok_s_mean": {
            str(k): statistics.mean(r["veil"][str(k)]["tok_s"] for r in results) for k in ks
        },
        "all_identical": all(v["identical"] for r in results for v in r["veil"].values()),
        "second_load_s": loads,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(summary, indent=2))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"prompts": results, "summary": summary}, indent=2))
    return 0 if summary["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
