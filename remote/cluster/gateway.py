"""``veil-trunk serve --ray``: the trunk server's socket thread in front of Ray replicas.

:class:`GatewayServer` *is* :class:`remote.server.TrunkServer` — the CURVE ROUTER, allow-list,
protocol validation, ownership (sessions belong to CURVE keys), step order, idle reaping and
limits are the same code — with three hooks changed: the compute behind it is a
:class:`ReplicaRouter` instead of a local ``TrunkWorker``, a new session is admitted onto a
chosen replica (``placement.py``), and a session's cache may grow only within its replica's
budget. The gateway loads no layers; it reads the model's config and a sliver of each trunk
tensor (for the fingerprints clients check), so the model files must be on the gateway's
machine too.

``--max-sessions`` and ``--max-cache-gb`` are per replica (a replica is one GPU, or G GPUs); the
gateway's total is that times the replicas that are up, and ``busy`` means no ready replica can
take the session, or the session's own replica cannot grow its cache.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import ray

from remote.cluster.local_ray import INIT_OPTIONS, PrivateRay, PrivateRayError
from remote.cluster.options import ClusterOptions
from remote.cluster.placement import Load, choose_replica
from remote.cluster.replica import ReplicaSpec
from remote.cluster.router import ClusterError, ReplicaRouter
from remote.server import INITIAL_CAPACITY, Backend, ServerOptions, Session, TrunkServer

log = logging.getLogger("veil.trunk.gateway")

STATUS_EVERY_S = 60.0


def connect_ray(c: ClusterOptions) -> Callable[[], None] | None:
    """Join (or start) the Ray runtime; returns how to shut it down when this call started it
    (None for a runtime the caller already started, as tests do: it is used as it is).

    No address: a :class:`PrivateRay` on loopback with its own token and folder. ``auto`` or
    ``HOST:PORT``: the cluster that ``ray start`` made, with the addresses and token its admin
    gave it (see the README's multi-machine section for what must be firewalled)."""
    if ray.is_initialized():
        return None
    if c.address == "local":
        private = PrivateRay(c.namespace, os.cpu_count() or 1)
        try:
            private.start()
        except PrivateRayError as exc:
            raise ClusterError(str(exc)) from None
        return private.stop
    try:
        ray.init(address=c.address, namespace=c.namespace, **INIT_OPTIONS)
    except Exception as exc:  # ConnectionError, ValueError...: one line for the user
        raise ClusterError(f"cannot join the Ray cluster at {c.address}: {exc}") from None
    return ray.shutdown


def actor_options(opts: ServerOptions, c: ClusterOptions) -> dict[str, Any]:
    gpus = c.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if "cuda" in (opts.devices or opts.device) else 0.0
    if gpus < 0 or c.cpus_per_replica < 0:
        raise ClusterError("--gpus-per-replica and --cpus-per-replica cannot be negative")
    return {
        "num_cpus": c.cpus_per_replica,
        "num_gpus": gpus,
        "max_restarts": c.max_restarts,
        "max_task_retries": 0,  # a step is never run twice: a lost one is replayed by its client
    }


def replica_spec(opts: ServerOptions, c: ClusterOptions, max_context: int) -> ReplicaSpec:
    """The replica's load recipe. With G GPUs per replica Ray shows it cuda:0..G-1, so a CUDA
    trunk spans them as stages unless ``--devices`` says otherwise."""
    gpus = actor_options(opts, c)["num_gpus"]
    devices = opts.devices
    if devices is None and gpus > 1:
        devices = ",".join(f"cuda:{i}" for i in range(int(gpus)))
    return ReplicaSpec(
        model=opts.model,
        min_local_layers=opts.min_local_layers,
        device="cuda" if gpus > 0 and opts.device == "cpu" else opts.device,
        devices=devices,
        stage_layers=opts.stage_layers,
        dtype=opts.dtype,
        max_context=max_context,
        max_batch_rows=opts.max_batch_rows,
        prefill_chunk=opts.prefill_chunk,
        batching=opts.batching,
        threads=c.threads,
        kernel_threads=c.kernel_threads,
        keyed_trunk=opts.keyed_trunk,
    )


class GatewayServer(TrunkServer):
    """The trunk server with its worker swapped for a router over Ray replicas."""

    def __init__(self, opts: ServerOptions, cluster: ClusterOptions, **kw: Any) -> None:
        self.cluster = cluster
        self._shutdown_ray: Callable[[], None] | None = None
        self._last_status = time.monotonic()
        super().__init__(opts, **kw)

    def _make_worker(self) -> Backend:
        self._shutdown_ray = connect_ray(self.cluster)
        try:
            self.router = ReplicaRouter(
                self.config,
                self.dtype,
                replica_spec(self.opts, self.cluster, self.max_context),
                self.cluster.replicas,
                actor_options(self.opts, self.cluster),
                self._done,
                self._lost,
                self.cluster.ready_timeout_s,
            )
            log.info(
                "starting %d trunk replica(s) of layers [%d, %d) of %s on Ray",
                self.cluster.replicas,
                self.lo,
                self.hi,
                self.model_name,
            )
            self.router.launch()
        except BaseException:
            if self._shutdown_ray is not None:
                self._shutdown_ray()
            raise
        return self.router

    # ------------------------------------------------------------------ placement

    def _loads(self, owner: str | None = None) -> list[Load]:
        """Each replica's open sessions and booked cache (of one client key with ``owner``)."""
        ready = self.router.ready()
        loads = [Load(i, up, 0, 0) for i, up in enumerate(ready)]
        with self.lock:
            sessions = [s for s in self.sessions.values() if not s.closed]
        sessions = [s for s in sessions if owner is None or s.client == owner]
        for s in sessions:
            r = self.router.replica_of(s.sid)
            if r is not None:
                loads[r].sessions += 1
                loads[r].cache_bytes += s.capacity * s.slot_bytes
        return loads

    def _admit(self, slot_bytes: int) -> str | None:
        index, why = choose_replica(
            self._loads(), INITIAL_CAPACITY * slot_bytes, self.opts.max_sessions, self.cache_cap
        )
        if index is None:
            return why
        self.router.bind_next(index)
        return None

    def _can_grow(self, s: Session, grow: int) -> bool:
        r = self.router.replica_of(s.sid)
        if r is None:
            return True  # lost meanwhile: its step answers unknown_session
        return self._loads()[r].cache_bytes + grow <= self.cache_cap

    def _lost(self, sids: list[str], why: str) -> None:
        """A replica's sessions are gone with it: forget them, so their steps and pings answer
        ``unknown_session`` and their clients replay onto another replica."""
        for sid in sids:
            with self.lock:
                s = self.sessions.get(sid)
            if s is not None and not s.closed:
                self._drop(s, "lost with its replica")

    # ------------------------------------------------------------------ statistics

    def public_stats(self, owner: str | None = None) -> dict[str, Any]:
        out = super().public_stats(owner)
        mb = [round(x.cache_bytes / (1 << 20), 2) for x in self._loads(owner)]
        out["replica_cache_mb"] = mb
        out["max_sessions_per_replica"] = self.opts.max_sessions
        out["max_cache_mb_per_replica"] = round(self.cache_cap / (1 << 20), 1)
        return out

    def _reap(self, now: float) -> None:
        super()._reap(now)
        if now - self._last_status >= STATUS_EVERY_S:
            self._last_status = now
            log.info("%s", status_line(self.public_stats()))

    def serve(self) -> None:
        try:
            super().serve()
        finally:
            if self._shutdown_ray is not None:
                self._shutdown_ray()


def status_line(st: dict[str, Any]) -> str:
    """One log line: every replica's state, sessions, booked cache and batching."""
    parts = []
    for i, state in enumerate(st.get("replica_state", [])):
        parts.append(
            f"#{i} {state} {st['replica_sessions'][i]} sess "
            f"{st.get('replica_cache_mb', [0.0] * (i + 1))[i]:.1f} MB "
            f"{st['replica_batches'][i]} batches (mean {st['replica_mean_batch_rows'][i]:g} rows)"
        )
    return f"replicas {st.get('replicas_up', 0)}/{st.get('replicas', 0)} up: " + "; ".join(parts)


__all__ = ["ClusterError", "ClusterOptions", "GatewayServer", "connect_ray", "status_line"]
