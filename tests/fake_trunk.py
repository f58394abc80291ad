"""A small misbehaving trunk server for tests: a real CURVE ROUTER that speaks the Veil protocol
(``engine.protocol``) and answers steps the way ``mode`` says — the failures a client must
survive with one clear error in bounded time:

* ``echo`` — a correct server whose trunk is the identity (a sanity baseline);
* ``internal`` / ``unknown`` — every step gets that error (a GPU out of memory, a lost session);
* ``in_flight`` — steps are accepted and never answered; pongs say "being computed" forever;
* ``lose_late`` — like ``in_flight``, but each session is lost ``lose_after_s`` after its first
  step (pongs then say "unknown"), so a client that restarted its deadline after each recovery
  would wait several deadlines;
* ``silent_accept`` — steps are accepted and never answered; pongs say "done";
* ``nan`` / ``inf`` — results full of NaN / infinity;
* ``oversized`` — a result whose tensor frame is :data:`OVERSIZED_BYTES` long;
* ``stale_error`` — like ``echo``, but an ``unknown_session`` error about an older session
  arrives before each ``Opened`` (a restarted server answering what was sent to the old one).

It accepts any client key (or, with ``curve=False``, speaks plain TCP like a
``veil-trunk serve --insecure``), counts what it receives, and stops with :meth:`close`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import torch
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from engine import protocol as P
from tests.fixed_keys import SERVER_KEYS

OVERSIZED_BYTES = 8 << 20
MODES = (
    *("echo", "internal", "unknown", "in_flight", "lose_late", "silent_accept"),
    *("nan", "inf", "oversized", "stale_error"),
)


class FakeTrunk:
    def __init__(self, mode: str, curve: bool = True, lose_after_s: float = 3.0) -> None:
        assert mode in MODES, mode
        self.mode = mode
        self.lose_after_s = lose_after_s
        self.public_key, secret = SERVER_KEYS
        self.ctx = zmq.Context()
        self.auth: ThreadAuthenticator | None = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve:
            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
            self.sock.curve_server = True
            self.sock.curve_publickey = self.public_key.encode()
            self.sock.curve_secretkey = secret.encode()
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.counts: Counter[str] = Counter()
        self.last_step: dict[str, int] = {}
        self.first_step_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-trunk", daemon=True)
        self._thread.start()

    @property
    def invite(self) -> str:
        return P.make_invite(self.address, self.public_key)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()

    def __enter__(self) -> FakeTrunk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ server loop

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            frames = self.sock.recv_multipart(copy=False)
            ident = frames[0].bytes
            try:
                msg = P.decode(frames[1:])
            except P.ProtocolError as exc:
                self._reply(ident, P.encode(P.Error(exc.code, exc.message)))
                continue
            for out in self._answer(msg):
                self._reply(ident, out)

    def _reply(self, ident: bytes, frames: list[Any]) -> None:
        self.sock.send_multipart([ident, *frames])

    def _answer(self, msg: P.Message) -> list[list[Any]]:
        self.counts[type(msg).__name__.lower()] += 1
        if isinstance(msg, P.Open):
            sid = f"s{self.counts['open']}"
            opened = P.encode(P.Opened(sid, msg.start, msg.end, msg.max_context, "float32"))
            if self.mode == "stale_error":
                old = P.Error(P.E_UNKNOWN_SESSION, "no such session", "old-session", 7)
                return [P.encode(old), opened]
            return [opened]
        if isinstance(msg, P.Ping):
            if msg.session is None:
                return [P.encode(P.Pong(msg.nonce))]
            last = self.last_step.get(msg.session, -1)
            since = time.monotonic() - self.first_step_at.get(msg.session, time.monotonic())
            if self.mode == "lose_late" and since > self.lose_after_s:
                return [P.encode(P.Pong(msg.nonce, False))]
            busy = self.mode in ("in_flight", "lose_late")
            return [P.encode(P.Pong(msg.nonce, True, last, busy))]
        if isinstance(msg, P.Close):
            return [P.encode(P.Closed(msg.session))]
        if not isinstance(msg, P.Step):
            return []
        self.last_step[msg.session] = msg.step
        self.first_step_at.setdefault(msg.session, time.monotonic())
        sid, step = msg.session, msg.step
        if self.mode == "internal":
            return [P.encode(P.Error(P.E_INTERNAL, "CUDA out of memory", sid, step))]
        if self.mode == "unknown":
            return [P.encode(P.Error(P.E_UNKNOWN_SESSION, "no such session", sid, step))]
        if self.mode in ("in_flight", "lose_late", "silent_accept"):
            return []
        if not msg.want:
            return [P.encode(P.Result(sid, step, 0.1, None))]
        out = msg.hidden.clone()  # [B, H]
        if self.mode == "nan":
            out[0, 0] = float("nan")
        elif self.mode == "inf":
            out[-1, -1] = float("inf")
        frames = P.encode(P.Result(sid, step, 0.1, out))
        if self.mode == "oversized":
            frames[1] = bytes(OVERSIZED_BYTES)
        return [frames]


def hidden(rows: int, width: int = 64) -> torch.Tensor:
    """Deterministic activations for a step."""
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, width, generator=g)  # [B, H]
