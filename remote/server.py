"""The trunk server: a ZeroMQ ROUTER that serves decoder layers [M, L - M) of one model.

Threads:

* the *socket thread* (:meth:`TrunkServer.serve`) owns the ROUTER socket. It decodes and
  validates every message, answers pings, opens/closes sessions, checks ownership and step
  order, reaps idle sessions, and hands steps to the worker. It never runs tensor math, so
  heartbeats and other clients stay responsive while a long block is computed. Who may talk
  (revocation) is ``remote.gate``.
* the *worker* (:class:`remote.worker.TrunkWorker`, socket-free) owns the sessions' KV caches
  and runs queued steps in batches on its own thread; its answers come back through
  :meth:`TrunkServer._done`, which sends the reply frames to the socket thread over an inproc
  PAIR socket (ZeroMQ sockets are single-threaded).

Weights for [M, L - M) are read once (split into stages when there are several devices); each
session gets caches over the sub-range it asked for, sharing the weight tensors.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import zmq

from engine import protocol as P
from engine.config import ModelConfig
from engine.keyed.trunk import KeyedInfo
from engine.loading import WeightReader, load_config, model_label, resolve, weights_fingerprint
from engine.model import layer_tensor_names
from engine.quant.load import client_reader, fallback_summary, gguf_weights_of, resolve_quant
from remote.delivery import DeliveryService, make_delivery
from remote.gate import ZAP_DOMAIN, ConnectionGate, ZapHandler
from remote.limits import ClientLimits, with_admin
from remote.netguard import HANDSHAKE_S, ConnectionGuard
from remote.stages import Stage, load_stages, parse_devices, split_layers
from remote.worker import Done, Job, TrunkWorker, WorkerOptions

log = logging.getLogger("veil.trunk")

INITIAL_CAPACITY = 64
MAX_IN_FLIGHT = 4  # accepted-but-unanswered steps one session may have queued


class Backend(Protocol):
    """What the socket thread needs from the compute behind it: :class:`TrunkWorker` in one
    process, or the Ray gateway's router over replicas (``remote/cluster/router.py``)."""

    def slot_bytes(self, start: int, end: int) -> int: ...
    def open(self, sid: str, start: int, end: int, capacity: int, owner: str = "") -> None: ...
    def close(self, sid: str) -> None: ...
    def submit(self, job: Job) -> None: ...
    def start(self) -> None: ...
    def stop(self, timeout: float = 5.0) -> None: ...
    def stats(self, owner: str | None = None) -> dict[str, Any]: ...


@dataclass
class ServerOptions:
    model: str
    bind: str = "tcp://127.0.0.1:5757"
    min_local_layers: int = 1
    max_sessions: int = 8
    max_sessions_per_client: int = 2  # per CURVE key (per connection when insecure)
    session_ttl_s: float = 600.0
    max_cache_gb: float = 4.0
    device: str = "cpu"
    dtype: str = "float32"
    insecure: bool = False
    max_context: int | None = None  # None: the model's max_position_embeddings
    devices: str | None = None  # "cuda:0,cuda:1": layers split into stages (None: `device`)
    stage_layers: list[int] | None = None  # layers per stage (None: by free memory)
    max_batch_rows: int = 256
    prefill_chunk: int | None = None  # None: 256 rows on a GPU, 32 on a CPU
    batching: bool = True
    quant: str = "auto"  # trunk matrices on CPU: auto (GGUF kept quantized), none, int8, int4
    silent_s: float = 10.0  # a session with steps in flight whose client said nothing this long
    # model delivery (remote/delivery.py): ship the client part to clients that ask for it
    delivery: bool = False
    client_layers: int | None = None  # the most local layers per side shipped (None: max(M, 2))
    client_part: str | None = None  # a prepared part folder to ship instead of making one
    parts_dir: str | None = None  # where parts are made (None: the user cache)
    draft_head: str | None = None  # the draft head file to ship (None: the model's own, if any)
    part_chunk: int = P.MAX_CHUNK  # bytes per chunk of the part's files
    # a folder from `veil-trunk keyed-model prepare`: the trunk layers run from it, in an
    # organisation key's secret basis (the config, tokenizer and client part stay public)
    keyed_trunk: str | None = None


@dataclass
class Session:
    sid: str
    owner: bytes  # routing id of the connection that last spoke for it: where replies go
    user: str  # CURVE public key that opened it, and owns it ("" when insecure)
    dtype: str  # wire dtype
    max_context: int
    client: str = ""  # whose limits and turns it counts in: the key (the connection if insecure)
    last_step: int = -1  # last step accepted (queued or done)
    in_flight: int = 0  # steps queued or running
    reply: list[Any] = field(default_factory=list)  # cached reply frames of last_step
    last_used: float = field(default_factory=time.monotonic)
    last_heard: float = field(default_factory=time.monotonic)  # any message about it (pings too)
    queued_rows: int = 0  # rows of its steps queued or running
    closed: bool = False
    # The cache as it will be once every accepted step has run — known at accept time, so
    # keep, context and memory checks answer at once, and the worker never refuses a step.
    prev_block: int = 0  # nodes in the last accepted block
    length: int = 0  # cached tokens
    block_start: int = 0  # first slot of the last accepted block
    capacity: int = INITIAL_CAPACITY  # slots allocated
    slot_bytes: int = 0  # KV bytes per slot


def _is_loopback(bind: str) -> bool:
    host = bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


class TrunkServer:
    """Loads the trunk weights and serves sessions until :meth:`stop`."""

    def __init__(
        self,
        opts: ServerOptions,
        *,
        secret_key: bytes | None = None,
        public_key: bytes | None = None,
        allowed: Callable[[str], bool] | None = None,
        progress: Callable[[str, float], None] | None = None,
        signing_key: bytes | None = None,
    ) -> None:
        if opts.insecure and not _is_loopback(opts.bind):
            raise ValueError("--insecure (plain TCP) is only allowed on a loopback address")
        if not opts.insecure and (secret_key is None or public_key is None):
            raise ValueError("a server keypair is needed (run `veil-trunk keygen`)")
        self.opts = opts
        self.secret_key = secret_key
        self.public_key = public_key
        # The server's own keypair is the admin's: whoever holds its secret may connect with it
        # (`veil-trunk status --client-keys KEYS_DIR`) and sees every statistic.
        self.admin = public_key.decode() if public_key is not None else None
        self.allowed = with_admin(allowed, self.admin)
        from engine.session import parse_dtype

        self.dtype = parse_dtype(opts.dtype, opts.device)
        self.device = torch.device(opts.device)
        resolved = resolve(opts.model, progress)
        self.resolved = resolved
        self.model_name = resolved.name  # as given (a path): for this machine's logs only
        self.model_label = model_label(resolved)  # what clients are told
        self.config: ModelConfig = load_config(resolved.folder)
        n = self.config.n_layers
        m = opts.min_local_layers
        if m < 1 or 2 * m >= n:
            raise ValueError(f"--min-local-layers must be between 1 and {(n - 1) // 2}, got {m}")
        self.lo, self.hi = m, n - m
        self.reader = WeightReader(resolved.folder)
        self.keyed: KeyedInfo | None = None
        self.key_id: str | None = None  # the organisation key id of a keyed trunk
        if opts.keyed_trunk is not None:
            self.keyed = self._check_keyed(opts, progress)
            self.key_id = self.keyed.key_id
        self.config_fp = self.config.fingerprint()
        self._weights_fp: dict[tuple[int, int], str] = {}
        self.max_context = opts.max_context or self.config.max_position_embeddings
        self.cache_cap = int(opts.max_cache_gb * (1 << 30))
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.worker: Backend = self._make_worker()
        self._out: zmq.Socket | None = None  # the worker thread's end of the reply PAIR
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        self.address = ""
        self.ready = threading.Event()
        self.zap: ZapHandler | None = None  # the handshake's allow-list check (CURVE)
        self.guard: ConnectionGuard | None = None  # handshakes and unfinished messages
        self.stats = {"steps": 0, "errors": 0, "opened": 0}
        self.gate = ConnectionGate(self.allowed, opts.insecure)  # socket thread: the allow-list
        self.limits = ClientLimits(self.config.hidden_size, opts.max_sessions_per_client)
        self.delivery: DeliveryService | None = None
        if opts.delivery:
            self.delivery = make_delivery(self, signing_key)

    def _check_keyed(
        self, opts: ServerOptions, progress: Callable[[str, float], None] | None
    ) -> KeyedInfo:
        """The keyed trunk folder, checked against the public model; narrows [lo, hi) to it."""
        from engine.keyed.trunk import check_keyed_trunk, public_model_fp

        if progress is not None:
            progress("checking the keyed trunk", 0.0)
        info = check_keyed_trunk(
            Path(str(opts.keyed_trunk)), self.config, public_model_fp(self.reader)
        )
        if progress is not None:
            progress("checking the keyed trunk", 1.0)
        lo, hi = max(self.lo, info.start), min(self.hi, info.end)
        if lo >= hi:
            raise ValueError(
                f"the keyed trunk holds layers [{info.start}, {info.end}), none of which "
                f"--min-local-layers {opts.min_local_layers} leaves to the server"
            )
        self.lo, self.hi = lo, hi
        log.info("keyed trunk: layers [%d, %d) keyed to organisation key %s", lo, hi, info.key_id)
        return info

    def _make_worker(self) -> Backend:
        """What computes the steps: the trunk layers, read once, and a batching worker over them.
        (The Ray gateway, ``remote/cluster/gateway.py``, returns a router over replicas.)"""
        opts = self.opts
        devices = parse_devices(opts.devices or opts.device)
        plan = split_layers(self.lo, self.hi, devices, opts.stage_layers)
        log.info("loading layers [%d, %d) of %s", self.lo, self.hi, self.model_name)
        cpu_only = all(d.type == "cpu" for d, _, _ in plan)
        quant = resolve_quant(opts.quant, self.resolved) if cpu_only else "none"
        if opts.keyed_trunk is not None:  # float layers in the organisation's basis
            # auto: float (there are no quantized blocks of keyed weights); int8/int4 on a CPU
            # quantize them at load, not cached (the quant cache is the public model's)
            quant = opts.quant if cpu_only and opts.quant in ("int8", "int4") else "none"
            reader: Any = WeightReader(Path(opts.keyed_trunk))
            if quant != "none":
                from engine.quant.load import QuantizingReader

                reader = QuantizingReader(reader, quant, None)
        else:
            reader = client_reader(self.reader, self.resolved, self.config, quant)
        gguf = gguf_weights_of(reader)
        before = len(gguf.fallbacks) if gguf is not None else 0
        self.stages: list[Stage] = load_stages(reader, self.config, plan, self.dtype)
        self.weight_bytes = sum(w.nbytes() for st in self.stages for w in st.layers.values())
        if gguf is not None and len(gguf.fallbacks) > before:
            if not cpu_only:
                cause = "the quantized kernels run on CPUs only"
            elif quant == "none":
                cause = "--quant none (the default, --quant auto, keeps them quantized)"
            else:
                cause = "no CPU kernel for these formats"
            log.warning(fallback_summary(gguf.fallbacks[before:], self.dtype, cause))
        held = "kept quantized" if quant != "none" else str(self.dtype).removeprefix("torch.")
        log.info(
            "trunk weights: %.2f GiB in memory for layers [%d, %d) (%s)",
            self.weight_bytes / (1 << 30),
            self.lo,
            self.hi,
            held,
        )
        return TrunkWorker(
            self.config,
            self.stages,
            self.dtype,
            WorkerOptions(
                max_batch_rows=opts.max_batch_rows,
                prefill_chunk=opts.prefill_chunk,
                batching=opts.batching,
                max_context=self.max_context,
            ),
            self._done,
        )

    # ------------------------------------------------------------------ helpers

    def weights_fp(self, start: int, end: int) -> str:
        key = (start, end)
        if key not in self._weights_fp:
            names = [n for i in range(start, end) for n in layer_tensor_names(self.config, i)]
            self._weights_fp[key] = weights_fingerprint(self.reader, names)
        return self._weights_fp[key]

    def cache_bytes(self) -> int:
        """KV-cache bytes of all sessions once their accepted steps have run."""
        with self.lock:
            return sum(s.capacity * s.slot_bytes for s in self.sessions.values())

    def stop(self) -> None:
        self._stop.set()

    def public_stats(self, owner: str | None = None) -> dict[str, Any]:
        """The model and layers served, the batching settings, and the counters: of the whole
        server (the admin's view), or with ``owner`` of that client key alone — its open
        sessions, its steps, the batches its work ran in and its own rows in each."""
        with self.lock:
            live = [s for s in self.sessions.values() if not s.closed]
            n = len([s for s in live if owner is None or s.client == owner])
        return {
            "model": self.model_label,
            "config_fp": self.config_fp,
            "hidden_size": self.config.hidden_size,
            "n_layers": self.config.n_layers,
            "layers": [self.lo, self.hi],
            "key_id": self.key_id or "",  # a keyed model's organisation key id ("": public)
            "max_context": self.max_context,
            "dtype": str(self.dtype).removeprefix("torch."),
            "sessions": n,
            "scope": "all" if owner is None else "own",  # every user's counters, or the key's
            **self.worker.stats(owner),
        }

    def stats_for(self, user: str) -> dict[str, Any]:
        """What a ``stats`` ping from the key ``user`` gets: everything for the admin (the
        server's own key; any client of an ``--insecure`` server, which knows no keys), else
        that key's own counters only — never anything about other users' work."""
        if self.opts.insecure or user == self.admin:
            return self.public_stats()
        return self.public_stats(user)

    # ------------------------------------------------------------------ socket thread

    def _setup_socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # No handover: a routing id names one connection for its whole life, so no other
        # connection can take over where a reply goes. (Clients leave the id to the server; a
        # reconnected client is found again by its key and session, see `_owned`.)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        # the largest valid message: a header and one [4096, H] float32 tensor (per frame for
        # libzmq; the guard bounds the whole message)
        max_message = P.MAX_BLOCK * self.config.hidden_size * 4 + P.MAX_HEADER_BYTES
        sock.setsockopt(zmq.MAXMSGSIZE, max_message)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.RCVHWM, 1000)
        if not self.opts.insecure:
            self.zap = ZapHandler(self.ctx, self.allowed)
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
            sock.curve_server = True
            sock.curve_secretkey = self.secret_key
            sock.curve_publickey = self.public_key
        mechanism = "NULL" if self.opts.insecure else "CURVE"
        self.guard = ConnectionGuard(self.ctx, sock, max_message, 1 + P.MAX_FRAMES, mechanism)
        sock.bind(self.opts.bind)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock

    def serve(self) -> None:
        """Run until :meth:`stop` (call from the main thread; blocks)."""
        sock = self._setup_socket()
        guard = self.guard
        assert guard is not None
        back = self.ctx.socket(zmq.PAIR)
        back.bind(f"inproc://veil-worker-{id(self)}")
        self.worker.start()
        poller = zmq.Poller()
        for s in (sock, back, guard.monitor, guard.fileno, self.zap and self.zap.sock):
            if s is not None:
                poller.register(s, zmq.POLLIN)
        parts = self.delivery.bind(self.ctx) if self.delivery is not None else None
        if parts is not None:
            poller.register(parts, zmq.POLLIN)
        self.ready.set()
        last_reap = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(guard.timeout_ms(time.monotonic(), 200)))
                if back in events:
                    while True:
                        try:
                            frames = back.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._deliver(sock, frames)
                if parts is not None and parts in events:
                    self._forward_parts(sock, parts)
                if sock in events or guard.wants_drain:
                    self._read(sock, guard)
                if self.zap is not None:
                    self.zap.answer()
                now = time.monotonic()
                guard.run(now)
                if now - last_reap > 0.5:
                    self._reap(now)
                    last_reap = now
                    self.gate.refused.flush()
                    if self.zap is not None:
                        self.zap.refused.flush()
        finally:
            self.worker.stop()
            if self.delivery is not None:
                self.delivery.stop()
            if parts is not None:
                parts.close(0)
            if self._out is not None:
                self._out.close(0)
            back.close(0)
            guard.close()
            sock.close(0)
            self.gate.refused.flush(everything=True)
            if self.zap is not None:
                self.zap.refused.flush(everything=True)
                self.zap.close()
            self.ctx.term()
            log.info("stopped")

    def _read(self, sock: zmq.Socket, guard: ConnectionGuard) -> None:
        """Handle up to 64 waiting messages (received through the guard)."""
        for _ in range(64):
            got = guard.receive(sock, time.monotonic())
            if got is None:
                return
            frames, extra = got
            if not extra:
                self._handle(sock, frames)
            elif len(frames) > 1:  # more frames than any message has: never read into memory
                n = len(frames) - 1 + extra
                msg = f"a message has 1 or {P.MAX_FRAMES} frames, got {n}"
                self._error(sock, bytes(frames[0].bytes), P.E_BAD_MESSAGE, msg)

    def _send(self, sock: zmq.Socket, frames: list[Any]) -> None:
        try:
            sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:  # peer gone: nothing to do
            log.debug("reply dropped: %s", exc)

    def _reply(self, sock: zmq.Socket, ident: Any, msg: P.Message) -> None:
        self._send(sock, [ident, *P.encode(msg)])

    def _error(
        self,
        sock: zmq.Socket,
        ident: Any,
        code: str,
        message: str,
        session: str | None = None,
        step: int | None = None,
    ) -> None:
        self.stats["errors"] += 1
        log.debug("error %s: %s", code, message)
        self._reply(sock, ident, P.Error(code, message, session, step))

    def _forward_parts(self, sock: zmq.Socket, parts: zmq.Socket) -> None:
        """Send the delivery thread's chunk replies, unless the key was revoked meanwhile."""
        while True:
            try:
                frames = parts.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            user, out = DeliveryService.forward(frames)
            if self.gate.key_allowed(user):
                self._send(sock, out)

    def _deliver(self, sock: zmq.Socket, frames: list[Any]) -> None:
        """Push a worker reply ([session id, routing id when computed, *message]) to the
        connection that last spoke for the session, unless its key was revoked meanwhile (a
        reply that finds nobody stays cached for a retry of the step)."""
        sid = bytes(frames[0].bytes if isinstance(frames[0], zmq.Frame) else frames[0]).decode()
        with self.lock:
            s = self.sessions.get(sid)
        if s is not None and not self.gate.key_allowed(s.user):
            return
        self._send(sock, [s.owner if s is not None else frames[1], *frames[2:]])

    def _owned(self, sid: str, ident: bytes, user: str) -> Session | None:
        """The open session ``sid`` if the key ``user`` owns it (None otherwise). A message
        about it from another connection of that key — the client reconnected — moves its
        replies there."""
        with self.lock:
            s = self.sessions.get(sid)
            if s is None or s.closed or s.user != user:
                return None
            if s.owner != ident:
                log.debug("session %s: its client spoke from a new connection", sid[:8])
                s.owner = ident
            s.last_heard = time.monotonic()
        return s

    def _handle(self, sock: zmq.Socket, frames: list[Any]) -> None:
        if len(frames) < 2:
            return  # a ROUTER always prepends the identity; nothing to answer
        ident_frame = frames[0]
        ident = bytes(ident_frame.bytes)
        user = ""
        if not self.opts.insecure:
            try:
                user = frames[1].get("User-Id") or ""
            except Exception:
                user = ""
        refusal = self.gate.admit(user)
        if refusal is not None:
            self._error(sock, ident, P.E_DENIED, refusal)
            return
        client = ident.hex() if self.opts.insecure else user
        now = time.monotonic()
        if not self.limits.checks.allows(client, now):  # over its share of checks: unread
            log.debug("a message from %s... dropped: over its share of message checks", client[:8])
            return
        t0 = time.thread_time()
        try:
            msg = P.decode(frames[1:])
        except P.ProtocolError as exc:
            self.limits.checks.charge(client, time.thread_time() - t0, now)
            self._error(sock, ident, exc.code, exc.message)
            return
        except Exception as exc:  # decoder bug: never take the server down
            log.exception("decoder failure")
            self._error(sock, ident, P.E_BAD_MESSAGE, f"cannot decode message: {exc}")
            return
        self.limits.checks.charge(client, time.thread_time() - t0, now)
        if isinstance(msg, P.Ping):
            pong = P.Pong(msg.nonce)
            if msg.session:
                s = self._owned(msg.session, ident, user)
                if s is not None:  # a ping does not keep a session alive: only steps do
                    pong = P.Pong(msg.nonce, True, s.last_step, s.in_flight > 0)
            if msg.stats:
                pong.stats = self.stats_for(user)
            self._reply(sock, ident, pong)
        elif isinstance(msg, P.Open):
            self._open(sock, ident, user, msg)
        elif isinstance(msg, P.Step):
            t0 = time.thread_time()
            self._step(sock, ident, user, msg)
            self.limits.checks.charge(client, time.thread_time() - t0, now)
        elif isinstance(msg, P.PartGet | P.ChunkGet):
            if self.delivery is None:
                self._error(sock, ident, P.E_PART, "this server does not ship its model")
                return
            reply = self.delivery.handle(ident, user, msg)
            if reply is not None:
                self._reply(sock, ident, reply)
        elif isinstance(msg, P.Close):
            s = self._owned(msg.session, ident, user)
            if s is None:
                self._error(sock, ident, P.E_UNKNOWN_SESSION, "no such session", msg.session)
                return
            self._drop(s, "closed by client")
            self._reply(sock, ident, P.Closed(msg.session))
        else:
            self._error(
                sock, ident, P.E_BAD_MESSAGE, f"a client may not send '{type(msg).__name__}'"
            )

    def _open(self, sock: zmq.Socket, ident: bytes, user: str, m: P.Open) -> None:
        if m.config_fp != self.config_fp:
            self._error(
                sock,
                ident,
                P.E_FINGERPRINT,
                f"this server serves {self.model_label} (model fingerprint {self.config_fp}); "
                f"the model chosen on this computer is another one (fingerprint {m.config_fp})",
            )
            return
        if m.key_id != self.key_id:
            self._error(sock, ident, P.E_KEY, self._key_problem(m.key_id))
            return
        if not (self.lo <= m.start < m.end <= self.hi):
            keyed = " (its keyed layers: keep more layers on this computer)" if self.keyed else ""
            self._error(
                sock,
                ident,
                P.E_RANGE,
                f"this server serves layers [{self.lo}, {self.hi}){keyed}; the client asked for "
                f"[{m.start}, {m.end})",
            )
            return
        if m.hidden_size != self.config.hidden_size:
            self._error(sock, ident, P.E_SHAPE, "hidden size does not match the model")
            return
        shipped = self.delivery.manifest.model_fp[1] if self.delivery is not None else None
        if m.model_fp is not None and shipped is not None and m.model_fp != shipped:
            self._error(
                sock,
                ident,
                P.E_FINGERPRINT,
                f"this server's model changed since this computer got it (it now runs "
                f"{self.model_label})",
            )
            return
        if m.weights_fp is not None and m.weights_fp != self.weights_fp(m.start, m.end):
            self._error(
                sock,
                ident,
                P.E_FINGERPRINT,
                f"this server serves {self.model_label} (model fingerprint {self.config_fp}), "
                "but its trunk weights differ from those of the model chosen on this computer "
                "(another file or version of it)",
            )
            return
        if not self._make_room_for(sock, ident, user):
            return
        slot_bytes = self.worker.slot_bytes(m.start, m.end)
        busy = self._admit(slot_bytes)
        if busy is not None:
            self._error(sock, ident, P.E_BUSY, busy)
            return
        with self.lock:
            n = len([s for s in self.sessions.values() if not s.closed])
        sid = secrets.token_hex(12)
        client = ident.hex() if self.opts.insecure else user
        self.worker.open(sid, m.start, m.end, INITIAL_CAPACITY, client)
        s = Session(sid, ident, user, m.dtype, min(m.max_context, self.max_context), client)
        s.capacity, s.slot_bytes = INITIAL_CAPACITY, slot_bytes
        with self.lock:
            self.sessions[sid] = s
        self.stats["opened"] += 1
        log.info(
            "session %s opened: layers [%d, %d), wire %s (%d open)",
            sid[:8],
            m.start,
            m.end,
            m.dtype,
            n + 1,
        )
        opened = P.Opened(sid, m.start, m.end, s.max_context, str(self.dtype), self.key_id)
        self._reply(sock, ident, opened)

    def _key_problem(self, theirs: str | None) -> str:
        """The one line that refuses a session whose organisation key is not this server's."""
        if self.key_id is None:
            return (
                f"this computer uses organisation key {theirs}, but this server runs the public "
                f"model {self.model_label} (no organisation key)"
            )
        if theirs is None:
            return (
                f"this server runs a model keyed to an organisation key (id {self.key_id}): add "
                "your organisation's key"
            )
        return (
            f"this server runs a model keyed to organisation key {self.key_id}, but this "
            f"computer's key is {theirs}"
        )

    def _make_room_for(self, sock: zmq.Socket, ident: bytes, user: str) -> bool:
        """Per-client cap (per key; per connection when insecure): at the cap, close the key's
        least recently stepped idle session of *another* connection (a reconnected client left
        it; it replays if it comes back), else refuse the open as busy."""
        cap = self.opts.max_sessions_per_client
        with self.lock:
            mine = [
                s
                for s in self.sessions.values()
                if not s.closed and (s.owner == ident if self.opts.insecure else s.user == user)
            ]
        if len(mine) < cap:
            return True
        spare = [s for s in mine if s.owner != ident and s.in_flight == 0]
        if len(mine) - len(spare) >= cap:
            self._error(
                sock,
                ident,
                P.E_BUSY,
                f"server busy: this computer already has {len(mine)} sessions open "
                f"(the per-client limit is {cap})",
            )
            return False
        spare.sort(key=lambda s: s.last_used)
        for s in spare[: len(mine) - cap + 1]:
            self._drop(s, "closed: its client opened a newer one (per-client limit)")
        return True

    def _step(self, sock: zmq.Socket, ident: bytes, user: str, m: P.Step) -> None:
        s = self._owned(m.session, ident, user)
        if s is None:
            self._error(sock, ident, P.E_UNKNOWN_SESSION, "no such session", m.session, m.step)
            return
        s.last_used = time.monotonic()
        if m.step == s.last_step:  # a retry
            again = self.limits.resend(s, m, time.monotonic())
            if isinstance(again, tuple):
                self._error(sock, ident, *again, m.session, m.step)
            elif again:
                self._send(sock, [ident, *s.reply])
            return
        n = len(m.positions)
        length = (s.length if m.keep is None else s.block_start + len(m.keep)) + n
        cap = s.capacity
        while cap < length:
            cap *= 2
        problem = self._step_problem(s, m, length, cap)
        if problem is not None:
            self._error(sock, ident, *problem, m.session, m.step)
            return
        with self.lock:
            s.prev_block, s.length, s.block_start, s.capacity = n, length, length - n, cap
            s.last_step = m.step
            s.in_flight += 1
            s.queued_rows += n
            s.reply = []
        self.worker.submit(
            Job(
                s.sid,
                m.step,
                m.positions,
                m.parents,
                m.keep,
                m.hidden,
                m.want,
                P.WIRE_DTYPES[m.dtype],
                tag=s,
            )
        )

    def _step_problem(self, s: Session, m: P.Step, length: int, cap: int) -> tuple[str, str] | None:
        """Why step ``m`` of session ``s`` is refused, as (code, message); None: it is accepted.
        ``length`` and ``cap``: the session's cache length and capacity once it has run."""
        if s.in_flight >= MAX_IN_FLIGHT:
            n = s.in_flight
            return P.E_BUSY, f"server busy: {n} steps of this session are still being computed"
        if m.step != s.last_step + 1:
            return P.E_BAD_STEP, f"step {m.step} out of order (expected {s.last_step + 1})"
        if m.dtype != s.dtype:
            return P.E_SHAPE, f"session uses {s.dtype}, step sent {m.dtype}"
        if m.hidden.shape[1] != self.config.hidden_size:
            h = self.config.hidden_size
            return P.E_SHAPE, f"hidden size {m.hidden.shape[1]}, the model has {h}"
        top = max(m.positions)
        if top >= s.max_context:
            return P.E_CONTEXT, f"position {top} is beyond the session's context of {s.max_context}"
        with self.lock:
            busy = self.limits.queue_refusal(self.sessions.values(), s, len(m.positions))
        if busy is not None:
            return P.E_BUSY, busy
        if m.keep and m.keep[-1] >= s.prev_block:
            k, prev = m.keep[-1], s.prev_block
            return P.E_BAD_MESSAGE, f"keep index {k} is outside the previous block of {prev}"
        if length > s.max_context:
            return P.E_CONTEXT, f"the session's context of {s.max_context} tokens is full"
        grow = (cap - s.capacity) * s.slot_bytes
        if grow > 0 and not self._can_grow(s, grow):
            return P.E_BUSY, "server busy: the KV-cache memory cap is reached"
        return None

    def _admit(self, slot_bytes: int) -> str | None:
        """Why a new session over ``slot_bytes`` per token cannot open now (None: it can). The
        gateway overrides this to pick a replica."""
        with self.lock:
            n = len([s for s in self.sessions.values() if not s.closed])
        if n >= self.opts.max_sessions:
            return f"server busy: {n} sessions open (the limit)"
        if self.cache_bytes() + INITIAL_CAPACITY * slot_bytes > self.cache_cap:
            return "server busy: the KV-cache memory cap is reached"
        return None

    def _can_grow(self, s: Session, grow: int) -> bool:
        """May session ``s``'s cache grow by ``grow`` bytes under the memory cap?"""
        return self.cache_bytes() + grow <= self.cache_cap

    def _drop(self, s: Session, why: str) -> None:
        s.closed = True
        with self.lock:
            self.sessions.pop(s.sid, None)
        self.worker.close(s.sid)
        log.info("session %s %s", s.sid[:8], why)

    def _reap(self, now: float) -> None:
        """Drop sessions without a step for the TTL (pings do not count), sessions with steps
        queued whose client went silent (a waiting client pings every heartbeat: this one left,
        so its queued work is dropped, not computed for nobody) and revoked keys'."""
        with self.lock:
            live = list(self.sessions.values())
        for s, why in self.limits.to_reap(live, now, self.opts.session_ttl_s, self.opts.silent_s):
            self._drop(s, why)
        revoked = {u for u in {s.user for s in live} if not self.gate.key_allowed(u)}
        for s in live:
            if s.user in revoked and not s.closed:
                self._drop(s, "closed: its key was revoked")

    # ------------------------------------------------------------------ worker thread

    def _done(self, d: Done) -> None:
        """The worker's answer to one step (called on the worker's thread): reply frames to the
        socket thread, and the session's retry cache and in-flight count."""
        s: Session = d.job.tag
        if d.error is None:
            frames = P.encode(
                P.Result(s.sid, d.job.step, d.server_ms, d.hidden, d.queue_ms, d.load)
            )
            self.stats["steps"] += 1
        else:
            code, message = d.error
            frames = P.encode(P.Error(code, message, s.sid, d.job.step))
            if code != P.E_UNKNOWN_SESSION and not s.closed:
                # its cache no longer matches what the socket thread booked: start afresh
                self._drop(s, f"dropped after a failed step ({code})")
        with self.lock:
            s.reply = frames if d.error is None else []
            s.in_flight -= 1
            s.queued_rows -= len(d.job.positions)
            s.last_used = time.monotonic()
        if self._out is None:
            self._out = self.ctx.socket(zmq.PAIR)
            self._out.connect(f"inproc://veil-worker-{id(self)}")
        self._out.send_multipart([s.sid.encode(), s.owner, *frames], copy=False)
