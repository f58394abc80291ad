"""Who may talk to the trunk server, and who a reply may go to (socket thread only).

CurveZMQ authenticates a connection once, at its handshake; the ROUTER then knows a peer only by
its *routing id*, which the client chooses. Two gaps follow, and :class:`ConnectionGate` closes
them:

* **Revocation.** A key removed from the allow-list would keep its open connection. The gate
  asks the allow-list on every message (the list re-reads itself when its content changes), so
  a revoked key is refused at once; the server also closes its sessions when it reaps.
* **Routing-id takeover.** With ``ROUTER_HANDOVER`` (kept, so a client that reconnects after a
  network drop gets its id back at once), a *new* connection presenting an id in use takes it
  over, and replies to that id reach the new connection. The gate binds each id to the key of
  the sessions using it: a message from another key on that id is refused, and a worker reply
  is pushed only if the id has shown its bound key since the last new connection on the socket
  (a takeover happens only when a connection is attached, after a successful CURVE handshake,
  which the socket monitor reports; refused handshakes do not count, so strangers cannot
  trigger it). Otherwise the reply is held until
  the bound key speaks again — its client pings while it waits — and stays cached on the server
  for a retry of the step. So a connection that took an id over, silent or not, receives nothing
  of the sessions bound to it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("veil.trunk")

SEND, HOLD, DROP = "send", "hold", "drop"


class ConnectionGate:
    """Binds routing ids to CURVE keys and says where worker replies may go."""

    def __init__(
        self, allowed: Callable[[str], bool] | None, insecure: bool, hold_limit: int
    ) -> None:
        self.allowed = allowed
        self.insecure = insecure
        self.hold_limit = hold_limit  # replies held per routing id at most
        self.bound: dict[bytes, str] = {}  # routing id -> key of the sessions using it
        self.confirmed: dict[bytes, str] = {}  # routing id -> key seen since the last change
        self.held: dict[bytes, list[list[Any]]] = {}  # replies waiting for a confirmation
        self.events: zmq.Socket | None = None  # monitor of the ROUTER: completed handshakes

    def attach(self, sock: zmq.Socket) -> None:
        """Watch the ROUTER's connections (before it serves anyone)."""
        if not self.insecure:
            self.events = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def detach(self, sock: zmq.Socket) -> None:
        """Close the monitor (before the context terminates)."""
        if self.events is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            self.events.close(0)
            self.events = None

    def key_allowed(self, user: str) -> bool:
        """Is this CURVE key (still) on the allow-list?"""
        return self.insecure or bool(self.allowed is not None and self.allowed(user))

    def admit(self, ident: bytes, user: str, owns_sessions: Callable[[bytes], bool]) -> str | None:
        """Why a message from (routing id, key) is refused, or None when it is admitted (which
        confirms the connection behind the id)."""
        if self.insecure:
            return None
        self.watch()  # a connection change before this message must not undo its confirmation
        if not self.key_allowed(user):
            log.warning("refused a message from key %s...: not on the allow-list", user[:8])
            return "this computer's key is not on the server's allow-list (it was revoked)"
        bound = self.bound.get(ident)
        if bound is not None and bound != user and owns_sessions(ident):
            log.warning(
                "refused key %s...: its connection took over the routing id of another "
                "key's sessions",
                user[:8],
            )
            return "this connection's id belongs to another client"
        self.bound[ident] = user
        self.confirmed[ident] = user
        return None

    def watch(self) -> None:
        """A new connection may take over a routing id in use: after one, every id must show
        its key again before replies are pushed to it."""
        if self.events is None:
            return
        changed = False
        while True:
            try:
                self.events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            changed = True
        if changed:
            self.confirmed.clear()

    def route(self, ident: bytes) -> str:
        """SEND, HOLD or DROP for a worker reply to ``ident``."""
        if self.insecure:
            return SEND
        self.watch()
        bound = self.bound.get(ident)
        if bound is None or not self.key_allowed(bound):
            return DROP  # nobody may receive it (its key was revoked meanwhile)
        return SEND if self.confirmed.get(ident) == bound else HOLD

    def hold(self, ident: bytes, frames: list[Any]) -> None:
        held = self.held.setdefault(ident, [])
        held.append(frames)
        del held[: -self.hold_limit]

    def take_held(self, ident: bytes) -> list[list[Any]]:
        """Replies held for ``ident`` (call after :meth:`admit` confirmed it)."""
        return self.held.pop(ident, [])

    def forget_except(self, idents: set[bytes]) -> None:
        """Drop the state of routing ids that no longer own a session."""
        self.watch()
        for table in (self.bound, self.confirmed, self.held):
            for ident in [i for i in table if i not in idents]:
                del table[ident]
