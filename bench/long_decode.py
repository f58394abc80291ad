"""Decode speed at long context: Veil fully local vs llama.cpp after a long prompt.

    python bench/long_decode.py [--model GGUF] [--lengths 128,4096,8192] [--tokens 64]
                                [--threads 2] [--repeats 2] [--out bench-out/long_decode.json]

A paralegal pastes a contract, then asks questions: every answer token attends to the whole
document. For each prompt length, a prompt of public text (this Python's standard-library
docstrings, as ``bench/prefill.py`` builds it) is read, then ``--tokens`` more tokens are fed one
at a time and timed (the prompt's own next tokens, so both engines do exactly the same steps
whatever they would have sampled):

* llama.cpp (``llama-cpp-python``, same GGUF, same threads): ``Llama.eval`` of one token;
* Veil fully local (half the layers local, the GGUF's own quantized blocks, the default int8
  activations): ``runner.forward`` of one token, as sequential decoding does.

Each measurement runs in its own child process, the two engines alternating, ``--repeats`` times
per length. Decode tokens/s = tokens / seconds. Run it under the shared CPU lock on a quiet
machine and state the CPU with the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def child_veil(model: str, ids: list[int], tokens: int, threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    from engine import kernels
    from engine.generate import read_prompt
    from engine.loading import load_config, resolve
    from engine.split import SplitRunner, load_client

    kernels.set_threads(threads)
    cfg = load_config(resolve(model).folder)
    client = load_client(model, (cfg.n_layers + 1) // 2, warm_up=True)
    runner = SplitRunner(client, None)
    prompt, steps = ids[: len(ids) - tokens], ids[len(ids) - tokens :]
    with torch.inference_mode():
        read_prompt(runner, lambda s: client.logits(s.final[-1:]), prompt, None, None)
        t0 = time.perf_counter()
        for i, tok in enumerate(steps):
            runner.forward([tok], [len(prompt) + i])  # [1, V]: the step's logits
        return time.perf_counter() - t0


def child_llamacpp(model: str, ids: list[int], tokens: int, threads: int) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=len(ids) + 8, n_threads=threads, n_batch=512, verbose=False)
    llm.eval(ids[:16])  # warm up
    llm.reset()
    prompt, steps = ids[: len(ids) - tokens], ids[len(ids) - tokens :]
    llm.eval(prompt)
    t0 = time.perf_counter()
    for tok in steps:
        llm.eval([tok])
    return time.perf_counter() - t0


def run_child(kind: str, model: str, length: int, tokens: int, threads: int) -> float | None:
    job = json.dumps({"kind": kind, "model": model, "length": length, "tokens": tokens})
    p = subprocess.run(
        [sys.executable, __file__, "--child", job, "--threads", str(threads)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return float(line[7:])
    print(f"  {kind} failed: {p.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    return None


def main() -> int:
    from engine.loading import embedded_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--lengths", default="128,4096,8192", help="context lengths (prompt + steps)")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--out", default="bench-out/long_decode.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        from prefill import prompt_ids

        job = json.loads(a.child)
        ids = prompt_ids(job["model"], job["length"])
        fn = child_veil if job["kind"] == "veil" else child_llamacpp
        print(f"RESULT {fn(job['model'], ids, job['tokens'], a.threads)}", flush=True)
        return 0
    model = a.model or str(embedded_gguf())
    kinds = ["veil"] if a.skip_llamacpp else ["llamacpp", "veil"]
    report: dict[str, Any] = {
        "model": model,
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": a.threads,
        "tokens": a.tokens,
        "rows": [],
    }
    print(f"{'context':>8s} {'engine':>9s} {'decode tok/s':>13s}")
    for length in (int(x) for x in a.lengths.split(",")):
        if length <= a.tokens:
            raise SystemExit(f"--lengths: {length} must exceed --tokens {a.tokens}")
        for r in range(a.repeats):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                sec = run_child(kind, model, length, a.tokens, a.threads)
                rate = a.tokens / sec if sec else None
                report["rows"].append({"context": length, "engine": kind, "tok_s": rate})
                shown = f"{rate:13.1f}" if rate else f"{'failed':>13s}"
                print(f"{length:8d} {kind:>9s} {shown}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
