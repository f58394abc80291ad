"""Where a fully local decode step's time goes, per path (CPU time of the decoding thread, one
thread, so other processes on the machine do not count).

    python bench/profile_decode.py [--tokens 48] [--json OUT]

Paths: the float32 reference (torch layer math, the float small-row kernel); the GGUF kept
quantized with the torch layer math (one kernel call per product, ~25 torch ops per layer);
the same with the one-call quantized layer; and that with int8 activations. For each: CPU ms
per token, split by cProfile into the compiled products/layers, torch operations, and the
Python around them.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def categorize(stats: pstats.Stats) -> dict[str, float]:
    out = {"compiled": 0.0, "torch": 0.0, "python": 0.0}
    for (file, _line, func), row in stats.stats.items():  # type: ignore[attr-defined]
        tt = row[2]
        if any(s in file for s in ("_quant_mm", "_int_mm", "_f32_ir", "_fused", "veil_layer_")):
            out["compiled"] += tt
        elif file == "~" and ("torch" in func or "method" in func or "built-in" in func):
            out["torch"] += tt
        else:
            out["python"] += tt
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from app.cmd_bench import machine
    from engine import kernels
    from engine.chat import messages_for, prompt_ids
    from engine.generate import generate
    from engine.loading import DEFAULT_MODEL
    from engine.sampling import SamplingParams
    from engine.split import SplitRunner, load_client

    kernels.set_threads(1)
    paths: list[tuple[str, str, bool, bool]] = [
        ("float32 reference (torch layers)", "none", False, False),
        ("GGUF kept quantized, torch layers", "auto", False, False),
        ("GGUF kept quantized, one-call layers", "auto", True, False),
        ("... with int8 activations", "auto", True, True),
    ]
    res: dict[str, Any] = {"machine": machine(), "tokens": args.tokens, "paths": {}}
    params = SamplingParams(max_new_tokens=args.tokens)
    for name, quant, fused, int8 in paths:
        client = load_client(DEFAULT_MODEL, 15, client_quant=quant)
        if not fused:
            client.head._fused = client.tail._fused = None
        kernels.set_int8_activations(int8)
        runner = SplitRunner(client, None)
        ids = prompt_ids(client.tokenizer, messages_for("Write a haiku about the sea.", None))
        generate(runner, ids, SamplingParams(max_new_tokens=4))  # warm up
        runner.reset()
        prof = cProfile.Profile(time.thread_time)
        t0 = time.thread_time()
        prof.enable()
        out = generate(runner, ids, params, decoder="sequential")
        prof.disable()
        cpu = time.thread_time() - t0
        n = max(len(out.token_ids), 1)
        cats = categorize(pstats.Stats(prof))
        scale = cpu / max(sum(cats.values()), 1e-9)  # profiler overhead spread evenly
        row = {"cpu_ms_per_token": round(cpu / n * 1e3, 2)}
        row |= {f"{k}_ms_per_token": round(v * scale / n * 1e3, 2) for k, v in cats.items()}
        res["paths"][name] = row
        print(f"{name:<40} {json.dumps(row)}", flush=True)
    kernels.set_int8_activations(False)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
