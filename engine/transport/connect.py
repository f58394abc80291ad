"""Connecting a client model to a trunk server: addresses and invite codes, keys from the
keyring (an invite's server key pinned only after a successful handshake), fingerprints and the
``VEIL_STEP_TIMEOUT`` / ``VEIL_WIRE_DTYPE`` settings."""

from __future__ import annotations

import logging
import os

from engine import protocol as P
from engine.errors import TransportError, VeilError
from engine.loading import Progress, weights_fingerprint
from engine.model import layer_tensor_names
from engine.split import ClientModel
from engine.transport.remote import STEP_TIMEOUT_S, RemoteTrunk

log = logging.getLogger("veil.transport")


def client_fingerprint(client: ClientModel) -> tuple[str, str | None]:
    """(config hash, trunk-weights hash or None when this client lacks the trunk tensors)."""
    start, end = client.plan.trunk_range
    names = [n for i in range(start, end) for n in layer_tensor_names(client.config, i)]
    if all(client.reader.has(n) for n in names):
        return client.config.fingerprint(), weights_fingerprint(client.reader, names)
    return client.config.fingerprint(), None


def part_model_fp(client: ClientModel) -> str | None:
    """The whole model's weights fingerprint of a client part from the server (None for a
    model loaded from a file), so a server that now ships another model refuses the session."""
    from engine.delivery.fetch import part_info

    info = part_info(client.resolved.folder)
    fp = info.get("model_fp") if info else None
    return str(fp[1]) if isinstance(fp, list) and len(fp) == 2 else None


def resolve_server(server: str) -> tuple[str, str | None]:
    """(address, server key or None) from an address or an invite code."""
    s = server.strip()
    if s.startswith(P.INVITE_PREFIX):
        try:
            return P.parse_invite(s)
        except ValueError as exc:
            raise TransportError(str(exc)) from None
    if not s.startswith("tcp://"):
        raise TransportError(
            f"'{server}' is neither a tcp://HOST:PORT address nor an invite code (veil1:...)"
        )
    return s, None


def step_timeout_from_env(default: float = STEP_TIMEOUT_S) -> float:
    """``$VEIL_STEP_TIMEOUT`` (seconds) or ``default``."""
    raw = os.environ.get("VEIL_STEP_TIMEOUT", "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise TransportError(
            f"VEIL_STEP_TIMEOUT={raw} is not a number of seconds between 0 and 3600"
        )
    return value


def _is_loopback(address: str) -> bool:
    host = address[len("tcp://") :].rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "[::1]") or host.startswith("127.")


def pick_keys(
    address: str,
    invite_key: str | None,
    server_key: str | None,
    client_keys: tuple[str, str] | None,
    insecure: bool,
) -> tuple[str | None, tuple[str, str] | None, str | None]:
    """(server key, client keypair, the server key saved before) for a connection: given
    keys first, else the invite's server key or the saved one, and this computer's keypair."""
    from engine import keys as K

    if insecure:
        if not _is_loopback(address):
            raise TransportError("plain TCP (insecure) is only allowed to a loopback address")
        return None, None, None
    saved = None if server_key else K.server_key(address)
    skey = server_key or invite_key or saved
    if skey is None:
        hint = "connect once with its invite code (veil-trunk invite prints it)"
        if _is_loopback(address):
            hint += "; for a `veil-trunk serve --insecure` on this computer add --insecure"
        raise TransportError(f"no key is saved for the trunk server at {address}", hint=hint)
    return skey, client_keys or K.client_keypair(), saved


def connect_trunk(
    server: str,
    client: ClientModel,
    *,
    progress: Progress | None = None,
    server_key: str | None = None,
    client_keys: tuple[str, str] | None = None,
    insecure: bool = False,
    wire_dtype: str | None = None,
    timeout_s: float = 10.0,
    heartbeat_s: float = 0.5,
    reconnect_s: float = 45.0,
    connect_timeout_s: float = 10.0,
    step_timeout_s: float | None = None,
    max_context: int | None = None,
) -> RemoteTrunk:
    """Connect ``client``'s trunk range to a server given as ``tcp://HOST:PORT`` or an invite.

    Keys: ``server_key``/``client_keys`` when given (the local demo server), else the invite's
    server key or the key saved for that address, and this computer's keypair from the keyring.
    An invite's key is saved (pinned) for the address only once the server has proved it holds
    it; replacing a different saved key is logged as a warning. ``insecure`` (plain TCP, for a
    ``veil-trunk serve --insecure``) is refused off loopback. ``wire_dtype`` defaults to
    ``$VEIL_WIRE_DTYPE`` or float16; ``step_timeout_s`` to ``$VEIL_STEP_TIMEOUT`` or 60 s.
    """
    address, invite_key = resolve_server(server)
    skey, ckeys, saved = pick_keys(address, invite_key, server_key, client_keys, insecure)
    if progress is not None:
        progress("connecting to the trunk server", 0.0)
    start, end = client.plan.trunk_range
    config_fp, weights_fp = client_fingerprint(client)
    trunk = RemoteTrunk(
        address,
        server_key=skey,
        client_keys=ckeys,
        start=start,
        end=end,
        hidden_size=client.config.hidden_size,
        config_fp=config_fp,
        weights_fp=weights_fp,
        model_fp=part_model_fp(client),
        key_id=client.key_id,
        max_context=max_context or client.config.max_position_embeddings,
        wire_dtype=wire_dtype or os.environ.get("VEIL_WIRE_DTYPE") or "float16",
        timeout_s=timeout_s,
        heartbeat_s=heartbeat_s,
        reconnect_s=reconnect_s,
        connect_timeout_s=connect_timeout_s,
        step_timeout_s=step_timeout_s if step_timeout_s is not None else step_timeout_from_env(),
        progress=progress,
    )
    if invite_key and not server_key and not insecure and invite_key != saved:
        _pin_server_key(address, invite_key, saved)
    if progress is not None:
        progress("connecting to the trunk server", 1.0)
    return trunk


def _pin_server_key(address: str, key: str, saved: str | None) -> None:
    """Save an invite's server key after the handshake proved the server holds it."""
    from engine import keys as K

    if saved is not None:
        log.warning(
            "the invite's server key for %s differs from the one saved before; the server "
            "proved it holds the new key, so it replaces the old one",
            address,
        )
    try:
        K.save_server_key(address, key)
    except VeilError as exc:  # the session works; only the next bare-address connect needs it
        log.warning("could not save the server key for %s: %s", address, exc)
