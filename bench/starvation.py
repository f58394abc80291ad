"""One key trying to starve the others (issue 29, defect 3), measured end to end.

Starts a local ``veil-trunk serve`` (CURVE, ephemeral keys, two allowed client keys), then:

1. the victim alone: ``veil-trunk loadtest``'s client (one user, 8-row steps) — p50 latency;
2. the same while an attacker process (the other key) keeps two sessions full of 4,096-row steps
   (``keep=[]``, as many in flight as the server accepts, pinging like a real client);
3. the attacker is killed (it vanishes without closing anything): how long the server goes on
   computing after that (its batch counter, read with the server's own key, the admin's view).

    python bench/starvation.py --model smollm2-135m-instruct [--steps 40] [--json out.json]

The machine's other load changes every number: run it twice and say what else was running.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import zmq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine import protocol as P  # noqa: E402
from engine.local_server import free_port, trunk_command  # noqa: E402
from remote import loadtest as L  # noqa: E402

ATTACK_ROWS = 4096
ATTACK_SESSIONS = 2
ATTACK_IN_FLIGHT = 4


def _keypair() -> tuple[str, str]:
    pub, sec = zmq.curve_keypair()
    return pub.decode(), sec.decode()


def _serve(model: str, server: tuple[str, str], allow: list[str], extra: list[str]) -> Any:
    port = free_port()
    cores = os.cpu_count() or 1
    cmd = [
        *trunk_command(),
        "serve",
        "--model",
        model,
        "--bind",
        f"tcp://127.0.0.1:{port}",
        "--keys-from-stdin",
        "--threads",
        "1",
        "--kernel-threads",
        str(cores),
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(REPO)
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


def _victim(target: L.Target, steps: int) -> dict[str, Any]:
    opts = L.LoadOptions(clients=[1], block_rows=[8], steps=steps, think_ms=80.0, prompt_rows=32)
    run = L.run_load([target], opts)["runs"][0]
    return {
        "p50_ms": run["latency_ms"]["p50"],
        "p95_ms": run["latency_ms"]["p95"],
        "queue_ms_p50": run["queue_ms_p50"],
        "server_ms_p50": run["server_ms_p50"],
        "errors": run["errors"],
    }


def _stats(ctx: zmq.Context, targets: list[L.Target]) -> dict[str, Any]:
    for t in targets:
        try:
            return L.server_stats(ctx, t, 3.0)
        except L.LoadTestError:
            continue
    raise SystemExit("no statistics from the server")


def attack(address: str, server_key: str, keys: tuple[str, str]) -> None:
    """The attacker process: never returns (it is killed)."""
    ctx = zmq.Context()
    t = L.Target(address, server_key, keys)
    info = L.server_stats(ctx, t, 10.0)
    h, n_layers = int(info["hidden_size"]), int(info["n_layers"])
    start, end = max(int(info["layers"][0]), 2), min(int(info["layers"][1]), n_layers - 2)
    x = (torch.randn(ATTACK_ROWS, h, generator=torch.Generator().manual_seed(1)) * 0.5).half()
    socks, sids, nxt, done = [], [], [], []
    for _ in range(ATTACK_SESSIONS):
        s = L._socket(ctx, t)
        s.send_multipart(P.encode(P.Open(info["config_fp"], None, start, end, "float16", h, 8192)))
        r = P.decode(s.recv_multipart())
        assert isinstance(r, P.Opened), r
        socks.append(s)
        sids.append(r.session)
        nxt.append(0)
        done.append(-1)
    print("ATTACKING", flush=True)
    positions = list(range(ATTACK_ROWS))
    retry_at = [0.0] * ATTACK_SESSIONS
    last_ping = 0.0
    while True:
        now = time.monotonic()
        for i, s in enumerate(socks):
            while nxt[i] - done[i] - 1 < ATTACK_IN_FLIGHT and now >= retry_at[i]:
                keep = None if nxt[i] == 0 else []
                msg = P.Step(sids[i], nxt[i], positions, None, keep, "float16", x)
                s.send_multipart(P.encode(msg), copy=False)
                nxt[i] += 1
        if now - last_ping > 0.5:
            for i, s in enumerate(socks):
                s.send_multipart(P.encode(P.Ping(1, sids[i])))
            last_ping = now
        for i, s in enumerate(socks):
            while s.poll(0):
                r = P.decode(s.recv_multipart())
                if isinstance(r, P.Result):
                    done[i] = max(done[i], r.step)
                elif isinstance(r, P.Error) and r.step is not None:
                    nxt[i] = min(nxt[i], r.step)  # refused (busy): send it again a bit later
                    retry_at[i] = time.monotonic() + 0.5
        time.sleep(0.02)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=40, help="victim steps per measurement")
    ap.add_argument("--serve-args", default="", help="more `serve` options, quoted")
    ap.add_argument("--quiet-s", type=float, default=5.0, help="no batch for this long: stopped")
    ap.add_argument("--max-wait-s", type=float, default=180.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--attack", nargs=2, metavar=("ADDRESS", "SERVER_KEY"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.attack:
        d = json.loads(sys.stdin.readline())
        attack(a.attack[0], a.attack[1], (d["public"], d["secret"]))
        return 0
    import shlex

    server, victim, attacker = _keypair(), _keypair(), _keypair()
    proc, address = _serve(a.model, server, [victim[0], attacker[0]], shlex.split(a.serve_args))
    vt = L.Target(address, server[0], victim)
    admin = L.Target(address, server[0], server)
    ctx = zmq.Context()
    out: dict[str, Any] = {"model": a.model, "load_before": os.getloadavg()}
    att = None
    try:
        out["unloaded"] = _victim(vt, a.steps)
        print(f"victim alone: p50 {out['unloaded']['p50_ms']} ms", file=sys.stderr)
        att = subprocess.Popen(
            [sys.executable, __file__, "--attack", address, server[0]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert att.stdin is not None and att.stdout is not None
        att.stdin.write(json.dumps({"public": attacker[0], "secret": attacker[1]}) + "\n")
        att.stdin.close()
        assert att.stdout.readline().startswith("ATTACKING")
        time.sleep(3.0)  # its steps are queued
        before = _stats(ctx, [admin, vt])
        out["attacked"] = _victim(vt, a.steps)
        during = _stats(ctx, [admin, vt])
        print(f"victim under attack: p50 {out['attacked']['p50_ms']} ms", file=sys.stderr)
        batches = during["batches"] - before["batches"]
        batch_s = (during["busy_s"] - before["busy_s"]) / max(batches, 1)
        out["batches_during_attack"] = batches
        out["mean_batch_ms_during_attack"] = round(batch_s * 1000, 1)
        att.kill()
        att.wait()
        gone = time.monotonic()
        seen = _stats(ctx, [admin, vt])
        last, last_change = seen.get("batches", 0), gone
        quiet = max(a.quiet_s, 3 * batch_s)
        while time.monotonic() - last_change < quiet:
            if time.monotonic() - gone > a.max_wait_s:
                break
            time.sleep(0.25)
            b = _stats(ctx, [admin, vt]).get("batches", 0)
            if b != last:
                last, last_change = b, time.monotonic()
        out["attacker_work_after_leaving_s"] = round(last_change - gone, 2)
        out["still_computing_at_end"] = time.monotonic() - gone > a.max_wait_s
        out["ratio_p50"] = round(out["attacked"]["p50_ms"] / out["unloaded"]["p50_ms"], 2)
        out["load_after"] = os.getloadavg()
    finally:
        if att is not None and att.poll() is None:
            att.kill()
        proc.terminate()
        proc.wait(30)
        ctx.destroy(0)
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
