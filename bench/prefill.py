"""Prompt processing (prefill) speed: Veil fully local and through a trunk server vs llama.cpp.

    python bench/prefill.py [--model GGUF] [--lengths 1024,4096,8000] [--threads 2]
                            [--chunks none,256] [--rtt-ms 80] [--repeats 2]
                            [--server-reads one,256x1,256x3] [--pin]
                            [--out bench-out/prefill.json] [--plot docs/img/prefill.png]

A long prompt (public text: this Python's standard-library docstrings, tokenized with the
model's tokenizer and cut to each length) is read by:

* llama.cpp (``llama-cpp-python``, same GGUF, same threads, ``n_batch`` 512): ``Llama.eval``;
* Veil fully local (half the layers local, the GGUF's own quantized blocks, the default int8
  activations), as one block and in each ``--chunks`` size (the app reads in 256-row blocks
  to show progress), up to the logits of the last position;
* Veil through a ``veil-trunk serve`` child on this machine behind the project's WAN proxy
  (``--rtt-ms``; k = 2): time to the first generated token, which is what a user waits for;
  the prompt as one block, or as the app reads it (``--server-reads 256x3``: 256-row blocks,
  three in flight, the client's head layers for one block running while the server works on
  the one before). ``--pin --threads 1`` puts the server and the client on cores of their own,
  as on two machines.

Each measurement runs in its own child process, engines interleaved length by length so they
see the same machine load. Prefill tokens/s = prompt tokens / seconds. Run it under the shared
CPU lock on a quiet machine; state the CPU with the numbers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def prompt_ids(model: str, n: int) -> list[int]:
    from engine.audit.corpus import stdlib_texts
    from engine.loading import load_tokenizer, resolve

    tok = load_tokenizer(resolve(model).folder)
    ids: list[int] = []
    for text in stdlib_texts(4000):
        ids += tok.encode(text + "\n\n", add_special_tokens=False)
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"not enough public text for {n} tokens")


def child_llamacpp(model: str, ids: list[int], threads: int) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(
        model_path=model, n_ctx=len(ids) + 64, n_threads=threads, n_batch=512, verbose=False
    )
    llm.eval(ids[:16])  # warm up
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    return {"seconds": time.perf_counter() - t0}


def child_veil(model: str, ids: list[int], threads: int, chunk: int | None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from engine import kernels
    from engine.generate import Prefill, read_prompt
    from engine.loading import load_config, resolve
    from engine.split import SplitRunner, load_client

    kernels.set_threads(threads)
    cfg = load_config(resolve(model).folder)
    client = load_client(model, (cfg.n_layers + 1) // 2, warm_up=True)
    runner = SplitRunner(client, None)

    def last(s: Any) -> Any:
        return client.logits(s.final[-1:])  # [1, V]

    read_prompt(runner, last, ids[:300], Prefill(64), None)
    runner.reset()
    t0 = time.perf_counter()
    read_prompt(runner, last, ids, Prefill(chunk), None)
    return {"seconds": time.perf_counter() - t0}


def child_remote(
    model: str,
    ids: list[int],
    threads: int,
    rtt_ms: float,
    chunk: int | None = None,
    window: int = 1,
    pin: bool = False,
    server_chunk: int | None = None,
) -> dict[str, Any]:
    import os

    import torch

    from engine import kernels
    from engine.generate import Prefill, generate
    from engine.local_server import start_local_trunk
    from engine.sampling import SamplingParams
    from engine.split import SplitRunner, load_client

    if pin:  # two machines on one: the server child on the last core, this client on the first
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[-1]})
    torch.set_num_threads(threads)
    kernels.set_threads(threads)
    client = load_client(model, 2, warm_up=True)
    extra = [] if server_chunk is None else ["--prefill-chunk", str(server_chunk)]
    with start_local_trunk(
        model, min_local_layers=2, rtt_ms=rtt_ms, threads=threads, extra_args=extra
    ) as srv:
        if pin:
            os.sched_setaffinity(0, {cores[0]})
        trunk = srv.connect(client)
        runner = SplitRunner(client, trunk)
        prefill = None if chunk is None else Prefill(chunk, window=window)
        one = SamplingParams(max_new_tokens=1)
        generate(runner, ids[:300], one, prefill=prefill)  # warm up both ends
        first: list[float] = []
        t0 = time.perf_counter()
        generate(
            runner, ids, one, on_text=lambda _t: first.append(time.perf_counter()), prefill=prefill
        )
        t1 = time.perf_counter()
        trunk.close()
    return {"seconds": (first[0] if first else t1) - t0}


def child_main(spec: str) -> None:
    job = json.loads(spec)
    kind = job["kind"]
    if kind == "llamacpp":
        out = child_llamacpp(job["model"], job["ids"], job["threads"])
    elif kind == "veil":
        out = child_veil(job["model"], job["ids"], job["threads"], job["chunk"])
    else:
        read = job.get("read") or [None, 1]
        out = child_remote(
            job["model"],
            job["ids"],
            job["threads"],
            job["rtt_ms"],
            *read,
            job.get("pin", False),
            job.get("server_chunk"),
        )
    print("RESULT " + json.dumps(out), flush=True)


def run_child(job: dict[str, Any]) -> dict[str, Any] | None:
    p = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(job)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            res: dict[str, Any] = json.loads(line[7:])
            return res
    print(f"  {job['kind']} failed: {p.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    return None


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
        return 0
    from engine.loading import DEFAULT_MODEL, embedded_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--lengths", default="1024,4096,8000")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", default="none,256", help="Veil block sizes ('none': one block)")
    ap.add_argument("--rtt-ms", type=float, default=80.0, help="0: skip the server run")
    ap.add_argument(
        "--server-reads",
        default="one",
        help="how the server runs read the prompt: 'one' (one block), or ROWSxWINDOW "
        "(blocks of ROWS rows, WINDOW of them in flight; the app reads 256x3)",
    )
    ap.add_argument(
        "--server-chunks",
        default="default",
        help="server runs: the trunk's --prefill-chunk, comma-separated values alternated "
        "('default': the server's own)",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="server runs: the server on the last core, the client on the first (--threads 1 "
        "gives each its own core, as two machines would)",
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip-llamacpp", action="store_true", help="no llama.cpp rows")
    ap.add_argument("--out", default="bench-out/prefill.json")
    ap.add_argument("--plot", default="", help="also draw prefill tok/s by length to this PNG")
    args = ap.parse_args()
    model = args.model or str(embedded_gguf(DEFAULT_MODEL))
    try:
        import llama_cpp  # noqa: F401

        have_llama = not args.skip_llamacpp
    except ImportError:
        have_llama = False
        print("llama-cpp-python is not importable: llama.cpp rows skipped", file=sys.stderr)
    chunks = [None if c == "none" else int(c) for c in args.chunks.split(",") if c]
    reads = [
        None if r == "one" else [int(x) for x in r.split("x")] for r in args.server_reads.split(",")
    ]
    server_chunks = [None if c == "default" else int(c) for c in args.server_chunks.split(",") if c]
    rows: list[dict[str, Any]] = []
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = prompt_ids(model, n)
        for rep in range(args.repeats):
            jobs: list[dict[str, Any]] = []
            if have_llama:
                jobs.append({"kind": "llamacpp"})
            jobs += [{"kind": "veil", "chunk": c} for c in chunks]
            if args.rtt_ms > 0:
                jobs += [
                    {
                        "kind": "remote",
                        "rtt_ms": args.rtt_ms,
                        "read": r,
                        "pin": args.pin,
                        "server_chunk": sc,
                    }
                    for r in reads
                    for sc in server_chunks
                ]
            for job in jobs:
                job.update(model=model, ids=ids, threads=args.threads)
                res = run_child(job)
                if res is None:
                    continue
                name = job["kind"] + (f" chunk {job.get('chunk')}" if job["kind"] == "veil" else "")
                if job.get("read"):
                    name += " {}x{}".format(*job["read"])
                if job.get("server_chunk"):
                    name += f" trunk {job['server_chunk']}"
                row = {"engine": name, "tokens": n, "repeat": rep, "seconds": res["seconds"]}
                row["tok_s"] = n / res["seconds"]
                rows.append(row)
                print(f"{n:>6} {name:<18} {res['seconds']:8.2f} s {row['tok_s']:9.1f} tok/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "threads": args.threads, "rows": rows}, indent=1))
    print(f"wrote {out}")
    if args.plot:
        plot(rows, Path(args.plot), args.threads, args.rtt_ms)
    return 0


def plot(rows: list[dict[str, Any]], path: Path, threads: int, rtt_ms: float) -> None:
    """Prefill tokens/s by prompt length, one line per engine (the mean of the repeats); the
    server run is prompt tokens / time to the first token."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot", file=sys.stderr)
        return
    labels = {
        "llamacpp": "llama.cpp (llama-cpp-python)",
        "veil chunk None": "Veil fully local, the whole prompt as one block",
        "veil chunk 256": "Veil fully local, 256-row blocks (as the app reads it)",
        "remote": f"Veil through a server, {rtt_ms:g} ms RTT (to first token)",
    }
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for engine in dict.fromkeys(r["engine"] for r in rows):
        by_n: dict[int, list[float]] = {}
        for r in rows:
            if r["engine"] == engine:
                by_n.setdefault(r["tokens"], []).append(r["tok_s"])
        ns = sorted(by_n)
        ax.plot(
            ns,
            [sum(by_n[n]) / len(by_n[n]) for n in ns],
            marker="o",
            label=labels.get(engine, engine),
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prompt tokens / s")
    ax.set_title(f"Prefill, {threads} threads, same GGUF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
