"""The client side of the trunk protocol: :class:`RemoteTrunk`, a :class:`~engine.split.Trunk`
whose layers run on a ``veil-trunk`` server.

* CurveZMQ with this computer's keypair (OS keyring, ``engine.keys``) and the server's public
  key (from an invite code, or saved in the keyring for the address).
* Every step carries a step id; a retry of the same id returns the server's cached reply.
* While a reply is pending the client pings every ``heartbeat_s``; a pong tells it whether the
  server still has the session and the step. If the server is silent for ``timeout_s`` the
  socket is rebuilt (with backoff) until ``reconnect_s`` has passed.
* A journal of every step sent since the last :meth:`reset` (head activations as they went on
  the wire, positions, parents, keep) lets the client rebuild the trunk's KV cache on a fresh
  session after a server restart, session expiry or lost connection — the replayed cache is
  bit-identical, so generation continues exactly as if nothing happened.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq
import zmq.utils.monitor

from engine import protocol as P
from engine.errors import (
    AuthError,
    FingerprintMismatch,
    ServerBusy,
    SplitError,
    TransportError,
)
from engine.loading import Progress, weights_fingerprint
from engine.model import layer_tensor_names
from engine.split import ClientModel

log = logging.getLogger("veil.transport")


@dataclass
class _Entry:
    positions: list[int]
    parents: list[int] | None
    keep: list[int] | None
    hidden: torch.Tensor  # [B, H] in the wire dtype, exactly as sent


class _SessionLost(Exception):
    """The server no longer has our session: reopen and replay."""


class _ConnectionLost(Exception):
    """The server has been silent too long: rebuild the socket, reopen and replay."""


class _NoAnswer(TransportError):
    """An open got no answer in time (server down, unreachable, or a key mismatch)."""


def client_fingerprint(client: ClientModel) -> tuple[str, str | None]:
    """(config hash, trunk-weights hash or None when this client lacks the trunk tensors)."""
    start, end = client.plan.trunk_range
    names = [n for i in range(start, end) for n in layer_tensor_names(client.config, i)]
    if all(client.reader.has(n) for n in names):
        return client.config.fingerprint(), weights_fingerprint(client.reader, names)
    return client.config.fingerprint(), None


class RemoteTrunk:
    """Trunk layers [start, end) on a remote server."""

    def __init__(
        self,
        address: str,
        *,
        server_key: str | None,
        client_keys: tuple[str, str] | None,
        start: int,
        end: int,
        hidden_size: int,
        config_fp: str,
        weights_fp: str | None,
        max_context: int = 4096,
        wire_dtype: str = "float16",
        timeout_s: float = 10.0,
        heartbeat_s: float = 0.5,
        reconnect_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        progress: Progress | None = None,
    ) -> None:
        if not address.startswith("tcp://"):
            raise TransportError(f"'{address}' is not a tcp://HOST:PORT address or invite code")
        if (server_key is None) != (client_keys is None):
            raise TransportError("CURVE needs both the server key and a client keypair")
        self.address = address
        self.server_key = server_key
        self.client_keys = client_keys
        self.start = start
        self.end = end
        self.hidden_size = hidden_size
        self.config_fp = config_fp
        self.weights_fp = weights_fp
        self.max_context = max_context
        try:
            self.wire_dtype = P.wire_dtype_name(wire_dtype)
        except ValueError as exc:
            raise TransportError(str(exc)) from None
        self.wire_torch = P.WIRE_DTYPES[self.wire_dtype]
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.reconnect_s = reconnect_s
        self.connect_timeout_s = connect_timeout_s
        self.progress = progress
        self.ctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.session: str | None = None
        self.step_id = -1
        self.journal: list[_Entry] = []
        self._nonce = itertools.count(1)
        self._last_heard = time.monotonic()
        self._auth_failed = False
        # stats
        self.round_trips = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.replays = 0
        self.replayed_steps = 0
        self.reconnects = 0
        self.server_ms = 0.0
        self.queue_ms = 0.0
        self._net_ms: list[float] = []
        self._ping_ms: list[float] = []
        self.closed = False
        self._handshake_trouble = False
        try:
            self._connect()
            self._open(self.connect_timeout_s)
        except BaseException:
            self._close_socket()
            self.ctx.term()
            raise

    # ------------------------------------------------------------------ socket

    def _connect(self) -> None:
        self._close_socket()
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)  # never queue onto a connection that is not up
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # A random routing id that survives reconnects of this socket, so a brief network drop
        # keeps the session (the server also checks the CURVE key behind it).
        s.setsockopt(zmq.ROUTING_ID, b"v" + secrets.token_bytes(15))
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
                self._auth_failed = True
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

    # ------------------------------------------------------------------ session

    def _raise_error(self, e: P.Error) -> None:
        if e.code == P.E_BUSY:
            raise ServerBusy(e.message, hint="try again later or use fewer local sessions")
        if e.code == P.E_FINGERPRINT:
            raise FingerprintMismatch(
                e.message, hint="client and server must load the same model checkpoint"
            )
        if e.code == P.E_RANGE:
            raise SplitError(e.message, hint="choose --local-layers so the trunk fits the server")
        if e.code == P.E_CONTEXT:
            raise TransportError(e.message, hint="start a new conversation")
        raise TransportError(f"the trunk server answered: {e.message} [{e.code}]")

    def _open(self, timeout_s: float) -> None:
        """Open a session (the socket must be connected). Raises on refusal or timeout."""
        msg = P.Open(
            self.config_fp,
            self.weights_fp,
            self.start,
            self.end,
            self.wire_dtype,
            self.hidden_size,
            self.max_context,
        )
        deadline = time.monotonic() + timeout_s
        sent = False
        next_try = 0.0
        while True:
            now = time.monotonic()
            if now >= next_try:
                sent = self._send(msg)
                next_try = now + (2.0 if sent else 0.05)
            if self._auth_failed:
                raise self._auth_error()
            if now > deadline:
                if self._handshake_trouble:
                    raise _NoAnswer(
                        f"the encrypted handshake with {self.address} failed",
                        hint="the server key does not match this server: get a new invite code",
                    )
                raise _NoAnswer(
                    f"no answer from the trunk server at {self.address}",
                    hint="is it running and reachable, and is its key right?",
                )
            reply = self._recv(0.05 if not sent else min(0.25, deadline - now))
            if reply is None:
                continue
            if isinstance(reply, P.Opened):
                if (reply.start, reply.end) != (self.start, self.end):
                    raise TransportError("the server opened a session for other layers")
                self.session = reply.session
                self.step_id = -1
                t0 = time.perf_counter()
                self._measure_ping()
                log.debug("session %s (%.1f ms ping)", reply.session, time.perf_counter() - t0)
                return
            if isinstance(reply, P.Error):
                self._raise_error(reply)
            # stale replies of an older session (pong/result): ignore

    def _measure_ping(self) -> None:
        nonce = next(self._nonce)
        t0 = time.perf_counter()
        if not self._send(P.Ping(nonce)):
            return
        deadline = t0 + 2.0
        while time.perf_counter() < deadline:
            r = self._recv(deadline - time.perf_counter())
            if isinstance(r, P.Pong) and r.nonce == nonce:
                self._ping_ms.append((time.perf_counter() - t0) * 1000.0)
                return

    def _recover(self, why: str) -> None:
        """Get a fresh session (rebuilding the socket if needed) and replay the journal."""
        deadline = time.monotonic() + self.reconnect_s
        delay = 0.1
        rebuild = why == "connection"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TransportError(
                    f"lost the trunk server at {self.address} and could not get it back "
                    f"within {self.reconnect_s:g} s",
                    hint="check the server and the network, then try again",
                )
            try:
                if rebuild:
                    self.reconnects += 1
                    self._connect()
                self._open(min(self.timeout_s, remaining))
                self._replay()
                return
            except (_SessionLost, _ConnectionLost, _NoAnswer) as exc:
                log.info("reconnecting to %s: %s", self.address, exc or type(exc).__name__)
                rebuild = True
            time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, 2.0)

    def _replay(self) -> None:
        if not self.journal:
            return
        self.replays += 1
        log.info("replaying %d steps onto a new session", len(self.journal))
        if self.progress is not None:
            self.progress("reconnecting to the trunk server", 0.0)
        for entry in self.journal:
            self.step_id += 1
            self.replayed_steps += 1
            self._exchange(entry, want=False)
        if self.progress is not None:
            self.progress("reconnecting to the trunk server", 1.0)

    # ------------------------------------------------------------------ steps

    def _exchange(self, e: _Entry, want: bool) -> P.Result:
        """Send step ``self.step_id`` and wait for its result, pinging while waiting."""
        assert self.session is not None
        sid, step = self.session, self.step_id
        msg = P.Step(sid, step, e.positions, e.parents, e.keep, self.wire_dtype, e.hidden, want)
        sent = self._send(msg)
        self._last_heard = time.monotonic()
        last_ping = time.monotonic()
        pings: set[int] = set()  # only pongs to this exchange's pings describe this step
        while True:
            r = self._recv(self.heartbeat_s)
            now = time.monotonic()
            if self._auth_failed:
                raise self._auth_error()
            if r is None:
                if now - self._last_heard > self.timeout_s:
                    raise _ConnectionLost()
                if not sent:
                    sent = self._send(msg)
                if now - last_ping >= self.heartbeat_s:
                    nonce = next(self._nonce)
                    if self._send(P.Ping(nonce, sid)):
                        pings.add(nonce)
                    last_ping = now
                continue
            if isinstance(r, P.Result) and r.session == sid and r.step == step:
                return r
            if isinstance(r, P.Pong):
                if r.nonce not in pings:
                    continue
                if not r.known:
                    raise _SessionLost()
                if r.last_step < step and not r.in_flight:
                    sent = self._send(msg)  # our step was lost on the way: send it again
                continue
            if isinstance(r, P.Error):
                if r.session not in (None, sid) or (r.step is not None and r.step != step):
                    continue  # about something older
                if r.code == P.E_UNKNOWN_SESSION:
                    raise _SessionLost()
                if r.code == P.E_INTERNAL:
                    raise _SessionLost()
                self._raise_error(r)
            # anything else (stale results, old pongs) is ignored

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        if self.closed:
            raise TransportError("this trunk connection is closed")
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise TransportError(f"hidden states must be [B, {self.hidden_size}]")
        if self.session is None:
            self._recover("session")
        wire = hidden.detach().to(device="cpu", dtype=self.wire_torch).contiguous()  # [B, H]
        e = _Entry(
            [int(p) for p in positions.tolist()],
            None if parents is None else [int(p) for p in parents],
            None if keep is None else [int(k) for k in keep],
            wire,
        )
        t0 = time.perf_counter()
        self.step_id += 1
        self.journal.append(e)
        try:
            while True:
                try:
                    r = self._exchange(e, want=True)
                    break
                except (_SessionLost, _ConnectionLost) as lost:
                    self.journal.pop()
                    self._recover("session" if isinstance(lost, _SessionLost) else "connection")
                    self.step_id += 1
                    self.journal.append(e)
        except BaseException:
            if self.journal and self.journal[-1] is e:  # refused: as if never sent
                self.journal.pop()
                self.step_id -= 1
            raise
        wall_ms = (time.perf_counter() - t0) * 1000.0
        self.round_trips += 1
        self.server_ms += r.server_ms
        self.queue_ms += r.queue_ms
        self._net_ms.append(max(wall_ms - r.server_ms, 0.0))
        if r.hidden is None or tuple(r.hidden.shape) != tuple(wire.shape):
            raise TransportError("the trunk server answered with the wrong shape")
        return r.hidden.to(torch.float32, copy=True)  # [B, H] (the frame buffer is not kept)

    def reset(self) -> None:
        """Start a new conversation: the next step opens a fresh session, the journal empties."""
        self.journal.clear()
        if self.session is not None and self.sock is not None:
            self._send(P.Close(self.session))
        self.session = None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.session is not None and self.sock is not None:
            self._send(P.Close(self.session))
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                r = self._recv(deadline - time.monotonic())
                if r is None or isinstance(r, P.Closed):
                    break
        self._close_socket()
        self.ctx.term()

    def __enter__(self) -> RemoteTrunk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ stats

    @property
    def rtt_ms(self) -> float:
        """Measured network round trip: median of (step wall time - server compute)."""
        if self._net_ms:
            return float(statistics.median(self._net_ms))
        return float(statistics.median(self._ping_ms)) if self._ping_ms else 0.0

    def json_stats(self) -> dict[str, Any]:
        return {
            "round_trips": self.round_trips,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "rtt_ms": round(self.rtt_ms, 3),
            "ping_ms": round(statistics.median(self._ping_ms), 3) if self._ping_ms else None,
            "replays": self.replays,
            "replayed_steps": self.replayed_steps,
            "server_ms": round(self.server_ms, 3),
            "server_queue_ms": round(self.queue_ms, 3),
            "wire_dtype": self.wire_dtype,
        }


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
    reconnect_s: float = 60.0,
    connect_timeout_s: float = 10.0,
    max_context: int | None = None,
) -> RemoteTrunk:
    """Connect ``client``'s trunk range to a server given as ``tcp://HOST:PORT`` or an invite.

    Keys: ``server_key``/``client_keys`` when given (the local demo server), else the invite's
    server key (saved to the keyring for next time) or the key saved for that address, and this
    computer's keypair from the keyring. ``insecure`` (plain TCP) is refused off loopback.
    ``wire_dtype`` defaults to ``$VEIL_WIRE_DTYPE`` or float16.
    """
    from engine import keys as K

    address, invite_key = resolve_server(server)
    if insecure:
        host = address[len("tcp://") :].rsplit(":", 1)[0]
        if host not in ("127.0.0.1", "localhost", "[::1]") and not host.startswith("127."):
            raise TransportError("plain TCP (insecure) is only allowed to a loopback address")
        skey, ckeys = None, None
    else:
        skey = server_key or invite_key
        if invite_key and not server_key:
            K.save_server_key(address, invite_key)
        if skey is None:
            skey = K.server_key(address)
        if skey is None:
            raise TransportError(
                f"no key is saved for the trunk server at {address}",
                hint="connect once with its invite code (veil-trunk invite prints it)",
            )
        ckeys = client_keys or K.client_keypair()
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
        max_context=max_context or client.config.max_position_embeddings,
        wire_dtype=wire_dtype or os.environ.get("VEIL_WIRE_DTYPE") or "float16",
        timeout_s=timeout_s,
        heartbeat_s=heartbeat_s,
        reconnect_s=reconnect_s,
        connect_timeout_s=connect_timeout_s,
        progress=progress,
    )
    if progress is not None:
        progress("connecting to the trunk server", 1.0)
    return trunk
