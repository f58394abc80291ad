"""A trunk server that ships its model, in a thread of the test process (fixed keys), and the
client-side keyring set up as a laptop with only an invite would have it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from engine import protocol as P
from engine.delivery.manifest import public_key_text
from engine.local_server import free_port
from remote.server import ServerOptions, TrunkServer
from tests.inproc_trunk import CLIENT_KEYS, SERVER_KEYS

SIGN_SEED = bytes(range(32))  # the server's model-signing key (fixed)
OTHER_SEED = bytes(range(1, 33))


def invite(srv: TrunkServer, seed: bytes = SIGN_SEED) -> str:
    return P.make_invite(srv.address, SERVER_KEYS[0], public_key_text(seed))


def laptop(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """A fresh laptop: its keypair (allowed on the server) in a memory keyring, nothing saved
    for any server, and an empty part cache at ``cache``."""
    from engine import keys
    from engine.delivery import fetch

    monkeypatch.setenv("VEIL_KEYRING", "memory")
    monkeypatch.setenv("VEIL_WIRE_DTYPE", "float32")
    monkeypatch.setattr(keys, "_backend", None)
    keys.backend().set_password(keys.SERVICE, keys.CLIENT_PUBLIC, CLIENT_KEYS[0])
    keys.backend().set_password(keys.SERVICE, keys.CLIENT_SECRET, CLIENT_KEYS[1])
    monkeypatch.setattr(fetch, "parts_root", lambda: cache)


@contextmanager
def shipping_server(
    model: Path | str, parts: Path, port: int | None = None, **opts: Any
) -> Iterator[TrunkServer]:
    options = ServerOptions(
        model=str(model),
        bind=f"tcp://127.0.0.1:{port or free_port()}",
        delivery=True,
        parts_dir=str(parts),
        **opts,
    )
    srv = TrunkServer(
        options,
        secret_key=SERVER_KEYS[1].encode(),
        public_key=SERVER_KEYS[0].encode(),
        allowed=lambda k: k == CLIENT_KEYS[0],
        signing_key=SIGN_SEED,
    )
    t = threading.Thread(target=srv.serve, name="test-trunk", daemon=True)
    t.start()
    assert srv.ready.wait(30), "the server did not start"
    try:
        yield srv
    finally:
        srv.stop()
        t.join(15)
