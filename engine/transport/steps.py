"""Protocol steps of a trunk session: what a step carries, how one fails, and the pipelined send
of a long chain block (a prompt) — used by :class:`engine.transport.remote.RemoteTrunk`.

**Pipelined chains.** A prompt longer than a protocol step goes as consecutive steps (see
``engine.transport.policy``). Sent one after another, each costs a round trip on top of the
server's work: 16 round trips for an 8k-token prompt at 512 rows a step. The server runs a
session's steps in order and accepts a few queued ones (``remote.server.MAX_IN_FLIGHT``), so
:func:`send_chain` keeps up to :data:`CHAIN_WINDOW` steps in flight and collects their
results in order: the link and the server stay busy, and the rows are the same computation.

When anything goes wrong in flight the state is still known exactly, and the caller finishes
the block one step at a time with the usual recovery:

* a refused step (busy, out of order, context full...) changed nothing and every later step
  is refused as out of order, so once the results before it arrive the caller resumes at it;
* a lost session or connection, or a server fault, leaves the steps after the last result
  unknown: that session is closed and the caller reopens one, replaying its journal (which
  holds exactly the steps whose results arrived).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine import protocol as P
from engine.errors import TransportError, VeilError
from engine.transport.policy import check_finite

if TYPE_CHECKING:
    from engine.transport.remote import RemoteTrunk

CHAIN_WINDOW = 3  # steps of one chain in flight (the server queues up to 4 per session)


@dataclass
class Entry:
    positions: list[int]
    parents: list[int] | None
    keep: list[int] | None
    hidden: torch.Tensor  # [B, H] in the wire dtype, exactly as sent


class SessionLost(Exception):
    """The server no longer has our session: reopen and replay."""


class ConnectionLost(Exception):
    """The server has been silent too long: rebuild the socket, reopen and replay."""


class ServerFault(Exception):
    """The server failed on the step (``internal``): retried at most ``max_faults`` times."""


class Refused(Exception):
    """The server refused the step before changing anything; ``error`` is for the user."""

    def __init__(self, error: VeilError) -> None:
        super().__init__(str(error))
        self.error = error


class NoAnswer(TransportError):
    """An open got no answer in time (server down, unreachable, or a key mismatch)."""


def check_loss(err: P.Error) -> None:
    """Raise the loss a server error means for steps in flight; return for a refusal of one
    step (an error that names it)."""
    if err.code == P.E_UNKNOWN_SESSION:
        raise SessionLost(err.message)
    if err.code == P.E_INTERNAL:
        raise ServerFault(err.message)
    if err.step is None:  # about no step in particular: start over on a new session
        raise SessionLost(err.message)


@dataclass
class ChainOutcome:
    """What :func:`send_chain` got: the results of the first ``len(outs)`` entries (each also
    journaled), and why it stopped early (None: it did not; a refusal: resume at the next
    entry on the same session; a loss: the session was closed, reopen and replay)."""

    outs: list[torch.Tensor]
    stopped: Exception | None = None
    refused: bool = False


def send_chain(trunk: RemoteTrunk, entries: list[Entry]) -> ChainOutcome:
    """Send ``entries`` (consecutive pieces of one chain) with up to :data:`CHAIN_WINDOW` in
    flight on the trunk's open session and collect their results in order; see the module
    docstring for how it stops. Each result's wait has the trunk's step timeout."""
    assert trunk.session is not None
    sid, first, n = trunk.session, trunk.step_id + 1, len(entries)
    outs: list[torch.Tensor | None] = [None] * n
    got = sent = 0
    limit = n  # entries before the first refused one
    deadline = time.monotonic() + trunk.step_timeout_s
    t0 = time.perf_counter()
    last_ping = time.monotonic()
    pings: dict[int, int] = {}  # ping nonce -> entries sent before it
    done: list[torch.Tensor] = []

    def take(i: int, r: P.Result) -> None:
        if r.hidden is None or tuple(r.hidden.shape) != tuple(entries[i].hidden.shape):
            raise TransportError("the trunk server answered with the wrong shape")
        check_finite(r.hidden, trunk.address)
        outs[i] = r.hidden.to(torch.float32, copy=True)  # [b, H]
        trunk.server_ms += r.server_ms
        trunk.queue_ms += r.queue_ms
        if r.load is not None:
            trunk.load = r.load

    drain: int | None = None  # after a refusal: a ping whose pong follows every late refusal

    try:
        while got < limit or limit < sent:
            if got >= limit and drain is None:
                # the steps sent after the refused one are refused too; the server answers in
                # order, so once this ping's pong is back no late refusal can reach the caller
                drain = trunk._ping(sid)
            while drain is None and sent < limit and sent - got < CHAIN_WINDOW:
                e = entries[sent]
                msg = P.Step(
                    sid,
                    first + sent,
                    e.positions,
                    e.parents,
                    e.keep,
                    trunk.wire_dtype,
                    e.hidden,
                    True,
                )
                if not trunk._send(msg):
                    break
                sent += 1
            r, now = trunk._wait(deadline)
            if now - last_ping >= trunk.heartbeat_s:
                nonce = trunk._ping(sid)
                if nonce is not None:
                    pings[nonce] = sent
                last_ping = now
            if isinstance(r, P.Result) and r.session == sid and first <= r.step < first + sent:
                i = r.step - first
                if outs[i] is None:
                    take(i, r)
                while got < limit and outs[got] is not None:
                    if got == 0:  # the first step waited for nothing else: a true round trip
                        wall_ms = (time.perf_counter() - t0) * 1000.0
                        trunk._net_ms.append(max(wall_ms - r.server_ms, 0.0))
                    out = outs[got]
                    assert out is not None
                    done.append(out)
                    trunk.journal.append(entries[got])
                    trunk.step_id = first + got
                    trunk.round_trips += 1
                    got += 1
                    deadline = time.monotonic() + trunk.step_timeout_s
            elif isinstance(r, P.Pong) and r.nonce == drain:
                break
            elif isinstance(r, P.Pong) and r.nonce in pings:
                before = pings.pop(r.nonce)
                if not r.known:
                    raise SessionLost("the server no longer has the session")
                if r.last_step - first + 1 < min(before, limit) and not r.in_flight:
                    raise SessionLost("a step of the prompt was lost on the way")
            elif isinstance(r, P.Error) and r.session in (None, sid):
                check_loss(r)
                assert r.step is not None
                if first + got <= r.step < first + limit:
                    limit = r.step - first  # not accepted, nor anything after it
        return ChainOutcome(done, None, refused=limit < n)
    except (SessionLost, ConnectionLost, ServerFault) as lost:
        # the steps after the last result are in an unknown state: give that session up
        trunk._send(P.Close(sid))
        trunk.session = None
        return ChainOutcome(done, lost)
