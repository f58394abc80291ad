"""Fully local decode speed and peak memory: Veil vs llama.cpp on the same GGUF file.

    python bench/local_vs_llamacpp.py [--model GGUF] [--prompts FILE] [--max-new-tokens 128]
                                      [--threads 2] [--n 4] [--veil-modes auto,auto+exact,none]
                                      [--decoder sequential|speculative]
                                      [--out bench-out/local_vs_llamacpp.json]

Each engine runs in its own child process per prompt (so peak RSS is that engine's alone), the
engines interleaved prompt by prompt so both see the same machine load. Greedy, the same chat
prompt token ids for both. llama.cpp is ``llama-cpp-python`` (not a Veil dependency; skipped if
it is not importable). Veil runs ``--local-layers`` = half the layers (fully local) with
``--decoder`` (sequential by default; speculative is what ``veil generate`` uses), each
``--veil-modes`` entry being a ``--client-quant`` choice: ``auto`` keeps the GGUF's own quantized
blocks (multiplied with int8 activations, the default arithmetic), ``none`` is the float32
reference; a ``+exact`` suffix multiplies with float activations (``--exact-float``), ``+i8a``
(the old name of the default) with int8 ones.

Decode tokens/s = (generated tokens - 1) / (time from the first generated token to the last).
Run it under the shared CPU lock.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child_llamacpp(model: str, ids: list[int], n_new: int, threads: int) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
    llm.reset()
    llm.eval(ids)  # prompt
    out: list[int] = []
    t_first = 0.0
    for i in range(n_new):
        tok = int(llm.sample(temp=0.0, top_k=1))
        if i == 0:
            t_first = time.perf_counter()
        out.append(tok)
        if tok == llm.token_eos():
            break
        llm.eval([tok])
    t_end = time.perf_counter()
    return {"tokens": out, "decode_s": t_end - t_first}


def child_veil(
    model: str, ids: list[int], n_new: int, threads: int, quant: str, decoder: str
) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from engine import kernels
    from engine.generate import generate
    from engine.loading import load_config, resolve
    from engine.sampling import SamplingParams
    from engine.split import SplitRunner, load_client

    kernels.set_threads(threads)
    quant, _, arith = quant.partition("+")
    kernels.set_int8_activations(arith != "exact")  # int8 activations unless "+exact"
    cfg = load_config(resolve(model).folder)
    client = load_client(model, (cfg.n_layers + 1) // 2, client_quant=quant)
    runner = SplitRunner(client, None)
    generate(runner, ids[:8], SamplingParams(max_new_tokens=4))  # compile / warm up
    runner.reset()
    res = generate(runner, ids, SamplingParams(max_new_tokens=n_new), decoder=decoder)
    return {
        "tokens": res.token_ids,
        "decode_s": res.stats.decode_s,
        "local_param_bytes": client.local_param_bytes(),
        "client_quant": client.client_quant,
    }


def child_main(spec: str) -> None:
    job = json.loads(spec)
    if job["engine"] == "llama.cpp":
        out = child_llamacpp(job["model"], job["ids"], job["n_new"], job["threads"])
    else:
        out = child_veil(
            job["model"], job["ids"], job["n_new"], job["threads"], job["quant"], job["decoder"]
        )
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(out))


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(job)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
    )
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"{job['engine']} failed: {p.stderr[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, metavar="GGUF")
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "bench" / "prompts.jsonl"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=4, help="prompts to run (from the top)")
    ap.add_argument("--veil-modes", default="auto,auto+exact,none")
    ap.add_argument("--decoder", default="sequential", choices=("sequential", "speculative"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        child_main(args.child)
        return 0
    from app.cmd_bench import machine
    from engine.chat import messages_for, prompt_ids
    from engine.loading import embedded_gguf, load_tokenizer, resolve

    model = args.model or str(embedded_gguf())
    tok = load_tokenizer(resolve(model).folder)
    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line]
    engines: list[tuple[str, str]] = [("veil", q) for q in args.veil_modes.split(",") if q]
    try:
        import llama_cpp

        engines.insert(0, ("llama.cpp", llama_cpp.__version__))
    except ImportError:
        print("llama-cpp-python is not importable: Veil only", file=sys.stderr)
    rows = []
    for p in prompts[: args.n]:
        ids = prompt_ids(tok, messages_for(p["prompt"], None))
        row: dict[str, Any] = {"id": p["id"], "prompt_tokens": len(ids)}
        for eng, mode in engines:
            job = {"engine": eng, "model": model, "ids": ids, "n_new": args.max_new_tokens}
            job |= {"threads": args.threads, "quant": mode, "decoder": args.decoder}
            r = run_child(job)
            key = eng if eng == "llama.cpp" else f"veil-{mode}"
            n = len(r["tokens"])
            r["decode_tok_s"] = (n - 1) / r["decode_s"] if n > 1 and r["decode_s"] > 0 else 0.0
            row[key] = r
            print(
                f"{p['id']:<24} {key:<10} {r['decode_tok_s']:7.1f} tok/s "
                f"{n:4d} tokens  peak RSS {r['peak_rss_bytes'] / 1e6:7.0f} MB",
                flush=True,
            )
        rows.append(row)
    keys = [k for k in rows[0] if k not in ("id", "prompt_tokens")]
    summary: dict[str, Any] = {}
    for key in keys:
        toks = sum(len(r[key]["tokens"]) - 1 for r in rows)
        secs = sum(r[key]["decode_s"] for r in rows)
        summary[key] = {
            "decode_tok_s": round(toks / secs, 2) if secs else 0.0,
            "peak_rss_mb": round(statistics.median(r[key]["peak_rss_bytes"] for r in rows) / 1e6),
        }
    if "llama.cpp" in summary:
        base = summary["llama.cpp"]["decode_tok_s"]
        for key in keys:
            summary[key]["ratio_to_llama_cpp"] = round(summary[key]["decode_tok_s"] / base, 3)
        for key in keys:
            if key.startswith("veil"):
                same = sum(r[key]["tokens"] == r["llama.cpp"]["tokens"] for r in rows)
                summary[key]["same_tokens_as_llama_cpp"] = f"{same}/{len(rows)}"
    out = {
        "model": model,
        "machine": machine(),
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "summary": summary,
        "prompts": rows,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
