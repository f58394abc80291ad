"""The `veil` command. With no arguments it opens the desktop app.

``veil --client-key`` prints this computer's public key (what a server admin passes to
``veil-trunk allow``), the same as ``python -m engine.keys show`` and the installed app.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and ``run(args)``.
Errors reach the user as one line (``veil: error: ...``), never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from engine.errors import VeilError

# subcommand name -> module with add_parser() and run()
COMMANDS = {
    "generate": "app.cmd_generate",
}
OPTIONAL_COMMANDS = {
    "api": "app.cmd_api",
    "bench": "app.cmd_bench",
    "audit": "app.cmd_audit",
    "privatize": "app.cmd_privatize",
    "train-draft": "app.cmd_train_draft",
}


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _modules() -> dict[str, Any]:
    mods = {name: importlib.import_module(path) for name, path in COMMANDS.items()}
    for name, path in OPTIONAL_COMMANDS.items():
        try:
            mods[name] = importlib.import_module(path)
        except ModuleNotFoundError as exc:
            if exc.name != path:
                raise
    return mods


def build_parser(mods: dict[str, Any]) -> Parser:
    p = Parser(
        prog="veil",
        description="Veil: run a language model split between this computer and a trunk server. "
        "With no command, opens the desktop app.",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output on stderr")
    p.add_argument(
        CLIENT_KEY_FLAG,
        action="store_true",
        help="print this computer's public key (for the server admin's `veil-trunk allow`)",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for mod in mods.values():
        mod.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == [CLIENT_KEY_FLAG]:
        return _client_key(args_list[1:])
    if (
        not args_list
        or args_list[0].startswith("--smoke-test")
        or args_list[0]
        in (
            "--pane",
            "--data-dir",
            "--model",
            "--theme",
        )
    ):
        return _run_gui(args_list)
    mods = _modules()
    parser = build_parser(mods)
    args = parser.parse_args(args_list)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.command:
        return _run_gui([])
    try:
        return int(mods[args.command].run(args) or 0)
    except VeilError as exc:
        print(f"veil: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("veil: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1
    except Exception as exc:
        if os.environ.get("VEIL_DEBUG"):
            raise
        print(
            f"veil: internal error: {type(exc).__name__}: {exc} (set VEIL_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return 1


CLIENT_KEY_FLAG = "--client-key"


def _client_key(rest: list[str]) -> int:
    """``veil --client-key``: print this computer's public key (made on first use)."""
    if rest:
        print("veil: error: --client-key takes no arguments", file=sys.stderr)
        return 2
    try:
        from engine.keys import main as keys_main
    except ModuleNotFoundError as exc:
        print(f"veil: error: keys are not available in this installation ({exc})", file=sys.stderr)
        return 2
    return int(keys_main(["show"]))


def _run_gui(argv: list[str]) -> int:
    headless = sys.platform.startswith("linux") and not (
        os.environ.get("DISPLAY")
        or os.environ.get("WAYLAND_DISPLAY")
        or os.environ.get("QT_QPA_PLATFORM")
    )
    if headless:
        print(
            "veil: error: no display found (run it on a desktop session; for headless use set "
            "QT_QPA_PLATFORM=offscreen, or use `veil generate`)",
            file=sys.stderr,
        )
        return 2
    try:
        gui = importlib.import_module("app.main_window")
    except ModuleNotFoundError as exc:
        print(f"veil: error: the desktop app is not available ({exc})", file=sys.stderr)
        return 2
    return int(gui.main(argv))


if __name__ == "__main__":
    sys.exit(main())
