"""The Ray actor one trunk replica runs in (imports ``ray``: load only with ``veil[cluster]``).

Ray places the actor (``num_gpus``/``num_cpus`` per replica), restarts it when its process or
node dies (``max_restarts``; the constructor runs again, loading the layers again, under a new
incarnation id), and fails the gateway's pending :meth:`TrunkReplica.watch` call when it dies —
that is how the gateway learns of a death without polling. Steps do not go through Ray calls:
see ``wire.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray

from remote.cluster.replica import ReplicaCore, ReplicaSpec


@ray.remote
class TrunkReplica:
    """One replica: the trunk layers and a batching worker, reached over the CurveZMQ link."""

    def __init__(
        self, spec: ReplicaSpec, gateway_address: str, gateway_key: str, log_level: int
    ) -> None:
        logging.basicConfig(
            level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        self.node = ray.util.get_node_ip_address()
        self.core = ReplicaCore(spec, self.node, gateway_address, gateway_key)

    def info(self) -> dict[str, Any]:
        return {**self.core.info(), "node": self.node, "pid": os.getpid()}

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    async def watch(self) -> None:
        """Never returns: the gateway keeps one call pending, and Ray fails it when this
        replica dies (ActorDiedError, or ActorUnavailableError while Ray restarts it)."""
        await asyncio.Event().wait()
