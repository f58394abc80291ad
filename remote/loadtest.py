"""``veil-trunk loadtest``: many synthetic clients against one trunk server, or several.

Each client is what a Veil user looks like to the trunk, without the model: its own CURVE
DEALER socket and session, a prefill of ``prompt_rows`` rows, then ``steps`` steps of
``block_rows`` random hidden-state rows shaped as a draft tree, each keeping one root-to-leaf
path of the previous tree (as speculative decoding does), waiting ``think_ms`` between a reply and
its next step (the client's own compute and its network round trip). All clients run in one
thread on one poller, so the CPU goes to the server.

Per number of clients N it reports aggregate steps/s and rows/s (over the window in which all N
clients are stepping), per-step latency percentiles, the server's ``queue_ms`` median, the
server's batch-size histogram over the run (from the ``stats`` ping), the trunk rows sent per
token the synthetic trees commit (each kept root-to-leaf path counts as accepted tokens, as
decoding would commit them), and the median load the server reported in its replies
(``peers``, ``row_ms``, ``busy``; docs/protocol.md). ``bench/office_load.py`` runs real
speculative clients instead, with real acceptance.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from engine import protocol as P

HEARTBEAT_S = 0.5  # a waiting client pings this often (the real client's default heartbeat)

Progress = Callable[[str], None]


class LoadTestError(Exception):
    """A setup problem (no such server, wrong keys...) with its one-line message."""


@dataclass
class Target:
    """A server to load: where, its key, the client keypair it allows, and a label."""

    address: str
    server_key: str | None  # None: plain TCP (an --insecure server on loopback)
    client_keys: tuple[str, str] | None
    label: str = ""


@dataclass
class LoadOptions:
    clients: list[int]
    block_rows: list[int]
    steps: int = 40
    think_ms: float = 80.0
    prompt_rows: int = 32
    local_layers: int = 2  # the client split: the session covers [k, L - k)
    wire_dtype: str = "float16"
    timeout_s: float = 120.0  # for any one reply
    seed: int = 0


def _socket(ctx: zmq.Context, t: Target) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        if t.server_key is not None:
            if t.client_keys is None:
                raise LoadTestError("a client keypair is needed for a CURVE server")
            s.curve_serverkey = t.server_key.encode()
            s.curve_publickey = t.client_keys[0].encode()
            s.curve_secretkey = t.client_keys[1].encode()
        s.connect(t.address)
    except zmq.ZMQError as exc:
        s.close(0)
        raise LoadTestError(f"cannot connect to {t.address}: {exc}") from None
    except LoadTestError:
        s.close(0)
        raise
    return s


STATS_REFRESH_S = 0.25  # longer than the gateway's 100 ms statistics refresh


def server_stats(ctx: zmq.Context, t: Target, timeout_s: float = 10.0) -> dict[str, Any]:
    """The server's public statistics (a ``stats`` ping)."""
    s = _socket(ctx, t)
    try:
        s.send_multipart(P.encode(P.Ping(1, stats=True)))
        if not s.poll(int(timeout_s * 1000)):
            raise LoadTestError(
                f"no answer from {t.address} in {timeout_s:g} s (is it running, and are this "
                "client's keys allowed there?)"
            )
        msg = P.decode(s.recv_multipart())
    finally:
        s.close(0)
    if not isinstance(msg, P.Pong) or msg.stats is None:
        raise LoadTestError(f"{t.address} does not report statistics (an older veil-trunk?)")
    return msg.stats


@dataclass
class _Client:
    index: int
    sock: zmq.Socket
    rng: random.Random
    block: torch.Tensor  # [B, H] in the wire dtype, reused every step
    prompt: torch.Tensor  # [P, H]
    start_at: float
    sid: str = ""
    step: int = -1  # last step sent
    sent_at: float = 0.0
    pinged_at: float = 0.0
    next_at: float = 0.0  # when to send the next step (0: waiting for a reply)
    base: int = 0  # position of the next block's root
    keep: list[int] | None = None
    done: bool = False
    first_decode_at: float = 0.0
    last_reply_at: float = 0.0
    latencies: list[float] = field(default_factory=list)  # ms, decode steps
    replies: list[float] = field(default_factory=list)  # reply times of decode steps
    queues: list[float] = field(default_factory=list)  # server queue_ms, decode steps
    computes: list[float] = field(default_factory=list)  # server_ms, decode steps
    errors: list[str] = field(default_factory=list)
    rows_sent: int = 0  # decode rows
    committed: int = 0  # tokens the kept paths commit (synthetic acceptance)
    loads: list[P.Load] = field(default_factory=list)  # the server's load reports


def _tree(rng: random.Random, b: int, base: int) -> tuple[list[int], list[int], list[int]]:
    """(positions, parents, kept path) of a random draft tree of ``b`` nodes at ``base``."""
    parents = [-1] + [rng.randint(0, i - 1) for i in range(1, b)]
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    node = rng.randrange(b)
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return [base + d for d in depth], parents, sorted(path)


def run_clients(
    ctx: zmq.Context,
    t: Target,
    info: dict[str, Any],
    n: int,
    b: int,
    opts: LoadOptions,
) -> dict[str, Any]:
    """One run: ``n`` clients, blocks of ``b`` rows. Returns its row of the report."""
    hidden = int(info["hidden_size"])
    n_layers = int(info["n_layers"])
    lo, hi = (int(x) for x in info["layers"])
    start, end = max(lo, opts.local_layers), min(hi, n_layers - opts.local_layers)
    if start >= end:
        raise LoadTestError(f"--local-layers {opts.local_layers} leaves no trunk on this server")
    need = opts.prompt_rows + opts.steps * b + 1
    if need > int(info["max_context"]):
        raise LoadTestError(f"{need} positions needed, the server allows {info['max_context']}")
    dt = P.WIRE_DTYPES[opts.wire_dtype]
    before = server_stats(ctx, t)
    t0 = time.perf_counter()
    clients = []
    for i in range(n):
        g = torch.Generator().manual_seed(opts.seed * 7919 + i)
        rng = random.Random(opts.seed * 7919 + i)
        c = _Client(
            i,
            _socket(ctx, t),
            rng,
            (torch.randn(b, hidden, generator=g) * 0.5).to(dt),
            (torch.randn(max(opts.prompt_rows, 1), hidden, generator=g) * 0.5).to(dt),
            t0 + rng.uniform(0, opts.think_ms / 1000.0),  # staggered, like real users
        )
        clients.append(c)
    open_msg = P.encode(
        P.Open(info["config_fp"], None, start, end, opts.wire_dtype, hidden, need + 64)
    )
    poller = zmq.Poller()
    by_sock = {}
    for c in clients:
        poller.register(c.sock, zmq.POLLIN)
        by_sock[c.sock] = c
    pending = list(clients)  # not yet opened
    try:
        while not all(c.done for c in clients):
            now = time.perf_counter()
            for c in [c for c in pending if c.start_at <= now]:
                c.sock.send_multipart(open_msg)
                c.sent_at = now
                pending.remove(c)
            for c in clients:
                if c.next_at and c.next_at <= now and not c.done:
                    _send_step(c, b, opts)
            waits = [c.next_at for c in clients if c.next_at and not c.done]
            waits += [c.start_at for c in pending]
            timeout = max(0.0, min(waits) - time.perf_counter()) if waits else 0.05
            for sock in dict(poller.poll(max(1, int(min(timeout, 0.05) * 1000)))):
                c = by_sock[sock]
                _on_reply(c, P.decode(sock.recv_multipart()), b, opts)
            now = time.perf_counter()
            for c in clients:
                waiting = not c.done and not c.next_at and c.sent_at and c not in pending
                if waiting and now - c.sent_at > opts.timeout_s:
                    c.errors.append(f"no reply in {opts.timeout_s:g} s")
                    c.done = True
                elif waiting and c.sid and now - max(c.sent_at, c.pinged_at) > HEARTBEAT_S:
                    # as the real client does: the server holds a reply after any new
                    # connection until the waiting client shows its key again (remote/gate.py)
                    c.sock.send_multipart(P.encode(P.Ping(c.step, c.sid)))
                    c.pinged_at = now
    finally:
        for c in clients:
            if c.sid:
                c.sock.send_multipart(P.encode(P.Close(c.sid)))
        time.sleep(0.05)
        for c in clients:
            c.sock.close(0)
    # a cluster gateway refreshes its replicas' counters at most every 100 ms
    # (remote/cluster/router.py): ask after that, so a short run's own work is counted
    time.sleep(max(0.0, STATS_REFRESH_S - (time.perf_counter() - t0)))
    after = server_stats(ctx, t)
    return _summary(clients, n, b, before, after)


def _send_step(c: _Client, b: int, opts: LoadOptions) -> None:
    c.step += 1
    now = time.perf_counter()
    if c.step == 0 and opts.prompt_rows > 0:  # the prefill: a chain
        rows = opts.prompt_rows
        msg = P.Step(c.sid, 0, list(range(rows)), None, None, opts.wire_dtype, c.prompt[:rows])
        c.base = rows
    else:
        positions, parents, path = _tree(c.rng, b, c.base)
        msg = P.Step(c.sid, c.step, positions, parents, c.keep, opts.wire_dtype, c.block)
        c.keep = path
        c.rows_sent += len(positions)
        c.committed += len(path)
        c.base += len(path)
        if not c.first_decode_at:
            c.first_decode_at = now
    c.sock.send_multipart(P.encode(msg), copy=False)
    c.sent_at = now
    c.next_at = 0.0


def _on_reply(c: _Client, m: P.Message, b: int, opts: LoadOptions) -> None:
    now = time.perf_counter()
    if isinstance(m, P.Opened):
        c.sid = m.session
        c.next_at = now  # the prefill (or the first step) goes at once
        return
    if isinstance(m, P.Error):
        c.errors.append(f"{m.code}: {m.message}")
        c.done = True
        return
    if not isinstance(m, P.Result) or m.step != c.step:
        return  # a stray (late retry answer): not ours to count
    decode = c.step > 0 or opts.prompt_rows == 0
    if decode:
        c.latencies.append((now - c.sent_at) * 1000.0)
        c.queues.append(m.queue_ms)
        c.computes.append(m.server_ms)
        c.replies.append(now)
        if m.load is not None:
            c.loads.append(m.load)
    c.last_reply_at = now
    last = opts.steps if opts.prompt_rows > 0 else opts.steps - 1
    if c.step >= last:
        c.done = True
    else:
        c.next_at = now + opts.think_ms / 1000.0


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(q / 100.0 * (len(s) - 1))))
    return s[k]


def _hist_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    a = after.get("batch_rows_hist", {})
    b = before.get("batch_rows_hist", {})
    out = {k: int(v) - int(b.get(k, 0)) for k, v in a.items()}
    return {k: v for k, v in sorted(out.items(), key=lambda kv: int(kv[0])) if v > 0}


def _summary(
    clients: list[_Client], n: int, b: int, before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    lat = [x for c in clients for x in c.latencies]
    queue = [x for c in clients for x in c.queues]
    compute = [x for c in clients for x in c.computes]
    errors = [e for c in clients for e in c.errors]
    # steady window: every client has started stepping and none has finished
    starts = [c.first_decode_at for c in clients if c.first_decode_at]
    ends = [c.last_reply_at for c in clients if c.replies]
    w0, w1 = (max(starts), min(ends)) if starts and ends else (0.0, 0.0)
    in_window = sum(1 for c in clients for r in c.replies if w0 < r <= w1)
    if w1 - w0 < 0.5 or in_window < 2 * n:  # too short to be steady: use the whole run
        w0 = min(starts) if starts else 0.0
        w1 = max(ends) if ends else 0.0
        in_window = len(lat)
    span = max(w1 - w0, 1e-9)
    steps_per_s = in_window / span if in_window else 0.0
    rows_sent = sum(c.rows_sent for c in clients)
    committed = sum(c.committed for c in clients)
    loads = [x for c in clients for x in c.loads]
    return {
        "clients": n,
        "block_rows": b,
        "steps": len(lat),
        "steps_per_s": round(steps_per_s, 3),
        "rows_per_s": round(steps_per_s * b, 2),
        "latency_ms": {
            "p50": round(_pct(lat, 50), 2),
            "p95": round(_pct(lat, 95), 2),
            "p99": round(_pct(lat, 99), 2),
        },
        "queue_ms_p50": round(statistics.median(queue), 2) if queue else float("nan"),
        "server_ms_p50": round(statistics.median(compute), 2) if compute else float("nan"),
        "batch_rows_hist": _hist_delta(before, after),
        "rows_per_committed_token": round(rows_sent / committed, 3) if committed else None,
        "load_p50": None
        if not loads
        else {
            "peers": round(statistics.median(x.peers for x in loads), 3),
            "row_ms": round(statistics.median(x.row_ms for x in loads), 4),
            "busy": round(statistics.median(x.busy for x in loads), 4),
            "fixed_ms": round(statistics.median(x.fixed_ms for x in loads), 4),
        },
        "window_s": round(span, 2),
        "replica_sessions": _replica_delta(before, after, "replica_opened"),
        "replica_steps": _replica_delta(before, after, "replica_steps"),
        "errors": len(errors),
        "error_messages": sorted(set(errors))[:5],
    }


def _replica_delta(before: dict[str, Any], after: dict[str, Any], key: str) -> list[int]:
    """Sessions opened (``replica_opened``) or steps computed (``replica_steps``) by each replica
    of a ``--ray`` gateway during the run ([] for a single server)."""
    a, b = after.get(key, []), before.get(key, [])
    return [int(x) - (int(b[i]) if i < len(b) else 0) for i, x in enumerate(a)]


def server_info(stats: dict[str, Any], label: str) -> dict[str, Any]:
    """The report's ``server`` entry: what the server said about itself."""
    keys = (
        "model",
        "dtype",
        "layers",
        "batching",
        "max_batch_rows",
        "prefill_chunk",
        "bit_identical",
        "kernel",
        "stages",
        "replicas",
    )
    out = {k: stats[k] for k in keys if k in stats}
    out["label"] = label
    return out


def run_load(
    targets: Sequence[Target], opts: LoadOptions, progress: Progress | None = None
) -> dict[str, Any]:
    """Every (server, block rows, clients) combination, servers one after another. One
    server: ``{"server": {...}, "runs": [...]}``; several: ``{"servers": [that, ...]}``."""
    say = progress or (lambda s: None)
    ctx = zmq.Context()
    out = []
    try:
        for t in targets:
            stats = server_stats(ctx, t, min(opts.timeout_s, 10.0))
            entry: dict[str, Any] = {"server": server_info(stats, t.label), "runs": []}
            for b in opts.block_rows:
                for n in opts.clients:
                    r = run_clients(ctx, t, stats, n, b, opts)
                    entry["runs"].append(r)
                    say(
                        f"{t.label or t.address}: N={n:>3} B={b:>3}  {r['rows_per_s']:>8.1f} "
                        f"rows/s  p50 {r['latency_ms']['p50']:>7.1f} ms  queue p50 "
                        f"{r['queue_ms_p50']:>6.1f} ms  rows/token "
                        f"{r['rows_per_committed_token'] or 0:.2f}  errors {r['errors']}"
                        + (
                            f"  sessions per replica {r['replica_sessions']}"
                            if r["replica_sessions"]
                            else ""
                        )
                    )
            out.append(entry)
    finally:
        ctx.destroy(0)
    return out[0] if len(out) == 1 else {"servers": out, "ratios": ratios(out)}


def ratios(entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Batched over unbatched per block size and N, when both kinds of server were measured
    (servers paired in the order they ran: the first batching one with the first without...)."""
    on = [e for e in entries if e["server"].get("batching")]
    off = [e for e in entries if e["server"].get("batching") is False]
    out = []
    for pair, (a, z) in enumerate(zip(on, off, strict=False)):
        base = {(r["block_rows"], r["clients"]): r for r in z["runs"]}
        for r in a["runs"]:
            o = base.get((r["block_rows"], r["clients"]))
            if o is None or not o["rows_per_s"] or not o["latency_ms"]["p50"]:
                continue
            out.append(
                {
                    "pair": pair,
                    "block_rows": r["block_rows"],
                    "clients": r["clients"],
                    "rows_per_s": round(r["rows_per_s"] / o["rows_per_s"], 3),
                    "latency_p50": round(r["latency_ms"]["p50"] / o["latency_ms"]["p50"], 3),
                }
            )
    return out


def total_errors(report: dict[str, Any]) -> int:
    entries = report.get("servers", [report])
    return sum(int(r["errors"]) for e in entries for r in e["runs"])
