"""A real TrunkServer (CURVE on, real sockets) running in a thread of the test process, with
fixed keypairs: no child process to start, nothing random about the keys."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.utils.z85

from engine.local_server import free_port
from engine.split import ClientModel
from engine.transport import RemoteTrunk, connect_trunk, inflight
from engine.transport import remote as remote_transport
from remote.server import ServerOptions, TrunkServer


def fixed_keypair(seed: int) -> tuple[str, str]:
    """(public, secret) z85 CURVE keys derived from ``seed`` (the same every run)."""
    secret = zmq.utils.z85.encode(bytes((seed * 37 + j * 11) % 256 for j in range(32)))
    return zmq.curve_public(secret).decode(), secret.decode()


SERVER_KEYS = fixed_keypair(1)
CLIENT_KEYS = fixed_keypair(2)
STRANGER_KEYS = fixed_keypair(3)


@contextmanager
def trunk_in_thread(
    folder: Path, allow: Sequence[str] = (CLIENT_KEYS[0],), **opts: object
) -> Iterator[TrunkServer]:
    """Serve ``folder``'s trunk on a free loopback port until the block ends, to the client
    keys in ``allow``."""
    options = ServerOptions(model=str(folder), bind=f"tcp://127.0.0.1:{free_port()}", **opts)  # type: ignore[arg-type]
    srv = TrunkServer(
        options,
        secret_key=SERVER_KEYS[1].encode(),
        public_key=SERVER_KEYS[0].encode(),
        allowed=lambda k: k in allow,
    )
    t = threading.Thread(target=srv.serve, name="test-trunk", daemon=True)
    t.start()
    assert srv.ready.wait(30), "the server did not start"
    try:
        yield srv
    finally:
        srv.stop()
        t.join(15)


@contextmanager
def connect_without_eos(srv: TrunkServer, client: ClientModel) -> Iterator[RemoteTrunk]:
    """A connection to ``srv`` with the fixed client keys, then no EOS on the client (random-
    weight outputs run long; the handshake checks the model's config, so it changes after)."""
    cfg = client.config
    with connect_trunk(
        srv.address,
        client,
        server_key=SERVER_KEYS[0],
        client_keys=CLIENT_KEYS,
        heartbeat_s=0.2,
        wire_dtype="float32",
    ) as trunk:
        client.config = dataclasses.replace(cfg, eos_token_ids=())
        try:
            yield trunk
        finally:
            client.config = cfg


def record_overlapped(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """From now on, the step ids the client sends while an earlier step's answer is out."""
    ids: set[int] = set()
    real = inflight.submit_step

    def submit(trunk: RemoteTrunk, e: Any) -> inflight.Ticket:
        t = real(trunk, e)
        if not t.alone:
            ids.add(t.step)
        return t

    monkeypatch.setattr(remote_transport, "submit_step", submit)
    return ids
