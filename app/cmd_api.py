"""`veil api`: an OpenAI-compatible API on this computer, over the same split engine as
`veil generate` (the trunk on a server with --server, else in this process)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from app.cmd_generate import add_common_model_args, default_decoder, runner_options
from app.progress import CliProgress
from engine.errors import VeilError
from engine.sampling import SamplingParams
from engine.session import open_runner
from engine.split import warm_up_client

TOKEN_ENV = "VEIL_API_TOKEN"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "api",
        help="serve an OpenAI-compatible API on this computer",
        description="Serve /v1/chat/completions, /v1/completions and /v1/models for other "
        "programs (OpenAI clients, editors, scripts). Replies run through Veil's split engine: "
        "only activations leave this computer. Every request needs the bearer token.",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this computer only)",
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    p.add_argument(
        "--token",
        default=None,
        help=f"the bearer token clients must send (default: ${TOKEN_ENV}, else a new random "
        "one, printed at start)",
    )
    add_common_model_args(p)
    p.add_argument(
        "--server",
        default=None,
        metavar="ADDR|INVITE",
        help="run the trunk on a veil-trunk server (tcp://HOST:PORT or an invite code); "
        "default: in this process",
    )
    p.add_argument("--insecure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        metavar="N",
        help="reply length when a chat request gives none (default 512)",
    )
    p.add_argument("--decoder", default=default_decoder(), help="sequential or speculative")
    p.add_argument("--draft-head", default="auto", metavar="auto|none|FILE", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from app.api.backend import RunnerBackend
    from app.api.server import ApiServer, is_loopback, new_token
    from app.cmd_generate import _use_draft_head

    if not 0 <= args.port <= 65535:
        raise VeilError(f"--port {args.port} is not a port number (0 to 65535)")
    if args.max_tokens < 1:
        raise VeilError("--max-tokens must be at least 1")
    token = args.token or os.environ.get(TOKEN_ENV) or new_token()
    progress = CliProgress()
    runner = open_runner(runner_options(args), progress)
    _use_draft_head(runner, args)
    warm_up_client(runner.client, progress)  # first-use compiles now, not in the first reply
    progress.close()
    backend = RunnerBackend(runner, args.decoder, SamplingParams(max_new_tokens=args.max_tokens))
    try:
        server = ApiServer(backend, token, args.host, args.port)
    except VeilError:
        backend.close()
        raise
    where = (
        "fully on this computer"
        if runner.client.plan.fully_local
        else f"split: {runner.client.plan.head} + {runner.client.plan.tail} layers here, the "
        + (
            "rest on " + (args.server if "://" in str(args.server) else "your server")
            if args.server
            else "rest in this process"
        )
    )
    print(f"Veil API on {server.url}  (model {backend.model_id()}, {where})", flush=True)
    if not (args.token or os.environ.get(TOKEN_ENV)):
        print(f"token: {token}", flush=True)
    print("clients send:  Authorization: Bearer <token>   (Ctrl+C stops)", flush=True)
    if not is_loopback(str(server.host)):
        print(
            f"veil: warning: listening on {server.host}: other computers can reach this API "
            "(anyone with the token can use it)",
            file=sys.stderr,
            flush=True,
        )
    try:
        server.serve_forever()
    finally:
        server.jobs.close()
        backend.close()
    return 0
