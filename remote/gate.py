"""Who may talk to the trunk server (socket thread only).

CurveZMQ authenticates a connection once, at its handshake, by asking a ZAP handler
(:class:`ZapHandler`, answered on the socket thread) whether the client's key is on the
allow-list. A key removed from the allow-list would keep its open connection, so
:class:`ConnectionGate` asks the allow-list on every message (the list re-reads itself when its
content changes): a revoked key is refused at once, and the server also closes its sessions when
it reaps and drops replies still owed to it. A server that cannot read its allow-list (see
``remote/allowlist.py``) keeps the last list it read and never tells a client its key was
refused because of that: a new key is answered "internal error" (ZAP status 500; libzmq
leaves a 300 unanswered until the handshake times out), which clients treat as the server's
problem, not as a verdict. Refusals are logged at most once a
minute per source address (or key), then counted (``remote/loglimit.py``).

Where a reply may go is not the gate's business any more: the ROUTER runs without
``ROUTER_HANDOVER`` and clients leave their routing id to the server, so each routing id names
one connection for its whole life and cannot be taken over by another one. A session belongs to
the CURVE key that opened it; its replies go to the connection that last spoke for it (so a
client that reconnected after a network drop is found again by its next ping or step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq
import zmq.utils.z85

from remote.loglimit import LogLimiter

log = logging.getLogger("veil.trunk")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27), one handler per context
ZAP_DOMAIN = "veil"


def _list_unreadable(allowed: Callable[[str], bool] | None) -> bool:
    """Is the allow-list behind ``allowed`` failing to read right now (remote/allowlist.py)?"""
    return getattr(allowed, "failing", None) is not None


class ConnectionGate:
    """Admits a message only while its connection's key is on the allow-list."""

    def __init__(self, allowed: Callable[[str], bool] | None, insecure: bool) -> None:
        self.allowed = allowed
        self.insecure = insecure
        self.refused = LogLimiter(log, "refused messages")

    def key_allowed(self, user: str) -> bool:
        """Is this CURVE key (still) on the allow-list?"""
        return self.insecure or bool(self.allowed is not None and self.allowed(user))

    def admit(self, user: str) -> str | None:
        """Why a message from the key ``user`` is refused, or None when it is admitted."""
        if self.key_allowed(user):
            return None
        key = f"key {user[:8]}..."
        self.refused.event(key, "refused a message from %s: not on the allow-list", key)
        return "this computer's key is not on the server's allow-list (it was revoked)"


class ZapHandler:
    """The CURVE handshake's allow-list check (RFC 27 ZAP), answered on the socket thread."""

    def __init__(self, ctx: zmq.Context, allowed: Callable[[str], bool] | None) -> None:
        self.allowed = allowed
        self.refused = LogLimiter(log, "refused handshakes")
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)  # before any CURVE socket binds: no handshake goes unasked

    def answer(self) -> None:
        """Answer every waiting request (never blocks)."""
        while True:
            try:
                req = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.sock.send_multipart(self._reply(req))

    def _reply(self, req: list[bytes]) -> list[bytes]:
        if len(req) < 6 or req[0] != b"1.0":
            return [b"1.0", req[1] if len(req) > 1 else b"", b"400", b"bad ZAP request", b"", b""]
        version, rid, domain, address, _identity, mechanism = req[:6]
        where = address.decode("utf-8", "replace") or "?"
        key = req[6] if len(req) == 7 else b""
        if domain != ZAP_DOMAIN.encode() or mechanism != b"CURVE" or len(key) != 32:
            return [version, rid, b"400", b"not a Veil client", b"", b""]
        z85 = zmq.utils.z85.encode(key).decode()
        try:
            ok = bool(self.allowed is not None and self.allowed(z85))
        except Exception:  # a bug in the check is the server's fault, not the client's
            log.exception("the allow-list check failed")
            return [version, rid, b"500", b"the server cannot check keys now", b"", b""]
        if ok:
            return [version, rid, b"200", b"OK", z85.encode(), b""]
        if _list_unreadable(self.allowed):
            return [version, rid, b"500", b"the server cannot read its allow-list now", b"", b""]
        self.refused.event(
            where, "refused a client key %s... from %s: not on the allow-list", z85[:8], where
        )
        return [version, rid, b"400", b"unknown key", b"", b""]

    def close(self) -> None:
        self.sock.close(0)
