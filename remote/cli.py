"""`veil-trunk`: serve the middle layers of a model to Veil clients over CurveZMQ.

Commands: ``serve``, ``keygen``, ``allow``, ``revoke``, ``invite``. Logs go to stderr; errors
are one line (``veil-trunk: error: ...``) and exit 2.
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

log = logging.getLogger("veil.trunk")

DEFAULT_BIND = "tcp://127.0.0.1:5757"
ALLOW_FILE = "allowed_clients.txt"


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
        "--session-ttl",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="drop a session idle this long (default 600); its client replays",
    )
    s.add_argument(
        "--max-cache-gb",
        type=float,
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
        "--dtype", default="float32", help="compute dtype: float32 (default), bfloat16 or float16"
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="plain TCP without encryption or client keys; loopback addresses only",
    )

    k = sub.add_parser("keygen", help="make the server keypair (secret file mode 0600)")
    _keys_arg(k)
    k.add_argument("--force", action="store_true", help="replace an existing keypair")

    a = sub.add_parser("allow", help="allow a client's public key")
    a.add_argument(
        "key",
        metavar="CLIENT_PUBLIC_KEY",
        help="40-character key the client prints with `python -m engine.keys show`",
    )
    a.add_argument("--name", default="", help="a note stored next to the key")
    _keys_arg(a)

    r = sub.add_parser("revoke", help="remove a client's public key from the allow-list")
    r.add_argument("key", metavar="CLIENT_PUBLIC_KEY")
    _keys_arg(r)

    i = sub.add_parser("invite", help="print an invite code (address + server public key)")
    i.add_argument(
        "--address",
        default=DEFAULT_BIND,
        metavar="tcp://HOST:PORT",
        help=f"the address clients reach this server at (default {DEFAULT_BIND})",
    )
    _keys_arg(i)
    return p


# --------------------------------------------------------------------------- key files


def _server_key_paths(d: Path) -> tuple[Path, Path]:
    return d / "server.key", d / "server.key_secret"


def keygen(d: Path, force: bool = False) -> str:
    import zmq

    pub_p, sec_p = _server_key_paths(d)
    if sec_p.exists() and not force:
        raise CliError(f"a server keypair already exists in {d} (use --force to replace it)")
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    pub, sec = zmq.curve_keypair()
    for path, body in (
        (pub_p, f"public-key = {pub.decode()}\n"),
        (sec_p, f"public-key = {pub.decode()}\nsecret-key = {sec.decode()}\n"),
    ):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.chmod(path, 0o600)
    return pub.decode()


def load_server_keys(d: Path) -> tuple[str, str]:
    _, sec_p = _server_key_paths(d)
    if not sec_p.is_file():
        raise CliError(f"no server keypair in {d} (run `veil-trunk keygen` first)")
    if sec_p.stat().st_mode & 0o077:
        raise CliError(f"{sec_p} is readable by others (run: chmod 600 {sec_p})")
    vals: dict[str, str] = {}
    for line in sec_p.read_text().splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            vals[k.strip()] = v.strip()
    pub, sec = vals.get("public-key", ""), vals.get("secret-key", "")
    if len(pub) != 40 or len(sec) != 40:
        raise CliError(f"{sec_p} is damaged (run `veil-trunk keygen --force`)")
    return pub, sec


def _check_key(key: str) -> str:
    key = key.strip()
    if len(key) != 40:
        raise CliError(
            "a public key is 40 characters (z85), as `python -m engine.keys show` prints"
        )
    try:
        import zmq.utils.z85

        zmq.utils.z85.decode(key)
    except Exception:
        raise CliError("that is not a valid z85 public key") from None
    return key


def allow(d: Path, key: str, name: str = "") -> bool:
    from remote.server import read_allow_list

    key = _check_key(key)
    path = d / ALLOW_FILE
    if key in read_allow_list(path):
        return False
    d.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(key + (f"  # {name}" if name else "") + "\n")
    os.chmod(path, 0o600)
    return True


def revoke(d: Path, key: str) -> bool:
    key = _check_key(key)
    path = d / ALLOW_FILE
    if not path.is_file():
        return False
    lines = path.read_text().splitlines()
    from remote.server import line_key

    kept = [ln for ln in lines if line_key(ln) != key]
    path.write_text("".join(ln + "\n" for ln in kept))
    return len(kept) != len(lines)


class AllowList:
    """The allow-list file, re-read when it changes (so `allow`/`revoke` need no restart)."""

    def __init__(self, path: Path | None, fixed: Sequence[str] = ()) -> None:
        self.path = path
        self.fixed = set(fixed)
        self.keys: set[str] = set()
        self.mtime: float | None = None

    def __call__(self, key: str) -> bool:
        if self.path is not None:
            try:
                m = self.path.stat().st_mtime
            except OSError:
                m = None
            if m != self.mtime:
                from remote.server import read_allow_list

                self.keys = read_allow_list(self.path)
                self.mtime = m
        return key in self.fixed or key in self.keys


# --------------------------------------------------------------------------- commands


def cmd_serve(args: argparse.Namespace) -> int:
    from remote.server import ServerOptions, TrunkServer

    pub: str | None = None
    sec: str | None = None
    allowed: AllowList | None = None
    if args.keys_from_stdin:
        try:
            d: dict[str, Any] = json.loads(sys.stdin.readline())
            pub, sec = str(d["public"]), str(d["secret"])
            allowed = AllowList(None, [str(k) for k in d.get("allow", [])])
        except Exception:
            raise CliError(
                "--keys-from-stdin expects one JSON line with public, secret, allow"
            ) from None
    elif not args.insecure:
        kd = args.keys or default_keys_dir()
        pub, sec = load_server_keys(kd)
        allowed = AllowList(kd / ALLOW_FILE)
        if not allowed.path or not allowed.path.is_file():
            log.warning("no client is allowed yet: run `veil-trunk allow CLIENT_PUBLIC_KEY`")
    if args.threads < 0:
        raise CliError("--threads must be >= 0")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.kernel_threads < 0:
        raise CliError("--kernel-threads must be >= 0")
    if args.kernel_threads:
        from engine import kernels

        kernels.set_threads(args.kernel_threads)
    if not args.bind.startswith("tcp://"):
        raise CliError("--bind must be a tcp://HOST:PORT address")
    opts = ServerOptions(
        model=args.model,
        bind=args.bind,
        min_local_layers=args.min_local_layers,
        max_sessions=args.max_sessions,
        session_ttl_s=args.session_ttl,
        max_cache_gb=args.max_cache_gb,
        device=args.device,
        dtype=args.dtype,
        insecure=args.insecure,
        max_context=args.max_context,
    )
    if opts.max_sessions < 1 or opts.session_ttl_s <= 0 or opts.max_cache_gb <= 0:
        raise CliError("--max-sessions, --session-ttl and --max-cache-gb must be positive")
    try:
        server = TrunkServer(
            opts,
            secret_key=sec.encode() if sec else None,
            public_key=pub.encode() if pub else None,
            allowed=allowed,
        )
    except ValueError as exc:
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


def cmd_keygen(args: argparse.Namespace) -> int:
    d = args.keys or default_keys_dir()
    pub = keygen(d, args.force)
    print(f"server public key: {pub}")
    print(f"saved in {d} (secret: {d / 'server.key_secret'}, mode 0600)")
    return 0


def cmd_allow(args: argparse.Namespace) -> int:
    d = args.keys or default_keys_dir()
    added = allow(d, args.key, args.name)
    print(("allowed " if added else "already allowed ") + args.key.strip())
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    d = args.keys or default_keys_dir()
    if not revoke(d, args.key):
        raise CliError("that key is not on the allow-list")
    print(f"revoked {args.key.strip()} (open sessions end when they reconnect)")
    return 0


def cmd_invite(args: argparse.Namespace) -> int:
    from engine.protocol import make_invite

    d = args.keys or default_keys_dir()
    pub, _ = load_server_keys(d)
    if not args.address.startswith("tcp://") or args.address.rsplit(":", 1)[-1] == "*":
        raise CliError("--address must be the tcp://HOST:PORT clients connect to")
    print(make_invite(args.address, pub))
    return 0


COMMANDS = {
    "serve": cmd_serve,
    "keygen": cmd_keygen,
    "allow": cmd_allow,
    "revoke": cmd_revoke,
    "invite": cmd_invite,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
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
    except (CliError, VeilError) as exc:
        print(f"veil-trunk: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
