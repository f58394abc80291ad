"""Speculation under load (issue 32): N real speculative clients on one batching trunk.

Starts one local CURVE ``veil-trunk serve`` (batching, the default model unless ``--model``) and
``max(--clients)`` client processes, each with its own client key (one person each, so the
trunk's per-key fair queueing sees an office), split client, trunk connection and session. For
every N in ``--clients`` and every repetition, the first N clients decode for ``--seconds`` at
once, in each mode in turn (alternating, so the shared machine's other load
falls on all modes alike):

* ``seq`` — one-token steps (``decoder=sequential``): the baseline speculation must beat;
* ``old`` — speculative, sized by the client's own rate alone (``SpecOptions(load_aware=False)``,
  the behaviour before the trunk reported its load);
* ``new`` — speculative, load-aware: rows priced at ``b + peers * row_ms`` (engine/speculative.py);
* ``pipe`` — ``new`` with rounds in flight where they pay (``SpecOptions(pipeline="auto")``,
  engine/spec_pipeline.py: bets priced in the same office seconds).

Each client greedily answers prompts one after another (``--max-new-tokens`` each) until the
window closes (the generation running then is cancelled; its committed tokens count). Reported
per client and in total: committed tokens per second over the window, trunk rows sent per
committed token (decode rows; prompts excluded), one-token steps, and the load the trunk last
reported. Every client learns from scratch in every run (``engine.speculative.forget``).

    python bench/office_load.py --clients 1,4,8 --seconds 30 --reps 2 --json office.json

All processes share this machine's cores: the clients' own compute (head, tail, LM head,
drafting) competes with the trunk's, which a real office (one laptop per person) would not.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a lighthouse.",
    "List three uses of a paperclip.",
    "What is the capital of Australia, and why was it chosen?",
    "Write a short Python function that reverses a string, with a docstring.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Give four tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
]
MODES = ("seq", "old", "new", "pipe")


def _keypair() -> tuple[str, str]:
    import zmq

    pub, sec = zmq.curve_keypair()
    return pub.decode(), sec.decode()


def _serve(model: str, server: tuple[str, str], allow: list[str]) -> tuple[Any, str]:
    """A local ``veil-trunk serve`` allowing every client key; (process, address)."""
    from engine.local_server import free_port, trunk_command

    port = free_port()
    cmd = [
        *trunk_command(),
        "serve",
        "--model",
        model,
        "--bind",
        f"tcp://127.0.0.1:{port}",
        "--keys-from-stdin",
        "--max-sessions",
        str(2 * len(allow) + 2),
        "--kernel-threads",
        str(os.cpu_count() or 1),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    log = open(os.environ.get("VEIL_OFFICE_LOG", os.devnull), "w")  # noqa: SIM115 (the server's log)
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        cwd=str(REPO),
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"public": server[0], "secret": server[1], "allow": allow}) + "\n")
    proc.stdin.close()
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, f"tcp://127.0.0.1:{port}"


def _client_main(index: int, conn: Any, model: str, address: str, keys: Any, opts: Any) -> None:
    """One client process: load the split client, connect, then run commands from ``conn``."""
    import torch

    torch.set_num_threads(1)
    from engine.chat import messages_for, prompt_ids
    from engine.generate import CancelToken, generate_sequential
    from engine.sampling import SamplingParams
    from engine.speculative import SpecOptions, forget, generate_speculative
    from engine.split import SplitRunner, load_client
    from engine.transport import connect_trunk

    client = load_client(model, opts["local_layers"])
    trunk = connect_trunk(address, client, server_key=keys[0], client_keys=keys[1])
    runner = SplitRunner(client, trunk)
    ids = [
        prompt_ids(client.tokenizer, messages_for(p, None))
        for p in PROMPTS[index % len(PROMPTS) :] + PROMPTS[: index % len(PROMPTS)]
    ]
    params = SamplingParams(max_new_tokens=opts["max_new_tokens"])
    with torch.inference_mode():  # warm-up: first-call costs out of the windows
        generate_sequential(runner, ids[0], SamplingParams(max_new_tokens=4))
    conn.send(("ready", index))
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            break
        _, mode, start_at, seconds = cmd
        forget(runner)
        tokens = rows = steps = one_token = gens = ahead = won = 0
        while time.time() < start_at:
            time.sleep(0.001)
        end_at = start_at + seconds
        cancel = CancelToken()
        timer = threading.Timer(max(end_at - time.time(), 0.0), cancel.cancel)
        timer.start()
        k = 0
        with torch.inference_mode():
            while not cancel.cancelled:
                p = ids[k % len(ids)]
                k += 1
                if mode == "seq":
                    res = generate_sequential(runner, p, params, cancel=cancel)
                else:
                    o = SpecOptions(
                        load_aware=mode != "old", pipeline="auto" if mode == "pipe" else "off"
                    )
                    res = generate_speculative(runner, p, params, cancel=cancel, options=o)
                st = res.stats
                tokens += len(res.token_ids)
                rows += st.tree_nodes_sent
                steps += max(st.round_trips - 1, 0)
                one_token += st.one_token_steps
                ahead += st.pipelined_rounds
                won += st.pipeline_hits
                gens += 1
        timer.cancel()
        load = getattr(trunk, "load", None)
        conn.send(
            {
                "client": index,
                "mode": mode,
                "tokens": tokens,
                "tok_s": tokens / seconds,
                "rows": rows,
                "rows_per_token": rows / tokens if tokens else None,
                "steps": steps,
                "rounds_sent_ahead": ahead,
                "bets_won": won,
                "one_token_steps": one_token,
                "generations": gens,
                "load": None
                if load is None
                else {"peers": load.peers, "row_ms": load.row_ms, "busy": load.busy},
            }
        )
    trunk.close()


def _row(n: int, mode: str, rep: int, per: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(p["tokens"] for p in per)
    rows = sum(p["rows"] for p in per)
    return {
        "clients": n,
        "mode": mode,
        "rep": rep,
        "total_tok_s": round(sum(p["tok_s"] for p in per), 3),
        "per_client_tok_s": [round(p["tok_s"], 3) for p in per],
        "rows_per_token": round(rows / tokens, 3) if tokens else None,
        "one_token_steps": sum(p["one_token_steps"] for p in per),
        "steps": sum(p["steps"] for p in per),
        "rounds_sent_ahead": sum(p["rounds_sent_ahead"] for p in per),
        "bets_won": sum(p["bets_won"] for p in per),
        "load_peers": [p["load"]["peers"] if p["load"] else None for p in per],
        "load_row_ms": [p["load"]["row_ms"] if p["load"] else None for p in per],
    }


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N: each mode's median total tok/s and rows/token over repetitions; ratios new/old and
    new/seq per repetition (each pair ran back to back); the slowest client's ratio to seq."""
    out = []
    for n in sorted({r["clients"] for r in runs}):
        mine = [r for r in runs if r["clients"] == n]
        reps = sorted({r["rep"] for r in mine})
        by = {(r["mode"], r["rep"]): r for r in mine}
        s: dict[str, Any] = {"clients": n}
        for m in MODES:
            xs = [by[(m, k)] for k in reps if (m, k) in by]
            if xs:
                s[m] = {
                    "total_tok_s": round(statistics.median(x["total_tok_s"] for x in xs), 3),
                    "per_client_tok_s": round(
                        statistics.median(x["total_tok_s"] / n for x in xs), 3
                    ),
                    "rows_per_token": round(
                        statistics.median(x["rows_per_token"] or 0 for x in xs), 3
                    ),
                }
        for a, b in (("new", "old"), ("new", "seq"), ("old", "seq"), ("pipe", "new")):
            rs = [
                by[(a, k)]["total_tok_s"] / by[(b, k)]["total_tok_s"]
                for k in reps
                if (a, k) in by and (b, k) in by and by[(b, k)]["total_tok_s"]
            ]
            if rs:
                s[f"{a}/{b}"] = [round(x, 3) for x in rs]
        for m in ("old", "new", "pipe"):
            worst = [
                min(
                    x / max(statistics.median(by[("seq", k)]["per_client_tok_s"]), 1e-9)
                    for x in by[(m, k)]["per_client_tok_s"]
                )
                for k in reps
                if (m, k) in by and ("seq", k) in by
            ]
            if worst:
                s[f"{m}_slowest_client_vs_seq"] = [round(x, 3) for x in worst]
        out.append(s)
    return out


def main(argv: list[str] | None = None) -> int:
    from engine.loading import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--clients", default="1,4,8", help="comma-separated N")
    ap.add_argument("--seconds", type=float, default=30.0, help="window per run")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--local-layers", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        ns = [int(x) for x in args.clients.split(",") if x.strip()]
    except ValueError:
        ap.error("--clients must be comma-separated integers")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not ns or min(ns) < 1 or any(m not in MODES for m in modes):
        ap.error(f"--clients must be positive; --modes a subset of {','.join(MODES)}")
    opts = {"local_layers": args.local_layers, "max_new_tokens": args.max_new_tokens}
    ctx = mp.get_context("spawn")
    runs: list[dict[str, Any]] = []
    server = _keypair()
    clients = [_keypair() for _ in range(max(ns))]
    srv, address = _serve(args.model, server, [c[0] for c in clients])
    try:
        pipes, procs = [], []
        for i in range(max(ns)):
            a, b = ctx.Pipe()
            keys = (server[0], clients[i])
            p = ctx.Process(
                target=_client_main, args=(i, b, args.model, address, keys, opts), daemon=True
            )
            p.start()
            pipes.append(a)
            procs.append(p)
        for a in pipes:
            a.recv()
        print(f"{len(pipes)} clients ready", file=sys.stderr)
        try:
            for rep in range(args.reps):
                for n in ns:
                    order = modes if rep % 2 == 0 else modes[::-1]
                    for mode in order:
                        start_at = time.time() + 1.0
                        for a in pipes[:n]:
                            a.send(("run", mode, start_at, args.seconds))
                        per = [a.recv() for a in pipes[:n]]
                        r = _row(n, mode, rep, per)
                        runs.append(r)
                        print(
                            f"rep {rep} N={n} {mode:>3}: total {r['total_tok_s']:7.2f} tok/s, "
                            f"per client {r['per_client_tok_s']}, rows/token "
                            f"{r['rows_per_token']}, one-token steps {r['one_token_steps']}, "
                            f"peers {r['load_peers']}, row_ms {r['load_row_ms']}",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            for a in pipes:
                a.send(("quit",))
            for p in procs:
                p.join(30)
    finally:
        srv.terminate()
        srv.wait(10)
    summary = summarize(runs)
    result = {"model": args.model, "seconds": args.seconds, "runs": runs, "summary": summary}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
