"""Entry point of the frozen (PyInstaller) Veil bundle.

One executable serves three roles, because the target machine has no Python:

* ``veil [ARGS]`` — the desktop app and the ``veil`` command line (``app.cli.main``);
* ``veil --trunk-child ARGS`` — the ``veil-trunk`` service (``remote.cli.main``); the app uses
  this to start its built-in demo trunk server as a child process;
* invoked through a link or copy named ``veil-trunk`` — the same as ``--trunk-child``;
* ``veil --client-key`` — print this computer's public key (``python -m engine.keys show``),
  the line staff send to IT for ``veil-trunk allow``.

``multiprocessing.freeze_support()`` runs first so that any multiprocessing child started by a
library (torch, tokenizers) re-enters here correctly.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Sequence

TRUNK_FLAG = "--trunk-child"
KEY_FLAG = "--client-key"


def role(argv0: str, args: Sequence[str]) -> str:
    """'trunk' when this process must act as veil-trunk, 'key' to print the client key, else
    'app'."""
    name = argv0.replace("\\", "/").rsplit("/", 1)[-1].lower()
    if name.endswith(".exe"):
        name = name[: -len(".exe")]
    if name == "veil-trunk" or (args and args[0] == TRUNK_FLAG):
        return "trunk"
    if args and args[0] == KEY_FLAG:
        return "key"
    return "app"


def _trunk_args(args: Sequence[str]) -> list[str]:
    return list(args[1:]) if args and args[0] == TRUNK_FLAG else list(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    what = role(sys.argv[0], args)
    if what == "trunk":
        from remote.cli import main as trunk_main

        return int(trunk_main(_trunk_args(args)) or 0)
    if what == "key":
        from engine.keys import main as keys_main

        return int(keys_main(["show", *args[1:]]) or 0)
    from app.cli import main as app_main

    return int(app_main(args) or 0)


if __name__ == "__main__":
    multiprocessing.freeze_support()
    sys.exit(main())
