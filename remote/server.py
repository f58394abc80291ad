"""The trunk server: a ZeroMQ ROUTER that serves decoder layers [M, L - M) of one model.

Threads:

* the *socket thread* (:meth:`TrunkServer.serve`) owns the ROUTER socket. It decodes and
  validates every message, answers pings, opens/closes sessions, checks ownership and step
  order, reaps idle sessions, and hands steps to the worker. It never runs tensor math, so
  heartbeats and other clients stay responsive while a long block is computed.
* the *worker thread* runs the layer math, one step at a time, and sends the reply frames back
  to the socket thread over an inproc PAIR socket (ZeroMQ sockets are single-threaded).

Weights for [M, L - M) are read once; each session gets its own :class:`LayerStack` over the
sub-range it asked for, sharing the weight tensors, with its own KV cache.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq

from engine import protocol as P
from engine.config import ModelConfig
from engine.loading import WeightReader, load_config, resolve, weights_fingerprint
from engine.model import LayerStack, LayerWeights, layer_tensor_names
from engine.split import read_layers

log = logging.getLogger("veil.trunk")

INITIAL_CAPACITY = 64


@dataclass
class ServerOptions:
    model: str
    bind: str = "tcp://127.0.0.1:5757"
    min_local_layers: int = 1
    max_sessions: int = 8
    session_ttl_s: float = 600.0
    max_cache_gb: float = 4.0
    device: str = "cpu"
    dtype: str = "float32"
    insecure: bool = False
    max_context: int | None = None  # None: the model's max_position_embeddings


@dataclass
class Session:
    sid: str
    owner: bytes  # ROUTER identity of the connection that opened it
    user: str  # CURVE public key of that connection ("" when insecure)
    stack: LayerStack
    dtype: str  # wire dtype
    max_context: int
    last_step: int = -1  # last step accepted (queued or done)
    in_flight: int = 0  # steps queued or running
    reply: list[Any] = field(default_factory=list)  # cached reply frames of last_step
    last_used: float = field(default_factory=time.monotonic)
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
    ) -> None:
        if opts.insecure and not _is_loopback(opts.bind):
            raise ValueError("--insecure (plain TCP) is only allowed on a loopback address")
        if not opts.insecure and (secret_key is None or public_key is None):
            raise ValueError("a server keypair is needed (run `veil-trunk keygen`)")
        self.opts = opts
        self.secret_key = secret_key
        self.public_key = public_key
        self.allowed = allowed
        from engine.session import parse_dtype

        self.dtype = parse_dtype(opts.dtype)
        self.device = torch.device(opts.device)
        resolved = resolve(opts.model, progress)
        self.model_name = resolved.name
        self.config: ModelConfig = load_config(resolved.folder)
        n = self.config.n_layers
        m = opts.min_local_layers
        if m < 1 or 2 * m >= n:
            raise ValueError(f"--min-local-layers must be between 1 and {(n - 1) // 2}, got {m}")
        self.lo, self.hi = m, n - m
        self.reader = WeightReader(resolved.folder)
        log.info("loading layers [%d, %d) of %s", self.lo, self.hi, resolved.name)
        self.layers: dict[int, LayerWeights] = read_layers(
            self.reader, self.config, range(self.lo, self.hi), self.dtype, self.device
        )
        self.config_fp = self.config.fingerprint()
        self._weights_fp: dict[tuple[int, int], str] = {}
        self.max_context = opts.max_context or self.config.max_position_embeddings
        self.cache_cap = int(opts.max_cache_gb * (1 << 30))
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.jobs: queue.Queue[tuple[Session, P.Step, float] | None] = queue.Queue()
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        self.address = ""
        self.ready = threading.Event()
        self.auth: Any = None
        self.stats = {"steps": 0, "errors": 0, "opened": 0}

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

    # ------------------------------------------------------------------ socket thread

    def _setup_socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # A client that reconnects after a network drop keeps its (random, secret) routing id;
        # let the new connection take it over at once instead of waiting for the dead one to
        # time out. Sessions also check the CURVE key, so the id alone grants nothing.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(
            zmq.MAXMSGSIZE, P.MAX_BLOCK * self.config.hidden_size * 4 + P.MAX_HEADER_BYTES
        )
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.RCVHWM, 1000)
        if not self.opts.insecure:
            from zmq.auth.thread import ThreadAuthenticator

            self.auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("veil.trunk.zap"))
            self.auth.start()
            self.auth.configure_curve_callback(domain="veil", credentials_provider=self)
            sock.setsockopt(zmq.ZAP_DOMAIN, b"veil")
            sock.curve_server = True
            sock.curve_secretkey = self.secret_key
            sock.curve_publickey = self.public_key
        sock.bind(self.opts.bind)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP credentials provider: is this CURVE public key (z85) on the allow-list?"""
        try:
            z85 = zmq.utils.z85.encode(key).decode() if len(key) == 32 else key.decode()
        except Exception:
            return False
        ok = bool(self.allowed and self.allowed(z85))
        if not ok:
            log.warning("refused a client key %s...: not on the allow-list", z85[:8])
        return ok

    def serve(self) -> None:
        """Run until :meth:`stop` (call from the main thread; blocks)."""
        sock = self._setup_socket()
        back = self.ctx.socket(zmq.PAIR)
        back.bind(f"inproc://veil-worker-{id(self)}")
        worker = threading.Thread(target=self._worker, name="veil-trunk-worker", daemon=True)
        worker.start()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(back, zmq.POLLIN)
        self.ready.set()
        last_reap = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(200))
                if back in events:
                    while True:
                        try:
                            frames = back.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._send(sock, frames)
                if sock in events:
                    for _ in range(64):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(sock, frames)
                now = time.monotonic()
                if now - last_reap > 0.5:
                    self._reap(now)
                    last_reap = now
        finally:
            self.jobs.put(None)
            worker.join(timeout=5)
            back.close(0)
            sock.close(0)
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()
            log.info("stopped")

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

    def _owned(self, sid: str, ident: bytes, user: str) -> Session | None:
        with self.lock:
            s = self.sessions.get(sid)
        if s is None or s.closed or s.owner != ident or s.user != user:
            return None
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
        try:
            msg = P.decode(frames[1:])
        except P.ProtocolError as exc:
            self._error(sock, ident, exc.code, exc.message)
            return
        except Exception as exc:  # decoder bug: never take the server down
            log.exception("decoder failure")
            self._error(sock, ident, P.E_BAD_MESSAGE, f"cannot decode message: {exc}")
            return
        if isinstance(msg, P.Ping):
            pong = P.Pong(msg.nonce)
            if msg.session:
                s = self._owned(msg.session, ident, user)
                if s is not None:
                    s.last_used = time.monotonic()
                    pong = P.Pong(msg.nonce, True, s.last_step, s.in_flight > 0)
            self._reply(sock, ident, pong)
        elif isinstance(msg, P.Open):
            self._open(sock, ident, user, msg)
        elif isinstance(msg, P.Step):
            self._step(sock, ident, user, msg)
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
                f"this server runs {self.model_name} (config {self.config_fp}); "
                f"the client's model has config {m.config_fp}",
            )
            return
        if not (self.lo <= m.start < m.end <= self.hi):
            self._error(
                sock,
                ident,
                P.E_RANGE,
                f"this server serves layers [{self.lo}, {self.hi}); the client asked for "
                f"[{m.start}, {m.end})",
            )
            return
        if m.hidden_size != self.config.hidden_size:
            self._error(sock, ident, P.E_SHAPE, "hidden size does not match the model")
            return
        if m.weights_fp is not None and m.weights_fp != self.weights_fp(m.start, m.end):
            self._error(
                sock,
                ident,
                P.E_FINGERPRINT,
                f"the trunk weights of this server's {self.model_name} differ from the client's",
            )
            return
        with self.lock:
            n = len([s for s in self.sessions.values() if not s.closed])
        if n >= self.opts.max_sessions:
            self._error(sock, ident, P.E_BUSY, f"server busy: {n} sessions open (the limit)")
            return
        stack = LayerStack(
            self.config,
            m.start,
            [self.layers[i] for i in range(m.start, m.end)],
            dtype=self.dtype,
            device=self.device,
            capacity=INITIAL_CAPACITY,
        )
        if self.cache_bytes() + stack.cache.nbytes() > self.cache_cap:  # (before it counts)
            self._error(sock, ident, P.E_BUSY, "server busy: the KV-cache memory cap is reached")
            return
        sid = secrets.token_hex(12)
        slot_bytes = stack.cache.nbytes() // stack.cache.capacity
        s = Session(sid, ident, user, stack, m.dtype, min(m.max_context, self.max_context))
        s.capacity, s.slot_bytes = stack.cache.capacity, slot_bytes
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
        self._reply(sock, ident, P.Opened(sid, m.start, m.end, s.max_context, str(self.dtype)))

    def _step(self, sock: zmq.Socket, ident: bytes, user: str, m: P.Step) -> None:
        s = self._owned(m.session, ident, user)
        if s is None:
            self._error(sock, ident, P.E_UNKNOWN_SESSION, "no such session", m.session, m.step)
            return
        s.last_used = time.monotonic()
        if m.step == s.last_step:  # a retry
            if s.in_flight == 0 and s.reply:
                self._send(sock, [ident, *s.reply])
            return  # still computing: its reply is on the way
        if m.step != s.last_step + 1:
            self._error(
                sock,
                ident,
                P.E_BAD_STEP,
                f"step {m.step} out of order (expected {s.last_step + 1})",
                m.session,
                m.step,
            )
            return
        if m.dtype != s.dtype:
            self._error(
                sock,
                ident,
                P.E_SHAPE,
                f"session uses {s.dtype}, step sent {m.dtype}",
                m.session,
                m.step,
            )
            return
        if m.hidden.shape[1] != self.config.hidden_size:
            self._error(
                sock,
                ident,
                P.E_SHAPE,
                f"hidden size {m.hidden.shape[1]}, the model has {self.config.hidden_size}",
                m.session,
                m.step,
            )
            return
        if max(m.positions) >= s.max_context:
            self._error(
                sock,
                ident,
                P.E_CONTEXT,
                f"position {max(m.positions)} is beyond the session's context of {s.max_context}",
                m.session,
                m.step,
            )
            return
        n = len(m.positions)
        if m.keep and m.keep[-1] >= s.prev_block:
            self._error(
                sock,
                ident,
                P.E_BAD_MESSAGE,
                f"keep index {m.keep[-1]} is outside the previous block of {s.prev_block}",
                m.session,
                m.step,
            )
            return
        length = (s.length if m.keep is None else s.block_start + len(m.keep)) + n
        if length > s.max_context:
            self._error(
                sock,
                ident,
                P.E_CONTEXT,
                f"the session's context of {s.max_context} tokens is full",
                m.session,
                m.step,
            )
            return
        cap = s.capacity
        while cap < length:
            cap *= 2
        grow = (cap - s.capacity) * s.slot_bytes
        if grow > 0 and self.cache_bytes() + grow > self.cache_cap:
            self._error(
                sock,
                ident,
                P.E_BUSY,
                "server busy: the KV-cache memory cap is reached",
                m.session,
                m.step,
            )
            return
        with self.lock:
            s.prev_block, s.length, s.block_start, s.capacity = n, length, length - n, cap
            s.last_step = m.step
            s.in_flight += 1
            s.reply = []
        self.jobs.put((s, m, time.perf_counter()))

    def _drop(self, s: Session, why: str) -> None:
        s.closed = True
        with self.lock:
            self.sessions.pop(s.sid, None)
        log.info("session %s %s", s.sid[:8], why)

    def _reap(self, now: float) -> None:
        with self.lock:
            idle = [
                s
                for s in self.sessions.values()
                if s.in_flight == 0 and now - s.last_used > self.opts.session_ttl_s
            ]
        for s in idle:
            self._drop(s, f"expired after {self.opts.session_ttl_s:g} s idle")

    # ------------------------------------------------------------------ worker thread

    def _worker(self) -> None:
        out = self.ctx.socket(zmq.PAIR)
        out.connect(f"inproc://veil-worker-{id(self)}")
        try:
            while True:
                job = self.jobs.get()
                if job is None:
                    return
                s, m, t_in = job
                try:
                    frames = self._compute(s, m, t_in)
                except Exception as exc:  # never kill the worker
                    log.exception("step failed")
                    frames = P.encode(
                        P.Error(P.E_INTERNAL, f"step failed on the server: {exc}", s.sid, m.step)
                    )
                    self._drop(s, "dropped after an internal error")
                with self.lock:
                    s.reply = frames if _is_result(frames) else []
                    s.in_flight -= 1
                    s.last_used = time.monotonic()
                out.send_multipart([s.owner, *frames], copy=False)
        finally:
            out.close(0)

    def _compute(self, s: Session, m: P.Step, t_in: float) -> list[Any]:
        if s.closed:
            return P.encode(P.Error(P.E_UNKNOWN_SESSION, "no such session", s.sid, m.step))
        t0 = time.perf_counter()
        pos = torch.tensor(m.positions, dtype=torch.long)  # [B]
        with torch.inference_mode():
            y = s.stack.forward(m.hidden, pos, m.parents, m.keep)  # [B, H]
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            out = y.to(device="cpu", dtype=P.WIRE_DTYPES[m.dtype]) if m.want else None  # [B, H]
        ms = (time.perf_counter() - t0) * 1000.0
        self.stats["steps"] += 1
        return P.encode(P.Result(s.sid, m.step, ms, out, (t0 - t_in) * 1000.0))


def _is_result(frames: list[Any]) -> bool:
    import msgpack

    try:
        h = msgpack.unpackb(bytes(frames[0]), raw=False)
        return bool(h.get("t") == P.RESULT)
    except Exception:
        return False


def read_allow_list(path: Path) -> set[str]:
    """Client public keys (z85, 40 chars), one per line, optionally followed by whitespace and a
    note; other lines (e.g. '# comment') are ignored."""
    keys: set[str] = set()
    if not path.is_file():
        return keys
    for line in path.read_text().splitlines():
        k = line_key(line)
        if k:
            keys.add(k)
    return keys


def line_key(line: str) -> str | None:
    """The key on one allow-list line, or None for comments and blank lines."""
    parts = line.split()
    # a z85 key may start with '#', so a comment is any line whose first word is not a key
    return parts[0] if parts and len(parts[0]) == 40 else None
