"""A hand-built ZMTP 3.0 client over a plain TCP socket, NULL or CURVE (RFC 23, RFC 26), for
sending what libzmq's own sender never sends: a multipart message that never ends.

Only the client side of the handshake is here, as far as the tests need it: greeting, READY
(NULL) or HELLO / WELCOME / INITIATE / READY (CURVE, with PyNaCl's crypto_box), then frames.
"""

from __future__ import annotations

import os
import select
import socket
import struct

import zmq.utils.z85
from nacl.public import Box, PrivateKey, PublicKey


def _greeting(mechanism: bytes) -> bytes:
    """Signature, version 3.0, mechanism, as-server = 0, filler: 64 bytes."""
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\x00") + bytes(32)


def _frame(body: bytes, flags: int) -> bytes:
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body


def _command(body: bytes) -> bytes:
    return _frame(body, 0x04)


def _metadata(socket_type: bytes = b"DEALER") -> bytes:
    name = b"Socket-Type"
    return bytes([len(name)]) + name + struct.pack(">I", len(socket_type)) + socket_type


class RawClient:
    """One connection to a Veil trunk server, speaking ZMTP by hand."""

    def __init__(
        self,
        address: str,
        server_key: str | None = None,
        client_keys: tuple[str, str] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.curve = server_key is not None
        self._nonce = 0  # the client's short nonce: every command it sends takes the next one
        if self.curve:
            assert server_key is not None and client_keys is not None
            self._handshake_curve(server_key, client_keys)
        else:
            self._handshake_null()

    # ------------------------------------------------------------------ reading

    def _read_exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the server closed the connection")
            out += chunk
        return out

    def _read_frame(self) -> bytes:
        flags = self._read_exact(1)[0]
        size = (
            struct.unpack(">Q", self._read_exact(8))[0] if flags & 0x02 else self._read_exact(1)[0]
        )
        return self._read_exact(size)

    # ------------------------------------------------------------------ handshakes

    def _handshake_null(self) -> None:
        self.sock.sendall(_greeting(b"NULL") + _command(b"\x05READY" + _metadata()))
        self._read_exact(64)
        ready = self._read_frame()
        assert ready.startswith(b"\x05READY"), ready[:16]

    def _next_nonce(self) -> bytes:
        self._nonce += 1
        return struct.pack(">Q", self._nonce)

    def _handshake_curve(self, server_key: str, client_keys: tuple[str, str]) -> None:
        server = PublicKey(zmq.utils.z85.decode(server_key))
        me = PrivateKey(zmq.utils.z85.decode(client_keys[1]))
        mine = PublicKey(zmq.utils.z85.decode(client_keys[0]))
        transient = PrivateKey.generate()
        self.sock.sendall(_greeting(b"CURVE"))
        self._read_exact(64)
        # HELLO: version, 72 bytes of padding, C', nonce, Box[64 zeros](C' -> S)
        n = self._next_nonce()
        sig = Box(transient, server).encrypt(bytes(64), b"CurveZMQHELLO---" + n).ciphertext
        hello = b"\x05HELLO" + b"\x01\x00" + bytes(72) + bytes(transient.public_key) + n + sig
        self.sock.sendall(_command(hello))
        welcome = self._read_frame()
        assert welcome.startswith(b"\x07WELCOME"), welcome[:16]
        plain = Box(transient, server).decrypt(welcome[24:], b"WELCOME-" + welcome[8:24])
        server_transient, cookie = PublicKey(plain[:32]), plain[32:]
        # INITIATE: cookie, nonce, Box[C + vouch + metadata](C' -> S')
        vouch_nonce = os.urandom(16)
        vouch = Box(me, server_transient).encrypt(
            bytes(transient.public_key) + bytes(server), b"VOUCH---" + vouch_nonce
        )
        self.box = Box(transient, server_transient)
        n = self._next_nonce()
        inner = bytes(mine) + vouch_nonce + vouch.ciphertext + _metadata()
        box = self.box.encrypt(inner, b"CurveZMQINITIATE" + n).ciphertext
        self.sock.sendall(_command(b"\x08INITIATE" + cookie + n + box))
        ready = self._read_frame()
        if not ready.startswith(b"\x05READY"):
            raise ConnectionError(f"handshake refused: {ready[:40]!r}")

    # ------------------------------------------------------------------ frames

    def frame(self, data: bytes, more: bool) -> bytes:
        """The wire bytes of one message frame (encrypted in a MESSAGE command with CURVE)."""
        if not self.curve:
            return _frame(data, 0x01 if more else 0x00)
        n = self._next_nonce()
        box = self.box.encrypt(bytes([1 if more else 0]) + data, b"CurveZMQMESSAGEC" + n)
        return _frame(b"\x07MESSAGE" + n + box.ciphertext, 0x00)

    def send(self, wire: bytes) -> None:
        """Send ``wire``; ConnectionResetError once the server has closed the connection (its
        end, when it cut us off, may be a FIN behind a zero window: no reset would come)."""
        view = memoryview(wire)
        timeout = self.sock.gettimeout()
        while view:
            readable, writable, _ = select.select([self.sock], [self.sock], [], timeout)
            if readable and not self.sock.recv(1 << 16):
                raise ConnectionResetError("the server closed the connection")
            if writable:
                view = view[self.sock.send(view) :]
            elif not readable:
                raise TimeoutError("the server reads nothing more")

    def close(self) -> None:
        self.sock.close()
