"""The client side of the trunk protocol: :class:`RemoteTrunk`, a :class:`~engine.split.Trunk`
whose layers run on a ``veil-trunk`` server.

* CurveZMQ with this computer's keypair (OS keyring, ``engine.keys``) and the server's public
  key (from an invite code, or saved in the keyring for the address). A server key from an
  invite is saved only after the server proved it holds it (a completed handshake).
* Every step carries a step id; a retry of the same id returns the server's cached reply.
* While a reply is pending the client pings every ``heartbeat_s``; a pong tells it whether the
  server still has the session and the step. If the server is silent for ``timeout_s`` the
  socket is rebuilt. Every step has one overall deadline and recovery is bounded
  (``engine.transport.policy``): a misbehaving server ends in one :class:`TransportError`.
* A journal of every step sent since the last :meth:`reset` (head activations as they went on
  the wire, positions, parents, keep) lets the client rebuild the trunk's KV cache on a fresh
  session after a server restart, session expiry or lost connection — the replayed cache is
  bit-identical, so generation continues exactly as if nothing happened.
* Long chain blocks go as several steps of at most ``PREFILL_CHUNK`` rows, so prompts, replays
  and re-splits of any length fit the protocol's 4,096-row block.
* Replies are bounded (``ZMQ_MAXMSGSIZE``) and checked (shape, finiteness) before use.
"""

from engine.transport.connect import (
    client_fingerprint,
    connect_trunk,
    resolve_server,
    step_timeout_from_env,
)
from engine.transport.policy import PREFILL_CHUNK
from engine.transport.remote import STEP_TIMEOUT_S, RemoteTrunk

__all__ = [
    "PREFILL_CHUNK",
    "STEP_TIMEOUT_S",
    "RemoteTrunk",
    "client_fingerprint",
    "connect_trunk",
    "resolve_server",
    "step_timeout_from_env",
]
