"""A real TrunkServer (CURVE on, real sockets) running in a thread of the test process, with
fixed keypairs: no child process to start, nothing random about the keys."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import zmq
import zmq.utils.z85

from engine.local_server import free_port
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
