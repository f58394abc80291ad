"""A trunk session over the network: :class:`RemoteTrunk` (sessions, steps, journal,
replay and the bounded recovery of ``engine.transport.policy``)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine import protocol as P
from engine.errors import (
    AuthError,
    FingerprintMismatch,
    ServerBusy,
    SplitError,
    TransportError,
    VeilError,
)
from engine.loading import Progress
from engine.transport.inflight import Ticket, await_first, redo_in_flight, submit_step
from engine.transport.link import Link
from engine.transport.policy import (
    PREFILL_CHUNK,
    StepBudget,
    backoff_s,
    check_finite,
    chunk_bounds,
    translate_keep,
)
from engine.transport.steps import ConnectionLost as _ConnectionLost
from engine.transport.steps import Entry as _Entry
from engine.transport.steps import NoAnswer as _NoAnswer
from engine.transport.steps import Refused as _Refused
from engine.transport.steps import ServerFault as _ServerFault
from engine.transport.steps import SessionLost as _SessionLost
from engine.transport.steps import send_chain

log = logging.getLogger("veil.transport")

# Default overall deadline for one step (VEIL_STEP_TIMEOUT overrides it). With the other
# defaults a misbehaving server ends the client in under 2 minutes (see docs/protocol.md).
STEP_TIMEOUT_S = 60.0
REPLAY_WINDOW = 4  # replayed steps in flight at once (the server accepts 4 per session)


def _key_mismatch(address: str, mine: str | None, theirs: str | None) -> VeilError:
    """The refusal when the session's keyed model and this computer's key disagree (checked by
    the client too: a server older than keyed models ignores the key and runs the public one)."""
    from engine.keyed.transform import KeyedError

    if theirs is None:
        return KeyedError(
            f"this computer uses organisation key {mine}, but the trunk server at {address} runs "
            "the public model (no organisation key)",
            hint="leave out the organisation key for this server, or ask IT for the keyed server",
        )
    if mine is None:
        return KeyedError(
            f"this server runs a model keyed to an organisation key (id {theirs}): add your "
            "organisation's key"
        )
    return KeyedError(
        f"the trunk server at {address} runs a model keyed to organisation key {theirs}, but "
        f"this computer's key is {mine}",
        hint="ask IT for the current organisation key",
    )


class RemoteTrunk(Link):
    """Trunk layers [start, end) on a remote server."""

    pipelines = True  # several steps may be in flight (submit/collect): prompts read pipelined

    def __init__(
        self,
        address: str,
        *,
        server_key: str | None,
        client_keys: tuple[str, str] | None,
        start: int,
        end: int,
        hidden_size: int,
        config_fp: str,
        weights_fp: str | None,
        model_fp: str | None = None,
        key_id: str | None = None,
        max_context: int = 4096,
        wire_dtype: str = "float16",
        timeout_s: float = 10.0,
        heartbeat_s: float = 0.5,
        reconnect_s: float = 45.0,
        connect_timeout_s: float = 10.0,
        step_timeout_s: float = STEP_TIMEOUT_S,
        max_session_losses: int = 4,
        max_faults: int = 1,
        chunk_rows: int = PREFILL_CHUNK,
        progress: Progress | None = None,
    ) -> None:
        if not address.startswith("tcp://"):
            raise TransportError(f"'{address}' is not a tcp://HOST:PORT address or invite code")
        if (server_key is None) != (client_keys is None):
            raise TransportError("CURVE needs both the server key and a client keypair")
        for what, key in (
            ("server key", server_key),
            ("client public key", client_keys[0] if client_keys else None),
            ("client secret key", client_keys[1] if client_keys else None),
        ):
            problem = None if key is None else P.curve_key_problem(key)
            if problem is not None:
                if what == "client secret key":  # (never echo a part of a secret)
                    problem = "not a Z85 key"
                raise TransportError(
                    f"the {what} for {address} is damaged: {problem}",
                    hint="get a new invite code" if what == "server key" else None,
                )
        if not 0 < step_timeout_s <= 3600 or timeout_s <= 0 or heartbeat_s <= 0:
            raise TransportError("the trunk timeouts must be positive (step timeout at most 1 h)")
        if not 1 <= chunk_rows <= P.MAX_BLOCK:
            raise TransportError(f"chunk_rows must be between 1 and {P.MAX_BLOCK}")
        try:
            wire = P.wire_dtype_name(wire_dtype)
        except ValueError as exc:
            raise TransportError(str(exc)) from None
        # The largest reply this client can ask for: a full block in its wire dtype + header.
        elem = torch.tensor([], dtype=P.WIRE_DTYPES[wire]).element_size()
        super().__init__(
            address, server_key, client_keys, P.MAX_BLOCK * hidden_size * elem + P.MAX_HEADER_BYTES
        )
        self.start = start
        self.end = end
        self.hidden_size = hidden_size
        self.config_fp = config_fp
        self.weights_fp = weights_fp
        self.model_fp = model_fp
        self.client_key_id = key_id  # the organisation key this computer holds (None: none)
        self.key_id: str | None = None  # the keyed model's key id the server runs (None: plain)
        self.max_context = max_context
        self.wire_dtype = wire
        self.wire_torch = P.WIRE_DTYPES[self.wire_dtype]
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s
        self.reconnect_s = reconnect_s
        self.connect_timeout_s = connect_timeout_s
        self.step_timeout_s = step_timeout_s
        self.max_session_losses = max_session_losses
        self.max_faults = max_faults
        self.chunk_rows = chunk_rows
        self.progress = progress
        self.session: str | None = None
        self.step_id = -1
        self.journal: list[_Entry] = []
        self._nonce = itertools.count(1)
        self._broken = False  # a step failed mid-way: the server's cache is unknown until reset()
        self._split_prev: tuple[int, int] | None = None  # (rows, rows of last step) if split
        self._inflight: list[Ticket] = []  # steps sent by submit, not yet answered (in order)
        self._early: dict[int, P.Result | P.Error] = {}  # their answers that came out of turn
        # stats
        self.round_trips = 0
        self.chained_steps = 0  # steps of long chains sent with others in flight
        self.overlapped_steps = 0  # decode steps submitted while another was in flight
        self.replays = 0
        self.replayed_steps = 0
        self.reconnects = 0
        self.server_ms = 0.0
        self.queue_ms = 0.0
        self.load: P.Load | None = None  # the trunk's load, from its latest reply (if it says)
        self._net_ms: list[float] = []
        self._ping_ms: list[float] = []
        self.closed = False
        try:
            self._connect()
            self._open(self.connect_timeout_s)
        except BaseException:
            self._destroy()
            raise

    def _error_for(self, e: P.Error) -> VeilError:
        """The user-facing error for a refusal from the server."""
        if e.code == P.E_BUSY:
            return ServerBusy(e.message, hint="try again later or use fewer local sessions")
        if e.code == P.E_FINGERPRINT:
            return FingerprintMismatch(
                e.message,
                hint="use the server's own model: leave out --model (in the app: Settings, Model, "
                "Server's), or choose the same model file the server serves",
            )
        if e.code == P.E_RANGE:
            return SplitError(e.message, hint="choose --local-layers so the trunk fits the server")
        if e.code == P.E_KEY:
            from engine.keyed.transform import KeyedError

            return KeyedError(
                e.message,
                hint="pass --org-key FILE, or import it in the app's Settings under Organisation "
                "key; your IT department gives it out",
            )
        if e.code == P.E_CONTEXT:
            return TransportError(e.message, hint="start a new conversation")
        if e.code == P.E_DENIED:
            pub = self.client_keys[0] if self.client_keys else "?"
            return AuthError(
                f"the trunk server at {self.address} no longer accepts this computer's key "
                f"({e.message})",
                hint=f"ask its admin to run: veil-trunk allow '{pub}'",
            )
        return TransportError(f"the trunk server answered: {e.message} [{e.code}]")

    def _open(self, timeout_s: float) -> None:
        """Open a session (the socket must be connected). Raises on refusal or timeout."""
        msg = P.Open(
            self.config_fp,
            self.weights_fp,
            self.start,
            self.end,
            self.wire_dtype,
            self.hidden_size,
            self.max_context,
            self.model_fp,
            self.client_key_id,
        )
        deadline = time.monotonic() + timeout_s
        sent = False
        next_try = 0.0
        while True:
            now = time.monotonic()
            if now >= next_try:
                sent = self._send(msg)
                next_try = now + (2.0 if sent else 0.05)
            if self._auth_failed:
                raise self._auth_error()
            if now > deadline:
                if self._keys_unchecked:
                    raise _NoAnswer(
                        f"the trunk server at {self.address} cannot check keys right now",
                        hint="a problem on the server: try again later, or tell its admin",
                    )
                if self._handshake_trouble:
                    raise _NoAnswer(
                        f"the encrypted handshake with {self.address} failed",
                        hint="the server key does not match this server: get a new invite code",
                    )
                raise _NoAnswer(
                    f"no answer from the trunk server at {self.address}",
                    hint="is it running and reachable, and is its key right?",
                )
            reply = self._recv(0.05 if not sent else min(0.25, deadline - now))
            if reply is None:
                continue
            if isinstance(reply, P.Opened):
                if (reply.start, reply.end) != (self.start, self.end):
                    raise TransportError("the server opened a session for other layers")
                if reply.key_id != self.client_key_id:
                    self._send(P.Close(reply.session))
                    raise _key_mismatch(self.address, self.client_key_id, reply.key_id)
                self.key_id = reply.key_id
                self.session = reply.session
                self.step_id = -1
                t0 = time.perf_counter()
                self._measure_ping()
                log.debug("session %s (%.1f ms ping)", reply.session, time.perf_counter() - t0)
                return
            if isinstance(reply, P.Error):
                if reply.session is not None or reply.code == P.E_UNKNOWN_SESSION:
                    continue  # about an older session (a restarted server answering late)
                raise self._error_for(reply)
            # stale replies of an older session (pong/result): ignore

    def _measure_ping(self) -> None:
        nonce = next(self._nonce)
        t0 = time.perf_counter()
        if not self._send(P.Ping(nonce)):
            return
        deadline = t0 + 2.0
        while time.perf_counter() < deadline:
            r = self._recv(deadline - time.perf_counter())
            if isinstance(r, P.Pong) and r.nonce == nonce:
                self._ping_ms.append((time.perf_counter() - t0) * 1000.0)
                return

    def _count_attempt(self, budget: StepBudget, cause: Exception | None) -> None:
        """Book one recovery attempt; raise when a limit of :class:`StepBudget` is reached."""
        budget.attempts += 1
        if isinstance(cause, _ServerFault):
            budget.faults += 1
            if budget.faults > self.max_faults:
                raise TransportError(
                    f"the trunk server at {self.address} failed on this step "
                    f"{budget.faults} times: {cause}",
                    hint="this is a fault on the server (e.g. out of memory); try again later "
                    "or tell its admin",
                )
        elif isinstance(cause, _SessionLost):
            budget.losses += 1
            if budget.losses > self.max_session_losses:
                raise TransportError(
                    f"the trunk server at {self.address} lost this conversation's session "
                    f"{budget.losses} times in a row",
                    hint="the server is restarting or faulty; try again later",
                )
        assert budget.recovery_until is not None
        if time.monotonic() + backoff_s(budget.attempts) >= budget.recovery_until:
            raise TransportError(
                f"lost the trunk server at {self.address} and could not get it back "
                f"within {self.reconnect_s:g} s",
                hint="check the server and the network, then try again",
            )

    def _recover(self, budget: StepBudget, cause: Exception | None) -> None:
        """Get a fresh session (rebuilding the socket after silence) and replay the journal.

        ``cause`` is what went wrong (None: just open a session for a new conversation)."""
        if budget.recovery_until is None:
            budget.recovery_until = time.monotonic() + self.reconnect_s
        rebuild = isinstance(cause, _ConnectionLost | _NoAnswer)
        while True:
            self._count_attempt(budget, cause)
            t_reach = time.monotonic()
            reached = False
            try:
                time.sleep(backoff_s(budget.attempts))
                if rebuild:
                    self.reconnects += 1
                    self._connect()
                remaining = budget.recovery_until - time.monotonic()
                self._open(max(min(self.timeout_s, remaining), 0.05))
                reached = True
            except _NoAnswer as exc:
                cause = exc
            finally:
                # Reaching the server (failed attempts too) has its own budget, reconnect_s,
                # enforced by _count_attempt: it extends the step's deadline; replays do not.
                budget.deadline += time.monotonic() - t_reach
            if not reached:
                log.info("reconnecting to %s: %s", self.address, cause)
                rebuild = True
                continue
            try:
                self._replay(budget.deadline)
                return
            except (_SessionLost, _ConnectionLost, _ServerFault) as exc:
                log.info("reconnecting to %s: %s", self.address, exc or type(exc).__name__)
                cause = exc
                rebuild = rebuild or isinstance(exc, _ConnectionLost)

    def _ping(self, sid: str) -> int | None:
        """Ask about session ``sid``; the ping's nonce, or None when it could not be sent."""
        nonce = next(self._nonce)
        return nonce if self._send(P.Ping(nonce, sid)) else None

    def _wait(self, deadline: float) -> tuple[Any, float]:
        """Wait up to one heartbeat for a message: (message or None, now). Raises at the step's
        deadline, after a failed handshake, or when the server has been silent too long."""
        now = time.monotonic()
        if now >= deadline:
            raise self._step_timeout()
        r = self._recv(min(self.heartbeat_s, deadline - now))
        now = time.monotonic()
        if self._auth_failed:
            raise self._auth_error()
        if r is None and now - self._last_heard > self.timeout_s:
            raise _ConnectionLost()
        return r, now

    def _replay(self, deadline: float) -> None:
        """Send the journal again, up to ``REPLAY_WINDOW`` steps ahead (the server runs a
        session's steps in order), with replies that carry no tensor; done by ``deadline``."""
        n = len(self.journal)
        if not n:
            return
        self.replays += 1
        log.info("replaying %d steps onto a new session", n)
        if self.progress is not None:
            self.progress("reconnecting to the trunk server", 0.0)
        assert self.session is not None
        sid, first = self.session, self.step_id + 1
        sent = done = 0  # journal entries sent / known to be computed
        sent_at: dict[int, int] = {}  # ping nonce -> entries sent before it (a pong covers them)
        self._last_heard = last_ping = time.monotonic()
        while done < n:
            while sent < n and sent - done < REPLAY_WINDOW:
                e = self.journal[sent]
                step, dt = first + sent, self.wire_dtype
                if not self._send(
                    P.Step(sid, step, e.positions, e.parents, e.keep, dt, e.hidden, False)
                ):
                    break
                sent += 1
            r, now = self._wait(deadline)
            if now - last_ping >= self.heartbeat_s:
                nonce = self._ping(sid)
                if nonce is not None:
                    sent_at[nonce] = sent
                last_ping = now
            if isinstance(r, P.Result) and r.session == sid:
                done = max(done, r.step - first + 1)
            elif isinstance(r, P.Pong) and r.nonce in sent_at:
                if not r.known:
                    raise _SessionLost("the server no longer has the session")
                accepted = r.last_step - first + 1
                if not r.in_flight:
                    done = max(done, accepted)
                if accepted < sent_at.pop(r.nonce):  # sent before the ping yet not accepted:
                    sent = max(accepted, done)  # lost on the way, send those again
            elif isinstance(r, P.Error) and r.session in (None, sid):
                if r.code == P.E_UNKNOWN_SESSION:
                    raise _SessionLost(r.message)
                if r.code == P.E_INTERNAL:
                    raise _ServerFault(r.message)
                if r.code not in (P.E_BUSY, P.E_BAD_STEP):  # (those: it catches up by pongs)
                    raise self._error_for(r)
        self.step_id = first + n - 1
        self.replayed_steps += n
        if self.progress is not None:
            self.progress("reconnecting to the trunk server", 1.0)

    def _abandon(self) -> None:
        """A step failed mid-way: the server's cache state is unknown, so drop the session. The
        next :meth:`forward` must come after :meth:`reset` (a new conversation)."""
        self.journal.clear()
        self._inflight.clear()
        self._early.clear()
        if self.session is not None and self.sock is not None:
            with contextlib.suppress(Exception):
                self._send(P.Close(self.session))
        self.session = None
        self._broken = True

    def _step_timeout(self) -> TransportError:
        return TransportError(
            f"the trunk server at {self.address} did not finish a step within "
            f"{self.step_timeout_s:g} s",
            hint="the server is overloaded or faulty; try again later (VEIL_STEP_TIMEOUT "
            "sets the limit)",
        )

    def _exchange(self, e: _Entry, want: bool, deadline: float, sent: bool = False) -> P.Result:
        """Send step ``self.step_id`` (unless ``sent``: it went already) and wait for its
        result, pinging while waiting."""
        assert self.session is not None
        sid, step = self.session, self.step_id
        msg = P.Step(sid, step, e.positions, e.parents, e.keep, self.wire_dtype, e.hidden, want)
        sent = sent or self._send(msg)
        now = time.monotonic()
        self._last_heard = now
        last_ping = now
        resend_at: float | None = None  # set when a pong says the step is done but no reply came
        gap = self.heartbeat_s
        pings: set[int] = set()  # only pongs to this exchange's pings describe this step
        while True:
            r, now = self._wait(deadline)
            if now - last_ping >= self.heartbeat_s:
                if not sent:
                    sent = self._send(msg)
                nonce = self._ping(sid)
                if nonce is not None:
                    pings.add(nonce)
                last_ping = now
            if isinstance(r, P.Result) and r.session == sid and r.step == step:
                if want:
                    if r.hidden is None or tuple(r.hidden.shape) != tuple(e.hidden.shape):
                        raise TransportError("the trunk server answered with the wrong shape")
                    check_finite(r.hidden, self.address)
                return r
            if isinstance(r, P.Pong):
                if r.nonce not in pings:
                    continue
                if not r.known:
                    raise _SessionLost("the server no longer has the session")
                if r.in_flight:
                    continue  # being computed; the deadline bounds how long we wait
                if r.last_step < step:
                    sent = self._send(msg)  # our step was lost on the way: send it again
                elif resend_at is None:
                    resend_at = now + gap  # done: its reply may still be on the way
                elif now >= resend_at:
                    # done, but the reply never came: a retry returns the server's cached reply
                    sent = self._send(msg)
                    gap = min(gap * 2, 4.0)
                    resend_at = now + gap
                continue
            if isinstance(r, P.Error):
                if r.session not in (None, sid) or (r.step is not None and r.step != step):
                    continue  # about something older
                if r.code == P.E_UNKNOWN_SESSION:
                    raise _SessionLost(r.message)
                if r.code == P.E_INTERNAL:
                    raise _ServerFault(r.message)
                raise _Refused(self._error_for(r))
            # anything else (stale results, old pongs) is ignored

    def _step(self, e: _Entry, sent: Ticket | None = None) -> torch.Tensor:
        """One protocol step with its budget: recover as allowed, else fail once and clearly.
        ``sent``: the step went already (``submit``, nothing else in flight): only its answer
        is awaited, with the same recovery."""
        budget = StepBudget(deadline=time.monotonic() + self.step_timeout_s)
        t0 = time.perf_counter()
        if sent is not None:
            budget.deadline, t0 = sent.deadline, sent.t0
        try:
            if self.session is None:
                self._recover(budget, None)  # (the time to reach the server extends the deadline)
                sent = None
            self.step_id += 1
            self.journal.append(e)
            while True:
                try:
                    r = self._exchange(e, True, budget.deadline, sent is not None and sent.sent)
                    break
                except (_SessionLost, _ConnectionLost, _ServerFault) as lost:
                    self.journal.pop()
                    self._recover(budget, lost)  # the same deadline, extended by reach time
                    self.step_id += 1
                    self.journal.append(e)
                    sent = None
        except _Refused as ref:  # refused before any change: as if never sent
            if self.journal and self.journal[-1] is e:
                self.journal.pop()
                self.step_id -= 1
            raise ref.error from None
        except BaseException:
            self._abandon()
            raise
        wall_ms = (time.perf_counter() - t0) * 1000.0
        self.round_trips += 1
        self.server_ms += r.server_ms
        self.queue_ms += r.queue_ms
        if r.load is not None:
            self.load = r.load
        self._net_ms.append(max(wall_ms - r.server_ms, 0.0))
        assert r.hidden is not None
        return r.hidden.to(torch.float32, copy=True)  # [b, H] (the frame buffer is not kept)

    def _send_chain(self, entries: list[_Entry]) -> list[torch.Tensor]:
        """The pieces of a chain with several steps in flight (:func:`send_chain`); the results
        of the leading entries it got. After a lost session this reopens one (replaying the
        journal) so the caller can go on step by step."""
        try:
            if self.session is None:  # a new conversation: open its session first
                self._recover(StepBudget(deadline=time.monotonic() + self.step_timeout_s), None)
            got = send_chain(self, entries)
            self.chained_steps += len(got.outs)
            if got.stopped is not None:
                log.info("pipelined prompt steps stopped, going on step by step: %s", got.stopped)
                self._recover(
                    StepBudget(deadline=time.monotonic() + self.step_timeout_s), got.stopped
                )
        except BaseException:
            self._abandon()
            raise
        return got.outs

    def _entries(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: Sequence[int] | None,
        keep: Sequence[int] | None,
    ) -> tuple[list[_Entry], int, int]:
        """A block as protocol steps: (entries, rows, rows of the last entry)."""
        if self.closed:
            raise TransportError("this trunk connection is closed")
        if self._broken:
            raise TransportError(
                "the trunk connection failed during this conversation",
                hint="start a new conversation",
            )
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise TransportError(f"hidden states must be [B, {self.hidden_size}]")
        n = int(hidden.shape[0])
        pos = [int(p) for p in positions.tolist()]
        par = None if parents is None else [int(p) for p in parents]
        kp = translate_keep(None if keep is None else [int(k) for k in keep], self._split_prev)
        wire = hidden.detach().to(device="cpu", dtype=self.wire_torch).contiguous()  # [B, H]
        pieces = chunk_bounds(n, par, self.chunk_rows, P.MAX_BLOCK)
        entries = [
            _Entry(
                pos[rows.start : rows.stop],
                par if len(pieces) == 1 else None,  # a split chain: each piece hangs off the cache
                kp if i == 0 else None,
                wire[rows.start : rows.stop],  # [b, H]
            )
            for i, rows in enumerate(pieces)
        ]
        return entries, n, len(pieces[-1])

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        self._drain()
        return self._run(*self._entries(hidden, positions, parents, keep))

    def _run(self, entries: list[_Entry], n: int, last: int) -> torch.Tensor:
        """A block's steps, waiting for each answer (nothing else in flight)."""
        outs: list[torch.Tensor] = []
        if len(entries) > 1:
            outs = self._send_chain(entries)  # several steps in flight, as far as that goes
        for e in entries[len(outs) :]:  # the rest (or all) one step at a time
            outs.append(self._step(e))
        self._split_prev = (n, last) if len(entries) > 1 else None
        return outs[0] if len(outs) == 1 else torch.cat(outs)  # [B, H]

    def submit(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: Sequence[int] | None = None,
        keep: Sequence[int] | None = None,
    ) -> Ticket:
        """Send a block as the session's next step and return at once; :meth:`collect` takes
        its answer. Blocks are collected in the order they were submitted. A block longer than
        one step goes the synchronous way, after any in flight."""
        entries, n, last = self._entries(hidden, positions, parents, keep)
        if len(entries) > 1:
            self._drain()
            return Ticket(None, out=self._run(entries, n, last))
        self._split_prev = None  # (its keep was translated already)
        try:
            if self.session is None:  # a new conversation: open its session first
                self._recover(StepBudget(deadline=time.monotonic() + self.step_timeout_s), None)
            return submit_step(self, entries[0])
        except _SessionLost:  # could not be sent: sent again, with the others, when collected
            return self._inflight[-1]
        except BaseException:
            self._abandon()
            raise

    def collect(self, ticket: Ticket) -> torch.Tensor:
        """The answer [B, H] of a submitted block (those submitted before it are taken first)."""
        while ticket.out is None:
            head = self._inflight[0]
            assert head.entry is not None
            if len(self._inflight) == 1 and not self._early:
                # alone on the wire: the one-step wait, with its own recovery and errors (a
                # step or a reply lost on the way is sent again on the same session: the
                # server keeps the last reply for a retry)
                self._inflight.clear()
                head.out = self._step(head.entry, head)
                continue
            try:
                try:
                    head.out = await_first(self)
                except (_SessionLost, _ConnectionLost, _ServerFault) as lost:
                    log.info("steps in flight lost, sending them again: %s", lost)
                    redo_in_flight(self)
            except _Refused as ref:  # the session holds the steps before it; later ones refused
                self._drop_in_flight()
                raise ref.error from None
            except BaseException:
                self._abandon()
                raise
        return ticket.out

    def _drain(self) -> None:
        """Take the answers of every step in flight (a synchronous step must come after)."""
        if self._inflight:
            self.collect(self._inflight[-1])

    def _drop_in_flight(self) -> None:
        """Forget the steps in flight; their session is closed (late refusals of its steps
        must not be read as answers to new ones), the next step reopens one and replays."""
        if self._inflight and self.session is not None and self.sock is not None:
            with contextlib.suppress(Exception):
                self._send(P.Close(self.session))
            self.session = None
        self._inflight.clear()
        self._early.clear()

    def reset(self) -> None:
        """Start a new conversation: the next step opens a fresh session, the journal empties."""
        self.journal.clear()
        self._inflight.clear()
        self._early.clear()
        if self.session is not None and self.sock is not None:
            self._send(P.Close(self.session))
        self.session = None
        self._broken = False
        self._split_prev = None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.session is not None and self.sock is not None:
            self._send(P.Close(self.session))
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                try:
                    r = self._recv(deadline - time.monotonic())
                except TransportError:
                    break
                if r is None or isinstance(r, P.Closed):
                    break
        self._destroy()

    def __enter__(self) -> RemoteTrunk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def rtt_ms(self) -> float:
        """Measured network round trip: median of (step wall time - server compute)."""
        if self._net_ms:
            return float(statistics.median(self._net_ms))
        return float(statistics.median(self._ping_ms)) if self._ping_ms else 0.0

    def json_stats(self) -> dict[str, Any]:
        return {
            "round_trips": self.round_trips,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "rtt_ms": round(self.rtt_ms, 3),
            "ping_ms": round(statistics.median(self._ping_ms), 3) if self._ping_ms else None,
            "replays": self.replays,
            "overlapped_steps": self.overlapped_steps,
            "replayed_steps": self.replayed_steps,
            "server_ms": round(self.server_ms, 3),
            "server_queue_ms": round(self.queue_ms, 3),
            "trunk_load": None if self.load is None else dataclasses.asdict(self.load),
            "wire_dtype": self.wire_dtype,
        }
