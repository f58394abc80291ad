"""A client model from the server's part: what ``veil --server INVITE`` (no ``--model``) and the
app ("the server's model") load."""

from __future__ import annotations

import json
import logging
from typing import Any

from engine import protocol as P
from engine.delivery.fetch import Confirm, InstalledPart, ensure_part
from engine.errors import SplitError, VeilError
from engine.loading import Progress

log = logging.getLogger("veil.delivery")


def fetch_server_part(
    server: str,
    *,
    server_key: str | None = None,
    client_keys: tuple[str, str] | None = None,
    sign_key: str | None = None,
    insecure: bool = False,
    confirm: Confirm | None = None,
    progress: Progress | None = None,
    timeout_s: float = 10.0,
) -> InstalledPart:
    """The client part of the server at ``server`` (an invite or a tcp:// address whose keys
    are saved), fetched or from the cache. An invite's signing key is pinned for the address
    once a manifest verified with it; its audit results are stored for the privacy panel."""
    from engine import keys as K
    from engine.transport.connect import pick_keys, resolve_server

    address, invite_key = resolve_server(server)
    skey, ckeys, _ = pick_keys(address, invite_key, server_key, client_keys, insecure)
    invite_sign = P.invite_sign_key(server)
    saved = None if sign_key or invite_sign or insecure else K.sign_key(address)
    part = ensure_part(
        address,
        server_key=skey,
        client_keys=ckeys,
        sign_key=sign_key or invite_sign or saved,
        confirm=confirm,
        progress=progress,
        timeout_s=timeout_s,
    )
    if invite_sign and not sign_key and not insecure:
        try:
            if K.sign_key(address) != invite_sign:
                K.save_sign_key(address, invite_sign)
        except VeilError as exc:  # the part is fine; only a later bare-address fetch needs it
            log.warning("could not save the model-signing key for %s: %s", address, exc)
    store_delivered_audit(part)
    return part


def store_delivered_audit(part: InstalledPart) -> None:
    """Keep the part's audit results where the privacy panel looks for the model's audit."""
    name = part.manifest.audit
    if name is None:
        return
    try:
        data: Any = json.loads((part.folder / name).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("the model's audit results are unreadable: %s", exc)
        return
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        log.warning("the model's audit results are not an audit")
        return
    from engine.audit.store import save_delivered

    save_delivered({**data, "model": part.manifest.model, "delivered": part.manifest.part_id})


def check_local_layers(part: InstalledPart, head: int, tail: int | None) -> None:
    """One clear line when the split needs layers the server's part does not hold."""
    m = part.manifest
    for k in (head, tail if tail is not None else head):
        if not m.k_min <= k <= m.k_max:
            raise SplitError(
                f"the server's model ships {m.k_min} to {m.k_max} local layers per side; "
                f"{k} were asked for",
                hint=f"choose between {m.k_min} and {m.k_max} local layers, or ask IT to ship "
                "more (veil-trunk serve --client-layers)",
            )
