"""Who may talk to the trunk server (socket thread only).

CurveZMQ authenticates a connection once, at its handshake. A key removed from the allow-list
would keep its open connection, so :class:`ConnectionGate` asks the allow-list on every message
(the list re-reads itself when its content changes): a revoked key is refused at once, and the
server also closes its sessions when it reaps and drops replies still owed to it.

Where a reply may go is not the gate's business any more: the ROUTER runs without
``ROUTER_HANDOVER`` and clients leave their routing id to the server, so each routing id names
one connection for its whole life and cannot be taken over by another one. A session belongs to
the CURVE key that opened it; its replies go to the connection that last spoke for it (so a
client that reconnected after a network drop is found again by its next ping or step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("veil.trunk")


class ConnectionGate:
    """Admits a message only while its connection's key is on the allow-list."""

    def __init__(self, allowed: Callable[[str], bool] | None, insecure: bool) -> None:
        self.allowed = allowed
        self.insecure = insecure

    def key_allowed(self, user: str) -> bool:
        """Is this CURVE key (still) on the allow-list?"""
        return self.insecure or bool(self.allowed is not None and self.allowed(user))

    def admit(self, user: str) -> str | None:
        """Why a message from the key ``user`` is refused, or None when it is admitted."""
        if self.key_allowed(user):
            return None
        log.warning("refused a message from key %s...: not on the allow-list", user[:8])
        return "this computer's key is not on the server's allow-list (it was revoked)"
