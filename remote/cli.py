"""`veil-trunk`: serve the middle layers of a model to Veil clients over CurveZMQ.

Commands: ``serve``, ``keygen``, ``allow``, ``revoke``, ``invite``, ``loadtest``, ``status``,
``part`` and ``audit`` (model delivery: ``remote/delivery_cli.py``).
Logs go to stderr; errors are one line (``veil-trunk: error: ...``) and exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from remote import delivery_cli
from remote.allowlist import AllowList, allow_line, line_key, parse_allow_list, write_atomically
from remote.flags import finite_float, tcp_address_problem

log = logging.getLogger("veil.trunk")

DEFAULT_BIND = "tcp://127.0.0.1:5757"
ALLOW_FILE = "allowed_clients.txt"
MAX_THREADS = 1024


class CliError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def default_keys_dir() -> Path:
    env = os.environ.get("VEIL_TRUNK_KEYS")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_config_dir("veil-trunk", appauthor=False))


def _keys_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--keys",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder with the server keypair and the client allow-list "
        "(default: $VEIL_TRUNK_KEYS or the user config dir, e.g. ~/.config/veil-trunk)",
    )


def _key_arg(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("key", nargs="?", default=None, metavar="CLIENT_PUBLIC_KEY", help=help_text)
    # where main() puts a key that starts with '-' (argparse would read it as an option)
    p.add_argument("--key", dest="key_option", default=None, help=argparse.SUPPRESS)


KEY_COMMANDS = {"allow": ("--name", "--keys"), "revoke": ("--keys",)}


def protect_dash_keys(argv: Sequence[str]) -> list[str]:
    """``allow``/``revoke`` accept a key exactly as shown, even one starting with '-' (about 1
    Z85 key in 85): argparse would read that word as an option, so such a word that is not one
    of the command's options (or an option's value) is passed as ``--key=WORD``."""
    out = list(argv)
    cmd = next((i for i, a in enumerate(out) if not a.startswith("-")), None)
    if cmd is None or out[cmd] not in KEY_COMMANDS:
        return out
    options = (*KEY_COMMANDS[out[cmd]], "--help", "-h")
    for j in range(cmd + 1, len(out)):
        word, prev = out[j], out[j - 1]
        if not word.startswith("-") or word == "--" or prev in options:
            continue
        if any(word == o or word.startswith(o + "=") for o in options):
            continue
        if len(word) >= 20:  # options are short; a key (or a mistyped one) is long
            out[j] = "--key=" + word
    return out


def build_parser() -> Parser:
    p = Parser(
        prog="veil-trunk",
        description="Serve the middle ('trunk') layers of a model to Veil clients. Only hidden "
        "states cross the network; every connection is encrypted and authenticated (CurveZMQ).",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="debug log output")
    p.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    s = sub.add_parser("serve", help="load the trunk layers and serve clients")
    s.add_argument("--model", required=True, metavar="SPEC", help="model spec (as for `veil`)")
    s.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        metavar="tcp://HOST:PORT",
        help=f"address to listen on (default {DEFAULT_BIND}; tcp://0.0.0.0:5757 for every "
        "interface; port * picks a free one)",
    )
    s.add_argument(
        "--min-local-layers",
        type=int,
        default=1,
        metavar="M",
        help="layers every client keeps at each end; the server loads only layers [M, L-M) "
        "and serves any split whose trunk lies inside (default 1)",
    )
    _keys_arg(s)
    s.add_argument(
        "--keys-from-stdin",
        action="store_true",
        help="read an ephemeral keypair and allow-list as one JSON object "
        '{"public", "secret", "allow": [...]} from stdin instead of --keys (used by the '
        "app's local demo server)",
    )
    s.add_argument(
        "--max-sessions",
        type=int,
        default=8,
        metavar="N",
        help="open sessions at most; more get 'server busy' (default 8)",
    )
    s.add_argument(
        "--max-sessions-per-client",
        type=int,
        default=2,
        metavar="N",
        help="open sessions per client key at most (default 2); at the limit a key's idle "
        "session on another connection is closed, else the open gets 'server busy'",
    )
    s.add_argument(
        "--session-ttl",
        type=finite_float,
        default=600.0,
        metavar="SECONDS",
        help="drop a session with no step for this long (default 600; pings do not count); "
        "its client replays",
    )
    s.add_argument(
        "--max-cache-gb",
        type=finite_float,
        default=4.0,
        metavar="G",
        help="KV-cache memory for all sessions together; beyond it steps get "
        "'server busy' (default 4)",
    )
    s.add_argument(
        "--max-context",
        type=int,
        default=None,
        metavar="TOKENS",
        help="longest conversation per session (default: the model's)",
    )
    s.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    s.add_argument(
        "--devices",
        default=None,
        metavar="DEV,DEV",
        help="split the trunk's layers into contiguous stages, one per device "
        "(e.g. cuda:0,cuda:1; cpu,cpu works too); overrides --device",
    )
    s.add_argument(
        "--stage-layers",
        default=None,
        metavar="N,N",
        help="layers per stage with --devices, in order (default: by free memory)",
    )
    s.add_argument(
        "--max-batch-rows",
        type=int,
        default=256,
        metavar="ROWS",
        help="rows of all sessions' steps computed together in one batch (default 256)",
    )
    s.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="ROWS",
        help="longer steps (prompts) run in chunks of this many rows, with other sessions' "
        "steps in between (default 256 on a GPU, 32 on a CPU: a short step waits for about "
        "one chunk; on a CPU, while one client key alone has sessions open, its prompt "
        "takes up to --max-batch-rows at once)",
    )
    s.add_argument(
        "--no-batching",
        action="store_true",
        help="compute one step at a time in arrival order, no chunks (the server before "
        "batching; for comparisons)",
    )
    s.add_argument(
        "--threads",
        type=int,
        default=0,
        metavar="N",
        help="CPU threads for the layer math (default 0: torch's choice, one per core)",
    )
    s.add_argument(
        "--kernel-threads",
        type=int,
        default=0,
        metavar="N",
        help="CPU threads for the small-batch matrix kernel (default 0: same as --threads)",
    )
    s.add_argument(
        "--dtype",
        default="auto",
        help="compute dtype: auto (default: bfloat16 on CUDA, float32 on a CPU), float32, "
        "bfloat16 or float16 (on a CPU a client's speculative output is only guaranteed "
        "identical to sequential in float32)",
    )
    s.add_argument(
        "--quant",
        default="auto",
        choices=("auto", "none", "int8", "int4"),
        help="the trunk's weights on a CPU trunk: auto (default: a GGUF model's own quantized "
        "blocks, a float checkpoint stays float), int8 (per channel) or int4 (groups of 32) of "
        "a float checkpoint, or none (dequantize everything to --dtype: about 4x the memory of "
        "a 4-bit file)",
    )
    s.add_argument(
        "--exact-float",
        action="store_true",
        help="multiply the trunk's quantized weights with float activations: exactly the "
        "dequantized model's arithmetic, ~2x slower on a CPU (default: activations rounded to "
        "int8 per block of 32, llama.cpp's rule; clients choose theirs the same way)",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="plain TCP without encryption or client keys; loopback addresses only",
    )
    from remote.cluster.options import add_serve_args

    add_serve_args(s)
    delivery_cli.add_serve_args(s)
    s.add_argument(
        "--keyed-trunk",
        default=None,
        metavar="DIR",
        help="run the trunk layers from a folder made by `veil-trunk keyed-model prepare` (keyed "
        "to an organisation key; clients need that key); the model, its tokenizer and the "
        "client part it ships stay the public --model's",
    )

    k = sub.add_parser("keygen", help="make the server keypair (secret file mode 0600)")
    _keys_arg(k)
    k.add_argument("--force", action="store_true", help="replace an existing keypair")

    a = sub.add_parser("allow", help="allow a client's public key")
    _key_arg(
        a,
        "40-character key the client prints with `veil --client-key` or "
        "`python -m engine.keys show` (quote it; it may start with '-')",
    )
    a.add_argument("--name", default="", help="a note stored next to the key")
    _keys_arg(a)

    r = sub.add_parser(
        "revoke",
        help="remove a client's public key from the allow-list (its open sessions are "
        "closed within seconds)",
    )
    _key_arg(r, "the key as it appears in the allow-list")
    _keys_arg(r)

    i = sub.add_parser("invite", help="print an invite code (address + server public key)")
    i.add_argument(
        "--address",
        default=DEFAULT_BIND,
        metavar="tcp://HOST:PORT",
        help=f"the address clients reach this server at (default {DEFAULT_BIND})",
    )
    _keys_arg(i)

    st = sub.add_parser(
        "status", help="show a running server's sessions, batches and (with --ray) its replicas"
    )
    st.add_argument("--server", required=True, metavar="INVITE|tcp://HOST:PORT")
    st.add_argument("--server-key", default=None, help="the server's public key (bare address)")
    st.add_argument(
        "--client-keys",
        type=Path,
        default=None,
        metavar="FILE",
        help='JSON {"public": ..., "secret": ...} of an allowed client keypair (default: this '
        "computer's Veil keypair; a client key sees its own sessions and batches), or the "
        "server's --keys folder (the admin's view: every user's)",
    )
    st.add_argument("--insecure", action="store_true", help="plain TCP (loopback only)")
    st.add_argument("--json", action="store_true", help="print the raw statistics as JSON")

    from remote import loadtest_cli

    loadtest_cli.add_parser(sub)
    delivery_cli.add_parsers(sub, _keys_arg)
    from remote import keyed_cli

    keyed_cli.add_parsers(sub)
    return p


# --------------------------------------------------------------------------- key files


def _server_key_paths(d: Path) -> tuple[Path, Path]:
    return d / "server.key", d / "server.key_secret"


def keygen(d: Path, force: bool = False) -> str:
    import zmq

    pub_p, sec_p = _server_key_paths(d)
    if sec_p.exists() and not force:
        raise CliError(f"a server keypair already exists in {d} (use --force to replace it)")
    pub, sec = zmq.curve_keypair()
    try:
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        (d / delivery_cli.SIGN_FILE).unlink(missing_ok=True)  # a new identity signs anew
        delivery_cli.signing_key(d)
        for path, body in (
            (pub_p, f"public-key = {pub.decode()}\n"),
            (sec_p, f"public-key = {pub.decode()}\nsecret-key = {sec.decode()}\n"),
        ):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.chmod(path, 0o600)
    except OSError as exc:
        raise CliError(f"cannot write the server keypair in {d}: {exc.strerror or exc}") from None
    return pub.decode()


def load_server_keys(d: Path) -> tuple[str, str]:
    _, sec_p = _server_key_paths(d)
    if not sec_p.is_file():
        raise CliError(f"no server keypair in {d} (run `veil-trunk keygen` first)")
    try:
        if sec_p.stat().st_mode & 0o077:
            raise CliError(f"{sec_p} is readable by others (run: chmod 600 {sec_p})")
        text = sec_p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not text"
        raise CliError(f"cannot read {sec_p}: {why or exc}") from None
    vals: dict[str, str] = {}
    for line in text.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            vals[k.strip()] = v.strip()
    from engine.protocol import curve_key_problem

    pub, sec = vals.get("public-key", ""), vals.get("secret-key", "")
    if curve_key_problem(pub) is not None or curve_key_problem(sec) is not None:
        raise CliError(f"{sec_p} is damaged (run `veil-trunk keygen --force`)")
    return pub, sec


def _check_key(key: str) -> str:
    from engine.protocol import curve_key_problem

    key = key.strip()
    problem = curve_key_problem(key)
    if problem is not None:
        raise CliError(f"that is not a client public key: {problem}, as `veil --client-key` prints")
    return key


def _read_list(path: Path) -> str:
    """The allow-list file's text ("" when there is none); CliError when it cannot be read as
    text (nothing is rewritten then: the file is the admin's)."""
    try:
        return path.read_bytes().decode("utf-8") if path.exists() else ""  # line ends kept
    except UnicodeDecodeError:
        raise CliError(f"{path} is not UTF-8 text; fix or remove it first") from None
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}") from None


def _write_list(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text)
    except OSError as exc:
        raise CliError(f"cannot write {path}: {exc.strerror or exc}") from None


def allow(d: Path, key: str, name: str = "") -> bool:
    key = _check_key(key)
    try:
        line = allow_line(key, name)
    except ValueError as exc:
        raise CliError(f"--name: {exc}") from None
    path = d / ALLOW_FILE
    old = _read_list(path)
    if key in parse_allow_list(old):
        return False
    if old and not old.endswith(("\n", "\r")):
        old += "\n"
    _write_list(path, old + line)
    return True


def revoke(d: Path, key: str) -> bool:
    key = _check_key(key)
    path = d / ALLOW_FILE
    old = _read_list(path)
    # every other line is kept exactly as it was (its note, its line ending)
    lines = old.splitlines(keepends=True)
    kept = [ln for ln in lines if line_key(ln) != key]
    if len(kept) == len(lines):
        return False
    _write_list(path, "".join(kept))
    return True


# --------------------------------------------------------------------------- commands


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.errors import VeilError
    from remote.server import ServerOptions, TrunkServer

    pub: str | None = None
    sec: str | None = None
    sign: bytes | None = None
    allowed: AllowList | None = None
    if args.keys_from_stdin:
        try:
            d: dict[str, Any] = json.loads(sys.stdin.readline())
            pub, sec = str(d["public"]), str(d["secret"])
            allowed = AllowList(None, [str(k) for k in d.get("allow", [])])
            sign = bytes.fromhex(str(d["sign"])) if d.get("sign") else None
        except Exception:
            raise CliError(
                "--keys-from-stdin expects one JSON line with public, secret, allow (and "
                "optionally sign)"
            ) from None
        from engine.protocol import curve_key_problem

        if any(curve_key_problem(k) is not None for k in (pub, sec)):
            raise CliError("--keys-from-stdin: public and secret must be 40-character Z85 keys")
    elif not args.insecure:
        kd = args.keys or default_keys_dir()
        pub, sec = load_server_keys(kd)
        sign = delivery_cli.serve_signing_key(kd)
        allowed = AllowList(kd / ALLOW_FILE)
        if not allowed.path or not allowed.path.is_file():
            log.warning("no client is allowed yet: run `veil-trunk allow CLIENT_PUBLIC_KEY`")
    for flag, n in (("--threads", args.threads), ("--kernel-threads", args.kernel_threads)):
        if not 0 <= n <= MAX_THREADS:
            raise CliError(f"{flag} must be >= 0 and at most {MAX_THREADS}")
    problem = tcp_address_problem(args.bind, bind=True)
    if problem is not None:
        raise CliError(f"--bind: {problem}")
    if args.max_batch_rows < 1 or (args.prefill_chunk is not None and args.prefill_chunk < 1):
        raise CliError("--max-batch-rows and --prefill-chunk must be at least 1")
    if args.max_context is not None and args.max_context < 1:
        raise CliError("--max-context must be at least 1")
    import torch

    try:  # the name only: with --ray the GPUs may be on other machines
        device_type = torch.device(args.device).type
    except (RuntimeError, ValueError):
        device_type = ""
    if device_type not in ("cpu", "cuda"):
        raise CliError(f"--device: unknown device {args.device!r} (use cpu, cuda or cuda:N)")
    if args.exact_float:
        from engine import kernels

        os.environ["VEIL_INT8_ACTIVATIONS"] = "0"  # Ray replicas and other children too
        kernels.set_int8_activations(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernel_threads:
        from engine import kernels

        kernels.set_threads(args.kernel_threads)
    stage_layers = None
    if args.stage_layers is not None:
        try:
            stage_layers = [int(x) for x in args.stage_layers.split(",")]
        except ValueError:
            raise CliError("--stage-layers takes whole numbers, like 14,14") from None
        if not args.devices:
            raise CliError("--stage-layers needs --devices")
    opts = ServerOptions(
        model=args.model,
        bind=args.bind,
        min_local_layers=args.min_local_layers,
        max_sessions=args.max_sessions,
        max_sessions_per_client=args.max_sessions_per_client,
        session_ttl_s=args.session_ttl,
        max_cache_gb=args.max_cache_gb,
        device=args.device,
        dtype=args.dtype,
        insecure=args.insecure,
        max_context=args.max_context,
        devices=args.devices,
        stage_layers=stage_layers,
        max_batch_rows=args.max_batch_rows,
        prefill_chunk=args.prefill_chunk,
        batching=not args.no_batching,
        quant=args.quant,
        keyed_trunk=args.keyed_trunk,
        **delivery_cli.serve_options(args, sign is not None),
    )
    if (
        opts.max_sessions < 1
        or opts.max_sessions_per_client < 1
        or opts.session_ttl_s <= 0
        or opts.max_cache_gb <= 0
    ):
        raise CliError(
            "--max-sessions, --max-sessions-per-client, --session-ttl and --max-cache-gb "
            "must be positive"
        )
    from remote.cluster.options import from_args

    try:
        cluster = from_args(args)
        keys: dict[str, Any] = {
            "secret_key": sec.encode() if sec else None,
            "public_key": pub.encode() if pub else None,
            "allowed": allowed,
            "signing_key": sign,
        }
        server = TrunkServer(opts, **keys) if cluster is None else _gateway(opts, cluster, keys)
    except (ValueError, VeilError) as exc:
        raise CliError(str(exc)) from None

    def on_term(signum: int, frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        server.stop()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    import threading

    def announce() -> None:
        server.ready.wait()
        log.info(
            "serving layers [%d, %d) of %s at %s (%s)",
            server.lo,
            server.hi,
            server.model_name,
            server.address,
            "INSECURE plain TCP" if args.insecure else f"public key {pub}",
        )
        print(f"READY {server.address} {pub or '-'}", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.serve()
    except Exception as exc:
        import zmq

        if isinstance(exc, zmq.ZMQError):
            raise CliError(f"cannot listen on {args.bind}: {exc}") from None
        raise
    # Sockets are closed and sessions dropped; skip the interpreter's slow teardown of torch
    # and the weights (seconds on a big model) so SIGTERM ends the process promptly.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _gateway(opts: Any, cluster: Any, keys: dict[str, Any]) -> Any:
    """The --ray gateway (Ray is imported only here, from the optional veil[cluster] extra)."""
    try:
        from remote.cluster.gateway import ClusterError, GatewayServer
    except ImportError as exc:
        raise CliError(f"--ray needs Ray: pip install 'veil[cluster]' ({exc})") from None
    try:
        return GatewayServer(opts, cluster, **keys)
    except ClusterError as exc:
        raise CliError(str(exc)) from None


def cmd_keygen(args: argparse.Namespace) -> int:
    d = args.keys or default_keys_dir()
    pub = keygen(d, args.force)
    print(f"server public key: {pub}")
    print(f"model-signing key: {delivery_cli.sign_public(d)} (invites carry it)")
    print(f"saved in {d} (secret: {d / 'server.key_secret'}, mode 0600)")
    return 0


def _the_key(args: argparse.Namespace) -> str:
    key = args.key_option if args.key_option is not None else args.key
    if args.key_option is not None and args.key is not None:
        raise CliError("give one client public key")
    if key is None:
        raise CliError("give the client's public key (40 characters; quote it)")
    return str(key)


def cmd_allow(args: argparse.Namespace) -> int:
    d = args.keys or default_keys_dir()
    key = _the_key(args)
    added = allow(d, key, args.name)
    print(("allowed " if added else "already allowed ") + key.strip())
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    d = args.keys or default_keys_dir()
    key = _the_key(args)
    if not revoke(d, key):
        raise CliError("that key is not on the allow-list")
    print(f"revoked {key.strip()} (a running server closes its sessions within seconds)")
    return 0


def cmd_invite(args: argparse.Namespace) -> int:
    from engine.protocol import make_invite

    problem = tcp_address_problem(args.address)
    if problem is not None:
        raise CliError(f"--address must be the tcp://HOST:PORT clients connect to: {problem}")
    d = args.keys or default_keys_dir()
    pub, _ = load_server_keys(d)
    print(make_invite(args.address, pub, delivery_cli.sign_public(d)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import zmq

    from remote import loadtest as L
    from remote.loadtest_cli import resolve_target
    from remote.status import format_status

    target = resolve_target(args, args.server)
    ctx = zmq.Context()
    try:
        stats = L.server_stats(ctx, target, 10.0)
    except L.LoadTestError as exc:
        raise CliError(str(exc)) from None
    finally:
        ctx.destroy(0)
    print(json.dumps(stats, indent=1) if args.json else format_status(stats, target.address))
    return 0


def _keyed_model(args: argparse.Namespace) -> int:
    from remote.keyed_cli import cmd_keyed_model

    return cmd_keyed_model(args)


def cmd_loadtest(args: argparse.Namespace) -> int:
    from remote.loadtest_cli import run

    return run(args)


COMMANDS = {
    "serve": cmd_serve,
    "loadtest": cmd_loadtest,
    "status": cmd_status,
    "keygen": cmd_keygen,
    "allow": cmd_allow,
    "revoke": cmd_revoke,
    "invite": cmd_invite,
    "part": delivery_cli.cmd_part,
    "audit": delivery_cli.cmd_audit,
    "keyed-model": _keyed_model,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(protect_dash_keys(sys.argv[1:] if argv is None else argv))
    level = logging.WARNING if args.quiet else logging.INFO - 10 * min(args.verbose, 1)
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.command:
        parser.print_help()
        return 2
    from engine.errors import VeilError

    try:
        return COMMANDS[args.command](args)
    except (CliError, VeilError, delivery_cli.DeliveryCliError) as exc:
        print(f"veil-trunk: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
