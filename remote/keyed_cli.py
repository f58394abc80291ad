"""`veil-trunk keyed-model`: an organisation key and a trunk keyed to it (engine/keyed/).

- ``new-key --out FILE``: a fresh organisation key (mode 0600; an existing file is never
  replaced). IT keeps it and gives it to the organisation's staff, not through the server.
- ``prepare --model SPEC --org-key FILE --local-layers K --out DIR``: the public model's trunk
  layers [K, L - K) in the key's secret basis, for ``veil-trunk serve --keyed-trunk DIR``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "keyed-model",
        help="an organisation key and a trunk keyed to it (serve with --keyed-trunk)",
        description="Make an organisation key, and prepare a model's trunk layers in that key's "
        "secret basis. Staff computers hold the key; the server holds only the keyed trunk.",
    )
    ks = p.add_subparsers(dest="keyed_command", metavar="ACTION", parser_class=type(p))
    n = ks.add_parser("new-key", help="write a fresh organisation key (file mode 0600)")
    n.add_argument("--out", required=True, type=Path, metavar="FILE", help="the key file")
    r = ks.add_parser(
        "prepare",
        help="key a model's trunk layers [K, L-K) and write them to a folder",
    )
    r.add_argument("--model", required=True, metavar="SPEC", help="the public model")
    r.add_argument("--org-key", required=True, type=Path, metavar="FILE", help="the key file")
    r.add_argument(
        "--local-layers",
        required=True,
        type=int,
        metavar="K",
        help="the fewest layers a client keeps at each end: the keyed trunk is [K, L-K) (a "
        "client with a larger K runs a sub-range of it)",
    )
    r.add_argument(
        "--noise",
        type=float,
        default=0.0,
        metavar="SIGMA",
        help="relative Gaussian noise on every keyed matrix (default 0: the exact model; "
        "noise changes the model's answers, see docs/privacy.md)",
    )
    r.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the keyed weights' dtype on disk (default float32)",
    )
    r.add_argument("--out", required=True, type=Path, metavar="DIR", help="a new, empty folder")


def _progress() -> Any:
    last: dict[str, int] = {}

    def show(label: str, frac: float) -> None:
        pct = int(100 * max(0.0, min(1.0, frac)))
        if last.get(label) == pct:
            return
        last[label] = pct
        end = "\n" if pct >= 100 else ""
        print(f"\r{label}: {pct:3d}%", end=end, file=sys.stderr, flush=True)

    return show


def cmd_keyed_model(args: argparse.Namespace) -> int:
    from engine.keyed.transform import KeyedError, OrgKey

    if args.keyed_command == "new-key":
        key = OrgKey.generate()
        key.save(args.out)
        print(f"organisation key {key.key_id} written to {args.out} (readable by you only)")
        print("give it to staff computers directly (not through the trunk server); keep a copy")
        return 0
    if args.keyed_command == "prepare":
        from engine.keyed.trunk import prepare_keyed_trunk
        from engine.session import DTYPES

        key = OrgKey.load(args.org_key)
        info = prepare_keyed_trunk(
            args.model,
            key,
            args.local_layers,
            args.out,
            noise=args.noise,
            dtype=DTYPES[args.dtype],
            progress=_progress(),
        )
        print(
            f"keyed trunk of {info.model}: layers [{info.start}, {info.end}) keyed to "
            f"organisation key {info.key_id} in {args.out}"
        )
        print(f"serve it: veil-trunk serve --model {args.model} --keyed-trunk {args.out}")
        return 0
    raise KeyedError("veil-trunk keyed-model needs an action: new-key or prepare")
