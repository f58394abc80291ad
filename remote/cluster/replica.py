"""What runs inside one trunk replica: the trunk layers, read once, and a :class:`TrunkWorker`.

The replica knows nothing about clients, keys or ownership — the gateway checked all of that. It
takes ``open``/``close``/``step`` messages from its inbox (``wire.py``) in the order the gateway
sent them, hands steps to the batching worker (the same one the single-process server runs), and
pushes each answer back to the gateway, tagged with its *incarnation* (a fresh random id per
process, so the gateway can tell a restarted replica — which has no sessions — from the old one).

No Ray here: ``actor.py`` wraps this class in a Ray actor; tests may run it in a thread.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from engine import protocol as P
from engine.loading import WeightReader, load_config, resolve
from remote.cluster import wire
from remote.stages import load_stages, parse_devices, split_layers
from remote.worker import Done, Job, TrunkWorker, WorkerOptions

log = logging.getLogger("veil.trunk.replica")


@dataclass
class ReplicaSpec:
    """Everything a replica needs to load its trunk (plain data: it travels through Ray)."""

    model: str
    min_local_layers: int = 1
    device: str = "cpu"
    devices: str | None = None  # stages inside the replica, e.g. cuda:0,cuda:1
    stage_layers: list[int] | None = None
    dtype: str = "float32"
    max_context: int | None = None
    max_batch_rows: int = 256
    prefill_chunk: int | None = None  # None: by device (remote/worker.py)
    batching: bool = True
    threads: int = 0  # torch threads (0: Ray's OMP_NUM_THREADS, i.e. the replica's CPUs)
    kernel_threads: int = 0
    keyed_trunk: str | None = None  # a keyed trunk folder (checked by the gateway) on this machine


class ReplicaCore:
    """Loads the trunk, binds the inbox and serves until :meth:`stop`."""

    def __init__(self, spec: ReplicaSpec, host: str, gateway_address: str, gateway_key: str):
        from engine.session import parse_dtype

        if spec.threads:
            torch.set_num_threads(spec.threads)
        if spec.kernel_threads:
            from engine import kernels

            kernels.set_threads(spec.kernel_threads)
        self.spec = spec
        self.incarnation = secrets.token_hex(8)
        resolved = resolve(spec.model)
        self.model_name = resolved.name
        self.config = load_config(resolved.folder)
        n, m = self.config.n_layers, spec.min_local_layers
        self.lo, self.hi = m, n - m
        reader = WeightReader(resolved.folder)
        if spec.keyed_trunk is not None:  # the gateway checked it; the same layers here
            from engine.keyed.trunk import read_info

            info = read_info(Path(spec.keyed_trunk))
            self.lo, self.hi = max(self.lo, info.start), min(self.hi, info.end)
            reader = WeightReader(Path(spec.keyed_trunk))
        self.dtype = parse_dtype(spec.dtype)
        plan = split_layers(
            self.lo, self.hi, parse_devices(spec.devices or spec.device), spec.stage_layers
        )
        stages = load_stages(reader, self.config, plan, self.dtype)
        self.stage_ranges = [(s.lo, s.hi) for s in stages]
        self.devices = [str(s.device) for s in stages]
        self.worker = TrunkWorker(
            self.config,
            stages,
            self.dtype,
            WorkerOptions(
                max_batch_rows=spec.max_batch_rows,
                prefill_chunk=spec.prefill_chunk,
                batching=spec.batching,
                max_context=spec.max_context,
            ),
            self._on_done,
        )
        self.gateway_address = gateway_address
        self.gateway_key = gateway_key
        pub, sec = zmq.curve_keypair()
        self.public_key, self._secret = pub.decode(), sec.decode()
        self.ctx = zmq.Context()
        from zmq.auth.thread import ThreadAuthenticator

        self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("veil.trunk.replica.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(domain=wire.ZAP_DOMAIN, credentials_provider=self)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.RCVHWM, 10000)
        self.inbox.setsockopt(zmq.ZAP_DOMAIN, wire.ZAP_DOMAIN.encode())
        self.inbox.curve_server = True
        self.inbox.curve_secretkey = self._secret.encode()
        self.inbox.curve_publickey = self.public_key.encode()
        self.inbox.bind(f"tcp://{host}:*")
        self.address = self.inbox.getsockopt_string(zmq.LAST_ENDPOINT)
        self._out: zmq.Socket | None = None  # the worker thread's PUSH to the gateway
        self._stop = threading.Event()
        self.open_sids: set[str] = set()  # the inbox thread's view (for stats)
        self.worker.start()
        self._thread = threading.Thread(target=self._relay, name="veil-replica-inbox", daemon=True)
        self._thread.start()
        log.info(
            "replica %s ready: layers [%d, %d) of %s on %s, inbox %s",
            self.incarnation,
            self.lo,
            self.hi,
            self.model_name,
            ",".join(self.devices),
            self.address,
        )

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: only the gateway may connect to the inbox."""
        try:
            z85 = zmq.utils.z85.encode(key).decode() if len(key) == 32 else key.decode()
        except Exception:
            return False
        return z85 == self.gateway_key

    def info(self) -> dict[str, Any]:
        """Who this replica is and where its inbox is (the gateway connects there)."""
        return {
            "incarnation": self.incarnation,
            "address": self.address,
            "public_key": self.public_key,
            "model": self.model_name,
            "config_fp": self.config.fingerprint(),
            "layers": [self.lo, self.hi],
            "stages": [list(r) for r in self.stage_ranges],
            "devices": self.devices,
        }

    def stats(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "open": len(self.open_sids),
            **self.worker.stats(),
            "owners": self.worker.counters.keys(),  # each client key's own counters
        }

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.worker.stop()
        self.auth.stop()
        if self._out is not None:
            self._out.close(0)
            self._out = None
        # never leave the context to the garbage collector: its __del__ would wait for sockets
        self.ctx.destroy(0)

    # ------------------------------------------------------------------ inbox thread

    def _relay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(200):
                    continue
                jobs: list[Job] = []
                for _ in range(256):  # drain: steps that arrived together start together
                    try:
                        frames = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        msg = wire.parse(frames)
                        self._handle(msg, jobs)
                    except Exception:
                        log.exception("bad message from the gateway")
                if jobs:
                    self.worker.submit_many(jobs)
        finally:
            self.inbox.close(0)

    def _handle(self, msg: wire.Message, jobs: list[Job]) -> None:
        h = msg.header
        sid = h["sid"]
        if msg.kind == wire.STEP:
            assert msg.tensor is not None
            jobs.append(
                Job(
                    sid,
                    int(h["step"]),
                    list(h["pos"]),
                    h["par"],
                    h["keep"],
                    msg.tensor,
                    bool(h["want"]),
                    P.WIRE_DTYPES[h["out"]],
                )
            )
            return
        if jobs:  # keep the gateway's order: steps before an open/close are queued first
            self.worker.submit_many(jobs)
            jobs.clear()
        if msg.kind == wire.OPEN:
            try:
                owner = str(h.get("own", ""))
                self.worker.open(sid, int(h["start"]), int(h["end"]), int(h["cap"]), owner)
                self.open_sids.add(sid)
            except Exception:  # e.g. out of device memory: its steps answer unknown_session
                log.exception("session %s could not open", sid[:8])
        elif msg.kind == wire.CLOSE:
            self.worker.close(sid)
            self.open_sids.discard(sid)
        elif msg.kind == wire.RESET:
            for s in sorted(self.open_sids):
                self.worker.close(s)
            log.info("replica %s: %d session(s) forgotten", self.incarnation, len(self.open_sids))
            self.open_sids.clear()

    # ------------------------------------------------------------------ worker thread

    def _on_done(self, d: Done) -> None:
        if self._out is None:
            out = self.ctx.socket(zmq.PUSH)
            out.setsockopt(zmq.LINGER, 0)
            out.setsockopt(zmq.SNDHWM, 10000)
            out.curve_serverkey = self.gateway_key.encode()
            out.curve_publickey = self.public_key.encode()
            out.curve_secretkey = self._secret.encode()
            out.connect(self.gateway_address)
            self._out = out
        frames = wire.done_msg(
            self.incarnation,
            d.job.sid,
            d.job.step,
            d.hidden,
            d.server_ms,
            d.batch_rows,
            d.error,
            d.load,
        )
        self._out.send_multipart(frames, copy=False)
