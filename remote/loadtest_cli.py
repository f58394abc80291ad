"""The ``veil-trunk loadtest`` command line: options, servers to load (given or spawned here),
and the report (table on stdout, ``--json``, ``--plot``). The load itself: :mod:`remote.loadtest`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from remote.cli import CliError
from remote.flags import finite_float, tcp_address_problem


def add_parser(sub: Any) -> None:
    """Add the ``loadtest`` subcommand to ``veil-trunk``'s subparsers."""
    lt = sub.add_parser(
        "loadtest",
        help="measure a trunk server under many synthetic clients (rows/s, latency, batches)",
    )
    lt.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="INVITE|tcp://HOST:PORT",
        help="a running server (repeat to measure several in one run, e.g. with and without "
        "batching)",
    )
    lt.add_argument("--server-key", default=None, help="the server's public key (bare address)")
    lt.add_argument(
        "--client-keys",
        type=Path,
        default=None,
        metavar="FILE",
        help='JSON {"public": ..., "secret": ...} of an allowed client keypair (default: this '
        "computer's Veil keypair from the keyring), or the server's --keys folder: its own "
        "keypair, the admin's, which sees every user's batches",
    )
    lt.add_argument(
        "--spawn",
        default=None,
        metavar="MODEL",
        help="start local CURVE servers for MODEL instead: one with batching and one without "
        "(--spawn-modes), one after the other",
    )
    lt.add_argument(
        "--spawn-modes",
        default="on,off",
        help="batching on, off or both (on,off); ray: batching on behind a one-replica "
        "`--ray` gateway (needs veil[cluster])",
    )
    lt.add_argument(
        "--spawn-args", default="", help="more `serve` options for the spawned servers, quoted"
    )
    lt.add_argument(
        "--insecure", action="store_true", help="plain TCP (a loopback --insecure server)"
    )
    lt.add_argument("--clients", default="1,2,4,8", metavar="N,N", help="clients per run")
    lt.add_argument("--block-rows", default="4", metavar="B,B", help="rows per step (tree size)")
    lt.add_argument("--steps", type=int, default=40, help="steps per client after the prefill")
    lt.add_argument(
        "--think-ms",
        type=finite_float,
        default=80.0,
        help="wait between a reply and the next step (client compute + round trip; default 80)",
    )
    lt.add_argument("--prompt-rows", type=int, default=32, help="prefill rows (default 32)")
    lt.add_argument(
        "--local-layers", type=int, default=2, help="the clients' k: trunk [k, L-k) (default 2)"
    )
    lt.add_argument("--wire-dtype", default="float16", help="float16 (default), bfloat16, float32")
    lt.add_argument(
        "--timeout", type=finite_float, default=120.0, help="seconds to wait for a reply"
    )
    lt.add_argument("--seed", type=int, default=0)
    lt.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the report")
    lt.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="draw the report")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        raise CliError(f"{flag} takes whole numbers separated by commas") from None
    if not vals or any(v < 1 for v in vals):
        raise CliError(f"{flag} numbers must be at least 1")
    return vals


def run(args: argparse.Namespace) -> int:
    from engine import protocol as P
    from remote import loadtest as L
    from remote.loadtest_plot import plot, table

    opts = L.LoadOptions(
        clients=_int_list(args.clients, "--clients"),
        block_rows=_int_list(args.block_rows, "--block-rows"),
        steps=args.steps,
        think_ms=args.think_ms,
        prompt_rows=args.prompt_rows,
        local_layers=args.local_layers,
        wire_dtype=args.wire_dtype,
        timeout_s=args.timeout,
        seed=args.seed,
    )
    if opts.steps < 1 or opts.think_ms < 0 or opts.prompt_rows < 0 or opts.timeout_s <= 0:
        raise CliError("--steps must be >= 1; --think-ms, --prompt-rows >= 0; --timeout > 0")
    if max(opts.block_rows) > P.MAX_BLOCK or opts.prompt_rows > P.MAX_BLOCK:
        raise CliError(f"--block-rows and --prompt-rows are at most {P.MAX_BLOCK}")
    try:
        opts.wire_dtype = P.wire_dtype_name(opts.wire_dtype)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if bool(args.server) == bool(args.spawn):
        raise CliError("give --server (one or more) or --spawn MODEL")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    entries = []
    if args.spawn:
        entries = _spawned_load(args, opts, say)
    else:
        targets = [resolve_target(args, s) for s in args.server]
        try:
            report = L.run_load(targets, opts, say)
        except L.LoadTestError as exc:
            raise CliError(str(exc)) from None
        entries = report.get("servers", [report])
    report = entries[0] if len(entries) == 1 else {"servers": entries, "ratios": L.ratios(entries)}
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        title = f"veil-trunk loadtest: think {opts.think_ms:g} ms, {opts.steps} steps per client"
        plot(report, args.plot, title)
    bad = L.total_errors(report)
    if bad:
        print(f"veil-trunk: {bad} step(s) failed", file=sys.stderr)
        return 1
    return 0


def resolve_target(args: argparse.Namespace, server: str) -> Any:
    from engine import keys as K
    from engine.errors import TransportError
    from engine.protocol import curve_key_problem
    from engine.transport import resolve_server
    from remote.loadtest import Target

    try:
        address, invite_key = resolve_server(server)
    except TransportError as exc:
        raise CliError(str(exc)) from None
    problem = tcp_address_problem(address)
    if problem is not None:
        raise CliError(f"--server: {problem}")
    if args.insecure:
        return Target(address, None, None, "")
    admin: tuple[str, str] | None = None
    if args.client_keys is not None and args.client_keys.is_dir():
        from remote.cli import load_server_keys

        # the server's own keypair: the admin's view (every user's statistics, not only its own)
        admin = load_server_keys(args.client_keys)
    skey = args.server_key or invite_key or (admin and admin[0]) or K.server_key(address)
    if skey is None:
        raise CliError(f"no key for {address}: pass an invite code or --server-key")
    if (problem := curve_key_problem(skey)) is not None:
        raise CliError(f"--server-key is not a server public key: {problem}")
    if admin is not None:
        ckeys = admin
    elif args.client_keys is not None:
        try:
            d = json.loads(args.client_keys.read_text())
            ckeys = (str(d["public"]), str(d["secret"]))
        except Exception:
            raise CliError(f"{args.client_keys} is not a JSON keypair {{public, secret}}") from None
        if any(curve_key_problem(k) is not None for k in ckeys):
            raise CliError(f"{args.client_keys} does not hold two 40-character Z85 keys")
    else:
        ckeys = K.client_keypair()
    return Target(address, skey, ckeys, "")


def _spawned_load(args: argparse.Namespace, opts: Any, say: Any) -> list[dict[str, Any]]:
    """Start a local server per mode, measure it, stop it (one at a time: they share the CPU)."""
    import shlex

    from engine.errors import TransportError
    from engine.local_server import start_local_trunk
    from remote import loadtest as L

    modes = [m.strip() for m in args.spawn_modes.split(",")]
    if not modes or any(m not in ("on", "off", "ray") for m in modes):
        raise CliError("--spawn-modes takes on, off, ray or a list like on,off")
    cores = os.cpu_count() or 1
    # torch's small ops on one thread, the matrix kernels on every core (as `veil bench` found
    # best for the trunk on small CPUs); --spawn-args may override both
    out = []
    for mode in modes:
        n = str(max(opts.clients) + 1)  # the synthetic clients share one key
        extra = ["--max-sessions", n, "--max-sessions-per-client", n]
        if mode == "off":
            extra.append("--no-batching")
        if mode == "ray":  # the gateway -> replica hop on top of the same batching worker
            extra += ["--ray", "--replicas", "1", "--cpus-per-replica", str(cores)]
        try:
            extra += shlex.split(args.spawn_args)  # last: may override the above
        except ValueError as exc:
            raise CliError(f"--spawn-args: {exc}") from None
        kind = {"on": "batching", "off": "no batching", "ray": "batching, one Ray replica"}[mode]
        say(f"starting a local server for {args.spawn} ({kind})")
        try:
            with start_local_trunk(
                args.spawn, extra_args=extra, threads=1, kernel_threads=cores
            ) as srv:
                t = L.Target(srv.direct_address, srv.server_public_key, srv.client_keys, "")
                out.append(L.run_load([t], opts, say))
        except TransportError as exc:
            raise CliError(str(exc)) from None
        except L.LoadTestError as exc:
            raise CliError(str(exc)) from None
    return out
