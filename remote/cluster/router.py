"""The gateway's router over trunk replicas: the worker interface of ``remote/server.py``
(``slot_bytes``, ``open``, ``close``, ``submit``, ``start``, ``stop``, ``stats``) spread over Ray
actors, so the socket thread — protocol checks, keys, ownership, limits — stays exactly as it is.

* **Sticky sessions.** The gateway picks a replica at ``open`` (``placement.py``) and says so
  with :meth:`ReplicaRouter.bind_next`; the session id is bound to that replica *and its
  incarnation*, and every later step and close goes there.
* **Deaths.** One :meth:`TrunkReplica.watch` call per replica stays pending; Ray fails it when
  the replica dies. Then every session bound to the replica is reported lost (the gateway drops
  it, so its steps and pings answer ``unknown_session``) and every step in flight there is
  answered ``unknown_session``: the client reopens — on another replica — and replays its
  journal, as after a server restart, and the text stays identical.
* **Coming back.** A down replica is probed with ``info()`` until Ray has restarted it (a new
  incarnation: its layers loaded again) and it answers; then the gateway connects to its new
  inbox and it takes sessions again. A replica Ray gave up on (``max_restarts`` spent, or killed
  for good) is replaced by a new actor.

Threads: the caller's (the gateway's socket thread: ``open``/``submit``/``close``/``stats``), the
*results* thread (reads every replica's answers), the *monitor* thread (deaths, probes, restarts;
the only thread that makes blocking Ray calls besides ``stats``), and Ray's own callback thread,
which only queues events for the monitor. Answers reach ``on_done`` one at a time.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch
import zmq

from engine import protocol as P
from engine.config import ModelConfig
from remote.cluster import wire
from remote.cluster.placement import (
    COUNTERS,
    SETTINGS,
    add_counts,
    mean_batch_rows,
    slot_bytes_for,
)
from remote.cluster.replica import ReplicaSpec
from remote.worker import Done, Job

log = logging.getLogger("veil.trunk.gateway")

LOST = "the trunk replica holding this session was lost; reopen and replay"
UP, STARTING, DOWN = "up", "starting", "down"


class ClusterError(Exception):
    """The replicas could not be started (one line for the user)."""


class _Replica:
    """The gateway's view of one replica (guarded by the router's lock)."""

    def __init__(self, index: int, handle: Any) -> None:
        self.index = index
        self.handle = handle
        self.state = STARTING
        self.incarnation = ""
        self.info: dict[str, Any] = {}
        self.out: zmq.Socket | None = None  # PUSH to its inbox; used under out_lock
        self.out_lock = threading.Lock()
        self.sids: set[str] = set()
        self.pending: dict[tuple[str, int], Job] = {}
        self.opened = 0  # sessions bound here, ever
        self.losses = 0  # times it died under the gateway
        self.last_stats: dict[str, Any] = {}
        self.retired: dict[str, Any] = {}  # counters of its earlier incarnations
        self.retired_owners: dict[str, dict[str, Any]] = {}  # ... per client key
        self.probing = False
        self.probe_at = 0.0
        self.down_since = time.monotonic()


class ReplicaRouter:
    """Routes one gateway's sessions over ``n`` Ray replica actors (see the module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        spec: ReplicaSpec,
        n: int,
        actor_options: dict[str, Any],
        on_done: Callable[[Done], None],
        lost: Callable[[list[str], str], None],
        ready_timeout_s: float = 600.0,
    ) -> None:
        if n < 1:
            raise ClusterError("--replicas must be at least 1")
        self.config = config
        self.dtype = dtype
        self.spec = spec
        self.n = n
        self.actor_options = actor_options
        self.on_done = on_done
        self.lost = lost
        self.ready_timeout_s = ready_timeout_s
        self.replicas: list[_Replica] = []
        self._lock = threading.Lock()
        self._deliver_lock = threading.Lock()
        self._bindings: dict[str, tuple[int, str]] = {}  # sid -> (replica, incarnation)
        self._owners: dict[str, str] = {}  # sid -> the client key it belongs to
        self._next: int | None = None
        self._events: collections.deque[tuple[str, _Replica, Any, Any]] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._stats_at = 0.0
        self.ctx = zmq.Context()
        pub, sec = zmq.curve_keypair()
        self.public_key, self._secret = pub.decode(), sec.decode()
        self.auth: Any = None
        self.results: zmq.Socket | None = None
        self.results_address = ""

    # ------------------------------------------------------------------ start-up

    def launch(self) -> None:
        """Start the replicas and wait until every one has loaded its layers (blocks)."""
        from zmq.auth.thread import ThreadAuthenticator

        from remote.cluster.actor import TrunkReplica

        self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("veil.trunk.gateway.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(domain=wire.ZAP_DOMAIN, credentials_provider=self)
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100000)
        sock.setsockopt(zmq.ZAP_DOMAIN, wire.ZAP_DOMAIN.encode())
        sock.curve_server = True
        sock.curve_secretkey = self._secret.encode()
        sock.curve_publickey = self.public_key.encode()
        sock.bind(f"tcp://{ray.util.get_node_ip_address()}:*")
        self.results = sock
        self.results_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._actor_class = TrunkReplica
        self.replicas = [_Replica(i, self._new_actor()) for i in range(self.n)]
        refs = [r.handle.info.remote() for r in self.replicas]
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            for r, ref in zip(self.replicas, refs, strict=True):
                try:
                    info = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.01))
                except ray.exceptions.GetTimeoutError:
                    raise ClusterError(
                        f"replica {r.index} did not start within {self.ready_timeout_s:g} s: does "
                        f"the Ray cluster have {self._wants()} free per replica? (`ray status`)"
                    ) from None
                except ray.exceptions.RayError as exc:
                    why = _cause(exc)
                    raise ClusterError(f"replica {r.index} failed to start: {why}") from None
                self._check(info)
                self._mark_up(r, info)
        except BaseException:
            self.stop()
            raise
        log.info("%d trunk replica(s) ready; results come back at %s", self.n, self.results_address)

    def _wants(self) -> str:
        o = self.actor_options
        return f"{o.get('num_gpus', 0):g} GPU(s) and {o.get('num_cpus', 1):g} CPU(s)"

    def _new_actor(self) -> Any:
        return self._actor_class.options(**self.actor_options).remote(  # type: ignore[attr-defined]
            self.spec,
            self.results_address,
            self.public_key,
            logging.getLogger("veil.trunk").getEffectiveLevel(),
        )

    def _check(self, info: dict[str, Any]) -> None:
        if info["config_fp"] != self.config.fingerprint():
            raise ClusterError(
                f"a replica on {info.get('node')} loaded {info.get('model')} with config "
                f"{info['config_fp']}, not the gateway's model: every node needs the same files"
            )

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP for the results socket: only this gateway's replicas may push answers."""
        try:
            z85 = zmq.utils.z85.encode(key).decode() if len(key) == 32 else key.decode()
        except Exception:
            return False
        with self._lock:
            return any(r.info.get("public_key") == z85 for r in self.replicas)

    def _mark_up(self, r: _Replica, info: dict[str, Any]) -> None:
        out = self.ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, 100000)
        out.curve_serverkey = info["public_key"].encode()
        out.curve_publickey = self.public_key.encode()
        out.curve_secretkey = self._secret.encode()
        out.connect(info["address"])
        inc = info["incarnation"]
        with self._lock:
            same = inc == r.incarnation  # it lived on (a lost watch call, not a death)
            r.info, r.incarnation, r.state, r.probing = info, inc, UP, False
        with r.out_lock:
            old, r.out = r.out, out
        if old is not None:
            old.close(0)
        if same:  # the gateway dropped its sessions: their caches must go too
            self._send(r, wire.reset_msg())
        fut = r.handle.watch.remote().future()
        fut.add_done_callback(lambda f, r=r, inc=inc: self._event("died", r, inc, f))
        log.info(
            "replica %d up: incarnation %s on %s (%s), pid %s",
            r.index,
            inc,
            info.get("node"),
            ",".join(info.get("devices", [])),
            info.get("pid"),
        )

    # ------------------------------------------------------------------ worker interface

    def slot_bytes(self, start: int, end: int) -> int:
        with self._lock:
            splits = [r.info["stages"] for r in self.replicas if r.info]
        return max(slot_bytes_for(self.config, self.dtype, s, start, end) for s in splits)

    def bind_next(self, index: int) -> None:
        """The replica the next :meth:`open` binds its session to (the gateway's choice)."""
        self._next = index

    def replica_of(self, sid: str) -> int | None:
        with self._lock:
            b = self._bindings.get(sid)
        return None if b is None else b[0]

    def ready(self) -> list[bool]:
        with self._lock:
            return [r.state == UP for r in self.replicas]

    def open(self, sid: str, start: int, end: int, capacity: int, owner: str = "") -> None:
        index, self._next = self._next, None
        if index is None:
            raise RuntimeError("open() without bind_next()")
        r = self.replicas[index]
        with self._lock:
            self._bindings[sid] = (index, r.incarnation)
            self._owners[sid] = owner
            r.sids.add(sid)
            r.opened += 1
            up = r.state == UP
        # A replica that died since the choice gets nothing: the first step answers
        # unknown_session and the client replays elsewhere.
        if up:
            self._send(r, wire.open_msg(sid, start, end, capacity, owner))

    def close(self, sid: str) -> None:
        with self._lock:
            b = self._bindings.pop(sid, None)
            self._owners.pop(sid, None)
            if b is None:
                return
            r = self.replicas[b[0]]
            r.sids.discard(sid)
            live = r.state == UP and r.incarnation == b[1]
        if live:
            self._send(r, wire.close_msg(sid))

    def submit(self, job: Job) -> None:
        with self._lock:
            b = self._bindings.get(job.sid)
            r = self.replicas[b[0]] if b is not None else None
            live = r is not None and b is not None and r.state == UP and r.incarnation == b[1]
            if live:
                assert r is not None
                r.pending[(job.sid, job.step)] = job
        if not live or r is None:
            self._lose([job.sid], LOST, [job])
            return
        frames = wire.step_msg(
            job.sid,
            job.step,
            job.positions,
            job.parents,
            job.keep,
            job.hidden,
            job.want,
            job.out_dtype,
        )
        if not self._send(r, frames):
            with self._lock:
                r.pending.pop((job.sid, job.step), None)
            self._lose([job.sid], LOST, [job])

    def _send(self, r: _Replica, frames: wire.Frames) -> bool:
        with r.out_lock:
            if r.out is None:
                return False
            try:
                r.out.send_multipart(frames, zmq.NOBLOCK, copy=False)
                return True
            except zmq.ZMQError as exc:
                log.warning("replica %d cannot take messages: %s", r.index, exc)
                return False

    def start(self) -> None:
        if self._threads:
            return
        for target, name in ((self._read_results, "results"), (self._monitor, "monitor")):
            t = threading.Thread(target=target, name=f"veil-gateway-{name}", daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        with self._wake:
            self._wake.notify_all()
        for t in self._threads:
            t.join(timeout)
        self._threads = []
        for r in self.replicas:
            with contextlib.suppress(Exception):
                ray.kill(r.handle, no_restart=True)
            with r.out_lock:
                if r.out is not None:
                    r.out.close(0)
                    r.out = None
        if self.results is not None:
            self.results.close(0)
            self.results = None
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if not self.ctx.closed:
            self.ctx.destroy(0)

    def stats(self, owner: str | None = None) -> dict[str, Any]:
        """The replicas' workers merged (settings of the first, counters summed over every
        replica and incarnation), plus one list entry per replica; with ``owner``, the counters
        and sessions are that client key's own (the replicas' states are everyone's)."""
        self._refresh_stats()
        out: dict[str, Any] = {}
        with self._lock:
            reps = list(self.replicas)
            for r in reps:
                if r.last_stats and not out:
                    out.update({k: r.last_stats[k] for k in SETTINGS if k in r.last_stats})
            merged: dict[str, Any] = {} if owner is None else dict.fromkeys(COUNTERS, 0)
            per: list[dict[str, Any]] = []
            for r in reps:
                mine: dict[str, Any] = {}
                if owner is None:
                    add_counts(mine, r.retired)
                    add_counts(mine, r.last_stats)
                else:
                    add_counts(mine, r.retired_owners.get(owner, {}))
                    add_counts(mine, r.last_stats.get("owners", {}).get(owner, {}))
                add_counts(merged, mine)
                per.append(mine)
            sids = [r.sids for r in reps]
            opened = [r.opened for r in reps]
            if owner is not None:
                sids = [{s for s in x if self._owners.get(s) == owner} for x in sids]
                opened = [int(p.get("opened", 0)) for p in per]
            out.update(merged)
            out.update(
                {
                    "replicas": len(reps),
                    "replicas_up": sum(r.state == UP for r in reps),
                    "replica_state": [r.state for r in reps],
                    "replica_node": [str(r.info.get("node", "")) for r in reps],
                    "replica_sessions": [len(x) for x in sids],
                    "replica_opened": opened,
                    "replica_lost": [r.losses for r in reps],
                    "replica_steps": [int(p.get("steps", 0)) for p in per],
                    "replica_batches": [int(p.get("batches", 0)) for p in per],
                    "replica_mean_batch_rows": [mean_batch_rows(p) for p in per],
                }
            )
        return out

    def _refresh_stats(self) -> None:
        """Fresh counters from every ready replica (a Ray call each, at most every 100 ms, so
        a client's stats pings cannot keep the socket thread waiting)."""
        now = time.monotonic()
        if now - self._stats_at < 0.1:
            return
        self._stats_at = now
        with self._lock:
            ups = [(r, r.incarnation) for r in self.replicas if r.state == UP]
        refs = [r.handle.stats.remote() for r, _ in ups]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0) if refs else ([], [])
        done = set(ready)
        for (r, inc), ref in zip(ups, refs, strict=True):
            if ref not in done:
                continue
            try:
                st = ray.get(ref, timeout=0)
            except ray.exceptions.RayError:
                continue
            with self._lock:
                if r.incarnation == inc and st.get("incarnation") == inc:
                    r.last_stats = st

    # ------------------------------------------------------------------ answers

    def _deliver(self, answers: Sequence[Done]) -> None:
        with self._deliver_lock:
            for d in answers:
                try:
                    self.on_done(d)
                except Exception:
                    log.exception("on_done failed")

    def _lose(self, sids: list[str], why: str, jobs: Sequence[Job] = ()) -> None:
        """Sessions whose caches are gone: unbind, tell the gateway, answer their steps."""
        with self._lock:
            for sid in sids:
                self._owners.pop(sid, None)
                b = self._bindings.pop(sid, None)
                if b is not None:
                    self.replicas[b[0]].sids.discard(sid)
        self.lost(sids, why)
        now = time.perf_counter()
        self._deliver(
            [
                Done(j, None, 0.0, (now - j.accepted) * 1000.0, 0, (P.E_UNKNOWN_SESSION, why))
                for j in jobs
            ]
        )

    def _read_results(self) -> None:
        assert self.results is not None
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(200):
                continue
            for _ in range(256):
                try:
                    frames = self.results.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._on_result(wire.parse(frames))
                except Exception:
                    log.exception("bad answer from a replica")

    def _on_result(self, msg: wire.Message) -> None:
        h = msg.header
        key = (h["sid"], int(h["step"]))
        with self._lock:
            job = None
            for r in self.replicas:
                if r.incarnation == h["inc"] and r.state == UP:
                    job = r.pending.pop(key, None)
                    break
        if job is None:
            return  # from a replica since declared lost: its step was answered then
        server_ms = float(h["ms"])
        total_ms = (time.perf_counter() - job.accepted) * 1000.0
        err = h.get("err")
        error = (str(err[0]), str(err[1])) if err else None
        load = wire.parse_load(h.get("load"))
        wait_ms = max(total_ms - server_ms, 0.0)
        done = Done(job, msg.tensor, server_ms, wait_ms, h["rows"], error, load)
        if error is not None and error[0] == P.E_UNKNOWN_SESSION:
            # the replica does not have it (it could not allocate the cache): start afresh
            self._lose([job.sid], LOST, [job])
            return
        self._deliver([done])

    # ------------------------------------------------------------------ monitor

    def _event(self, kind: str, r: _Replica, tag: Any, fut: Any) -> None:
        """Ray's callback thread: queue for the monitor (no Ray calls from here)."""
        with self._wake:
            self._events.append((kind, r, tag, fut))
            self._wake.notify_all()

    def _monitor(self) -> None:
        while not self._stopping.is_set():
            with self._wake:
                if not self._events:
                    self._wake.wait(0.25)
                events = list(self._events)
                self._events.clear()
            if self._stopping.is_set():
                return
            for kind, r, tag, fut in events:
                try:
                    if kind == "died":
                        self._died(r, tag, fut)
                    elif kind == "probe":
                        self._probed(r, tag, fut)
                except Exception:
                    log.exception("replica monitor")
            now = time.monotonic()
            with self._lock:
                due = [r for r in self.replicas if r.state != UP and not r.probing]
                due = [r for r in due if r.probe_at <= now]
                for r in due:
                    r.probing = True
            for r in due:
                handle = r.handle
                fut = handle.info.remote().future()
                fut.add_done_callback(lambda f, r=r, h=handle: self._event("probe", r, h, f))

    def _died(self, r: _Replica, inc: str, fut: Any) -> None:
        if self._stopping.is_set():
            return
        exc = fut.exception()
        with self._lock:
            if r.state != UP or r.incarnation != inc:
                return
            r.state, r.losses, r.down_since = DOWN, r.losses + 1, time.monotonic()
            r.probe_at = time.monotonic() + 0.2
            sids = sorted(r.sids)
            jobs = list(r.pending.values())
            r.pending = {}
            add_counts(r.retired, r.last_stats)
            for owner, counts in r.last_stats.get("owners", {}).items():
                add_counts(r.retired_owners.setdefault(owner, {}), counts)
            r.last_stats = {}
        with r.out_lock:
            if r.out is not None:
                r.out.close(0)
                r.out = None
        log.warning(
            "replica %d lost (%s): %d session(s) and %d step(s) in flight go back to their "
            "clients, which replay onto other replicas",
            r.index,
            type(exc).__name__ if exc is not None else "watch ended",
            len(sids),
            len(jobs),
        )
        self._lose(sids, LOST, jobs)

    def _probed(self, r: _Replica, handle: Any, fut: Any) -> None:
        exc = fut.exception()
        with self._lock:
            r.probing = False
            if r.handle is not handle or r.state == UP:
                return
        if exc is None:
            info = fut.result()
            try:
                self._check(info)
            except ClusterError as e:
                log.error("replica %d: %s", r.index, e)
                with self._lock:
                    r.probe_at = time.monotonic() + 10.0
                return
            self._mark_up(r, info)
            return
        if isinstance(exc, ray.exceptions.ActorDiedError):
            # Ray gave up on it (max_restarts spent, or killed for good): start a new actor
            log.warning("replica %d is gone for good (%s); starting a new one", r.index, exc)
            with self._lock:
                r.handle = self._new_actor()
                r.state = STARTING
        with self._lock:
            r.probe_at = time.monotonic() + 0.5


def _cause(exc: BaseException) -> str:
    """The first useful line of a Ray error (a constructor's exception, usually)."""
    text = str(exc).strip().splitlines()
    lines = [ln.strip() for ln in text if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else type(exc).__name__
