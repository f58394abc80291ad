"""The client's ZeroMQ link to a trunk server: one DEALER socket with CURVE, its handshake
monitor, bounded receives and byte counters. :class:`~engine.transport.remote.RemoteTrunk`
builds sessions and steps on top of it."""

from __future__ import annotations

import contextlib
import time

import zmq
import zmq.utils.monitor

from engine import protocol as P
from engine.errors import AuthError, TransportError


class Link:
    """Socket plumbing shared by every trunk session of one client."""

    def __init__(
        self,
        address: str,
        server_key: str | None,
        client_keys: tuple[str, str] | None,
        max_reply_bytes: int,
    ) -> None:
        self.address = address
        self.server_key = server_key
        self.client_keys = client_keys
        self.max_reply_bytes = max_reply_bytes
        self.ctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._last_heard = time.monotonic()
        self._auth_failed = False
        self._handshake_trouble = False
        self._keys_unchecked = False

    def _connect(self) -> None:
        self._close_socket()
        s = self.ctx.socket(zmq.DEALER)
        try:
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)  # never queue onto a connection that is not up
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            # A bigger frame than any reply we can ask for drops the connection before a byte
            # of it is kept (a faulty or hostile server cannot make us buffer 256 MiB).
            s.setsockopt(zmq.MAXMSGSIZE, self.max_reply_bytes)
            # No routing id of our own: the server gives each connection one that no other
            # connection can take over. After a network drop, our next ping or step (same key,
            # same session) tells the server where the session's replies go now.
            if self.server_key is not None and self.client_keys is not None:
                s.curve_serverkey = self.server_key.encode()
                s.curve_publickey = self.client_keys[0].encode()
                s.curve_secretkey = self.client_keys[1].encode()
            self.monitor = s.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | zmq.EVENT_HANDSHAKE_SUCCEEDED
            )
            s.connect(self.address)
        except zmq.ZMQError as exc:
            with contextlib.suppress(zmq.ZMQError):
                s.disable_monitor()
            s.close(0)
            if self.monitor is not None:
                self.monitor.close(0)
                self.monitor = None
            raise TransportError(f"cannot connect to {self.address}: {exc}") from None
        self.sock = s
        self._last_heard = time.monotonic()

    def _close_socket(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.sock.close(0)
            self.sock = None
        if self.monitor is not None:
            self.monitor.close(0)
            self.monitor = None

    def _send(self, msg: P.Message) -> bool:
        frames = P.encode(msg)
        assert self.sock is not None
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False  # no connection yet; the heartbeat loop tries again
        self.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        return True

    def _check_monitor(self) -> None:
        if self.monitor is None:
            return
        while True:
            try:
                ev = zmq.utils.monitor.recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            e = ev["event"]
            if e == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                # ZAP 400 is the server's verdict on our key; 500 (or 300) means it cannot
                # check keys now, its own trouble: not a verdict, the connection is retried
                if ev["value"] == 400:
                    self._auth_failed = True
                else:
                    self._keys_unchecked = True
            elif e in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                self._handshake_trouble = True

    def _auth_error(self) -> AuthError:
        pub = self.client_keys[0] if self.client_keys else "?"
        return AuthError(
            f"the trunk server at {self.address} refused this computer's key",
            hint=f"ask its admin to run: veil-trunk allow '{pub}'; or check the server key",
        )

    def _recv(self, timeout_s: float) -> P.Message | None:
        """One message from the server, or None after ``timeout_s``."""
        assert self.sock is not None
        self._check_monitor()
        if self.sock.poll(int(max(timeout_s, 0) * 1000), zmq.POLLIN) == 0:
            self._check_monitor()
            return None
        frames = self.sock.recv_multipart(copy=False)
        self.bytes_received += sum(len(f) for f in frames)
        self._last_heard = time.monotonic()
        try:
            return P.decode(frames)
        except P.ProtocolError as exc:
            raise TransportError(f"the trunk server sent a bad message: {exc.message}") from None

    def _destroy(self) -> None:
        """Close the socket and the context, whatever state they are in (never blocks)."""
        self._close_socket()
        self.ctx.destroy(linger=0)
