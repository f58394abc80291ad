"""Decode steps in flight: a step sent now and its answer taken later, so that the speculative
decoder can send round r+1 while round r is still on the wire (``RemoteTrunk.submit`` /
``RemoteTrunk.collect``; docs/protocol.md "Rounds in flight").

The server runs a session's steps in order and queues a few (``remote.server.MAX_IN_FLIGHT``),
so nothing new is needed on the wire: these are ordinary steps, sent before the previous answer
is back. The bookkeeping follows :func:`engine.transport.steps.send_chain`: the journal holds
exactly the steps whose answers arrived, so whatever goes wrong with the steps in flight the
state is known —

* a refused step changed nothing, and the steps after it are refused as out of order: the
  in-flight steps are dropped (the session keeps every step before them) and the refusal is
  the caller's error;
* a lost session or connection, or a server fault: that session is closed, and each step still
  in flight is sent again one at a time with the usual recovery (a new session that replays the
  journal first, within the step's budget).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine import protocol as P
from engine.errors import TransportError
from engine.transport.policy import check_finite
from engine.transport.steps import Entry, Refused, SessionLost, check_loss

if TYPE_CHECKING:
    from engine.transport.remote import RemoteTrunk


@dataclass
class Ticket:
    """One step sent by ``submit``: its entry, step id and deadline; ``out`` once answered (or
    at once, for a block that went the synchronous way)."""

    entry: Entry | None
    step: int = -1
    deadline: float = 0.0
    t0: float = 0.0
    alone: bool = True  # nothing else was in flight when it was sent (a true round trip)
    out: torch.Tensor | None = None
    sent: bool = False  # its message left (False: sent again when awaited)


def submit_step(trunk: RemoteTrunk, e: Entry) -> Ticket:
    """Send ``e`` as the session's next step without waiting (the session must be open)."""
    assert trunk.session is not None
    inflight = trunk._inflight
    step = trunk.step_id + 1 + len(inflight)
    t = Ticket(e, step, time.monotonic() + trunk.step_timeout_s, time.perf_counter(), not inflight)
    msg = P.Step(trunk.session, step, e.positions, e.parents, e.keep, trunk.wire_dtype, e.hidden)
    inflight.append(t)
    trunk.overlapped_steps += not t.alone
    t.sent = trunk._send(msg)
    if not t.sent:
        raise SessionLost("a step could not be sent")
    return t


def await_first(trunk: RemoteTrunk) -> torch.Tensor:
    """Wait for the oldest step in flight, keep the answers of later ones that arrive first,
    and journal it; raises the transport's loss/refusal exceptions (see the module docstring)."""
    sid = trunk.session
    assert sid is not None
    t = trunk._inflight[0]
    assert t.entry is not None
    steps = {f.step for f in trunk._inflight}
    last_ping = time.monotonic()
    pings: set[int] = set()
    r: P.Result | P.Error | None = trunk._early.pop(t.step, None)
    while r is None:
        msg, now = trunk._wait(t.deadline)
        if now - last_ping >= trunk.heartbeat_s:
            nonce = trunk._ping(sid)
            if nonce is not None:
                pings.add(nonce)
            last_ping = now
        if isinstance(msg, P.Result) and msg.session == sid:
            if msg.step == t.step:
                r = msg
            elif msg.step in steps:
                trunk._early[msg.step] = msg
        elif isinstance(msg, P.Pong) and msg.nonce in pings:
            pings.discard(msg.nonce)
            if not msg.known:
                raise SessionLost("the server no longer has the session")
            if msg.last_step < t.step and not msg.in_flight:
                raise SessionLost("a step in flight was lost on the way")
        elif isinstance(msg, P.Error) and msg.session in (None, sid):
            check_loss(msg)
            if msg.step == t.step:
                r = msg
            elif msg.step in steps:
                trunk._early[msg.step] = msg  # refused: raised when that step is awaited
    if isinstance(r, P.Error):
        raise Refused(trunk._error_for(r))
    if r.hidden is None or tuple(r.hidden.shape) != tuple(t.entry.hidden.shape):
        raise TransportError("the trunk server answered with the wrong shape")
    check_finite(r.hidden, trunk.address)
    trunk._inflight.pop(0)
    trunk.journal.append(t.entry)
    trunk.step_id = t.step
    trunk.round_trips += 1
    trunk.server_ms += r.server_ms
    trunk.queue_ms += r.queue_ms
    if r.load is not None:
        trunk.load = r.load
    if t.alone:
        wall_ms = (time.perf_counter() - t.t0) * 1000.0
        trunk._net_ms.append(max(wall_ms - r.server_ms, 0.0))
    return r.hidden.to(torch.float32, copy=True)  # [B, H]


def redo_in_flight(trunk: RemoteTrunk) -> None:
    """After a loss: close that session and run every step still in flight again, one at a
    time through ``trunk._step`` (which reopens a session and replays the journal first)."""
    if trunk.session is not None:
        trunk._send(P.Close(trunk.session))
    trunk.session = None
    pending, trunk._inflight = trunk._inflight, []
    trunk._early.clear()
    for t in pending:
        assert t.entry is not None
        t.out = trunk._step(t.entry)
