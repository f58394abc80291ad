"""`veil-trunk` commands and options for model delivery: the signing key kept with the server
keys, the `serve` options, `veil-trunk part` (prepare a client part) and `veil-trunk audit`
(measure the served model's privacy once; the results travel with the model)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

SIGN_FILE = "server.sign_secret"
log = logging.getLogger("veil.trunk")


class DeliveryCliError(Exception):
    pass


# --------------------------------------------------------------------------- signing key


def signing_key(d: Path, create: bool = True) -> bytes:
    """The Ed25519 signing key (seed) kept beside the server keypair (made when missing)."""
    from engine.delivery.manifest import new_signing_key

    path = d / SIGN_FILE
    if path.is_file():
        if path.stat().st_mode & 0o077:
            raise DeliveryCliError(f"{path} is readable by others (run: chmod 600 {path})")
        try:
            seed = bytes.fromhex(path.read_text().strip())
        except ValueError:
            seed = b""
        if len(seed) != 32:
            raise DeliveryCliError(f"{path} is damaged (delete it; `veil-trunk invite` makes one)")
        return seed
    if not create:
        raise DeliveryCliError(f"no signing key in {d} (run `veil-trunk keygen`)")
    seed = new_signing_key()
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(seed.hex() + "\n")
    os.chmod(path, 0o600)
    return seed


def serve_signing_key(d: Path) -> bytes | None:
    """The signing key for ``serve``; None (model delivery off, with a warning) when a keys
    folder made before delivery cannot take a new one (e.g. owned by another user)."""
    try:
        return signing_key(d)
    except OSError as exc:
        log.warning(
            "model delivery is off: cannot make the signing key in %s (%s); run "
            "`veil-trunk invite --keys %s` once as the folder's owner",
            d,
            exc.strerror or exc,
            d,
        )
        return None


def sign_public(d: Path) -> str:
    """The public half of the signing key, as invites carry it (the key is made if missing)."""
    from engine.delivery.manifest import public_key_text

    return public_key_text(signing_key(d))


# --------------------------------------------------------------------------- serve


def add_serve_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--no-delivery",
        action="store_true",
        help="do not ship the model to clients (they must have the model file themselves)",
    )
    s.add_argument(
        "--client-layers",
        type=int,
        default=None,
        metavar="K",
        help="the most local layers per side shipped to clients (default: 2, at least "
        "--min-local-layers); clients can choose any split from --min-local-layers to K",
    )
    s.add_argument(
        "--client-part",
        type=Path,
        default=None,
        metavar="DIR",
        help="ship this prepared client part (`veil-trunk part`) instead of making one from "
        "--model",
    )
    s.add_argument(
        "--parts-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where client parts and audit results are kept (default: $VEIL_TRUNK_PARTS or "
        "the user cache, e.g. ~/.cache/veil-trunk/parts)",
    )
    s.add_argument(
        "--draft-head",
        type=Path,
        default=None,
        metavar="FILE",
        help="the draft head to ship (from `veil train-draft`; default: the one Veil ships "
        "for this model, if any)",
    )


def serve_options(args: argparse.Namespace, has_keys: bool) -> dict[str, Any]:
    """ServerOptions fields for delivery (off with --no-delivery or without server keys)."""
    return {
        "delivery": has_keys and not args.no_delivery,
        "client_layers": args.client_layers,
        "client_part": str(args.client_part) if args.client_part else None,
        "parts_dir": str(args.parts_dir) if args.parts_dir else None,
        "draft_head": str(args.draft_head) if args.draft_head else None,
    }


# --------------------------------------------------------------------------- part / audit


def add_parsers(sub: Any, keys_arg: Any) -> None:
    p = sub.add_parser(
        "part",
        help="prepare the client part of a model (to ship with serve --client-part)",
        description="Write the files a laptop needs for local layers up to K (tokenizer, config, "
        "a weights file with only the embedding, the first and last K layers, the final norm "
        "and the LM head; plus audit results and a draft head when given) and its manifest.",
    )
    p.add_argument("--model", required=True, metavar="SPEC", help="model spec (as for `veil`)")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="folder to write")
    p.add_argument("--client-layers", type=int, default=2, metavar="K", help="default 2")
    p.add_argument("--min-local-layers", type=int, default=1, metavar="M", help="default 1")
    p.add_argument("--audit", type=Path, default=None, metavar="FILE", help="audit results.json")
    p.add_argument("--draft-head", type=Path, default=None, metavar="FILE")

    a = sub.add_parser(
        "audit",
        help="measure the served model's privacy once; the results travel with the model",
        description="Run Veil's privacy audit for a model at the splits clients may use, and "
        "store the results beside the model's client part: `veil-trunk serve` ships them to "
        "every client, whose privacy panel then shows measured figures. Restart the server "
        "after an audit to ship the new results.",
    )
    a.add_argument("--model", required=True, metavar="SPEC", help="the model the server serves")
    a.add_argument(
        "--local-layers",
        default=None,
        metavar="K,K,...",
        help="split depths to measure (default: --min-local-layers to --client-layers)",
    )
    a.add_argument("--min-local-layers", type=int, default=1, metavar="M", help="default 1")
    a.add_argument("--client-layers", type=int, default=2, metavar="K", help="default 2")
    a.add_argument("--quick", action="store_true", help="small corpus (minutes, not hours)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--parts-dir", type=Path, default=None, metavar="DIR")


def cmd_part(args: argparse.Namespace) -> int:
    from engine.delivery.part import build_part
    from engine.loading import resolve

    m = build_part(
        resolve(args.model),
        args.client_layers,
        args.out,
        k_min=args.min_local_layers,
        audit=args.audit,
        draft_head=args.draft_head,
    )
    print(
        f"client part of {m.model} (local layers {m.k_min}..{m.k_max}): {len(m.files)} files, "
        f"{m.total_bytes / 1e6:.1f} MB in {args.out}"
    )
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    from engine.audit.runner import run_audit
    from engine.audit.store import worst_case
    from engine.loading import WeightReader, load_config, resolve
    from remote.delivery import audit_path, default_parts_dir, model_key

    resolved = resolve(args.model)
    config = load_config(resolved.folder)
    if args.local_layers:
        try:
            ks = sorted({int(x) for x in args.local_layers.split(",") if x.strip()})
        except ValueError:
            raise DeliveryCliError("--local-layers takes whole numbers, like 1,2") from None
    else:
        ks = list(range(args.min_local_layers, args.client_layers + 1))
    key = model_key(WeightReader(resolved.folder), config)
    dest = audit_path(args.parts_dir or default_parts_dir(), key)
    res = run_audit(
        resolved, ks, dest.parent / "audit", quick=args.quick, seed=args.seed, save=False
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1), encoding="utf-8")
    tmp.replace(dest)
    for k in res["ks"]:
        wc = worst_case(res, k)
        if wc is not None:
            print(f"k={k}: worst-case top-1 token recovery {100 * wc[0]:.1f}% ({wc[1]})")
    print(f"stored beside the model: {dest} (restart veil-trunk serve to ship it)")
    return 0
