"""Trunk replicas on a Ray cluster behind one encrypted front (``veil-trunk serve --ray``).

* ``gateway.py`` — the front: today's CURVE ROUTER server (keys, allow-list, invites, protocol
  checks, ownership, limits) with its batching worker swapped for a router over replicas;
* ``router.py`` — that router: sticky sessions, replica health, results coming back;
* ``actor.py`` — the Ray actor each replica runs in (the only modules here that import ``ray``
  are ``actor.py``, ``router.py`` and ``gateway.py``; Ray is the optional ``veil[cluster]`` extra);
* ``replica.py`` — what runs inside a replica: the trunk layers and a ``TrunkWorker``;
* ``wire.py`` — the gateway <-> replica link (CurveZMQ, not Ray's object transport);
* ``placement.py`` — pure policy: which replica takes a new session, merged statistics.

Importing this package imports nothing heavy, so ``veil-trunk`` without ``--ray`` never needs Ray.
"""
