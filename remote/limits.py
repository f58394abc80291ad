"""What one client key may take from the trunk server's socket thread (pure: the caller passes
the clock, and does the sending and dropping).

* **queued rows** — a key may have as many rows waiting to be computed as one full step
  (4,096 rows) for each session it may hold; a step beyond that is refused ``busy``.
* **silence** — a session with steps queued whose client has said nothing (not even the ping a
  waiting client sends every heartbeat) for ``--silent`` seconds is dropped with its queued
  work: its client left, and nobody would read the result.

Two more things a key could otherwise take without limit, each a token bucket per key:

* **checking its messages** — the socket thread's CPU time spent decoding and validating a key's
  messages. A key in debt has its next messages dropped unread (as if lost on the network; a
  real client re-sends a lost step when its heartbeat says so) until the bucket refills, so one
  key flooding cheap-to-send, costly-to-check messages cannot slow the thread down for the
  others.
* **re-sent replies** — bytes of cached results sent again to a client that re-sent a step it
  already had an answer to. A real client does that only after a reply was lost; more re-sends
  than the bucket allows are dropped, and the client's next re-send, a little later, gets it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine import protocol as P

if TYPE_CHECKING:
    from remote.server import Session

CHECK_BURST_S = 1.0  # socket-thread CPU seconds one key may spend at once checking its messages
CHECK_SHARE = 0.2  # ... and per second in the long run (a fifth of a core)
RESEND_REPLIES = 2  # re-sent replies one key may fetch at once, counted as the largest reply
RESEND_REFILL_S = 10.0  # ... and one more every this many seconds


class KeyBuckets:
    """A token bucket per key: ``capacity`` at most, refilled at ``rate`` per second. Keys whose
    bucket is full are forgotten first when more than ``max_keys`` are remembered."""

    def __init__(self, capacity: float, rate: float, max_keys: int = 4096) -> None:
        if capacity <= 0 or rate <= 0:
            raise ValueError("a bucket needs a positive capacity and rate")
        self.capacity = capacity
        self.rate = rate
        self.max_keys = max_keys
        self._level: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def level(self, key: str, now: float) -> float:
        """What ``key`` may spend now (negative: in debt)."""
        v = self._level.get(key)
        if v is None:
            return self.capacity
        left, at = v
        return min(self.capacity, left + (now - at) * self.rate)

    def allows(self, key: str, now: float) -> bool:
        """Is ``key`` out of debt?"""
        return self.level(key, now) > 0

    def take(self, key: str, amount: float, now: float) -> bool:
        """Spend ``amount`` if the bucket holds that much (True), else spend nothing (False)."""
        left = self.level(key, now)
        if amount > left:
            return False
        self._set(key, left - amount, now)
        return True

    def charge(self, key: str, amount: float, now: float) -> None:
        """Spend ``amount`` whatever is left (the bucket may go into debt)."""
        self._set(key, self.level(key, now) - amount, now)

    def _set(self, key: str, left: float, now: float) -> None:
        self._level[key] = (left, now)
        self._level.move_to_end(key)
        if len(self._level) > self.max_keys:
            for k in [k for k in self._level if self.level(k, now) >= self.capacity]:
                del self._level[k]
            while len(self._level) > self.max_keys:
                self._level.popitem(last=False)


class ClientLimits:
    """The per-key limits of one server (see the module docstring)."""

    def __init__(self, hidden_size: int, sessions_per_client: int) -> None:
        biggest = P.MAX_BLOCK * hidden_size * 4 + P.MAX_HEADER_BYTES  # the largest reply
        self.resends = KeyBuckets(RESEND_REPLIES * biggest, biggest / RESEND_REFILL_S)
        self.checks = KeyBuckets(CHECK_BURST_S, CHECK_SHARE)
        self.max_queued_rows = P.MAX_BLOCK * sessions_per_client

    def queue_refusal(self, sessions: Iterable[Session], s: Session, rows: int) -> str | None:
        """Why ``rows`` more rows of session ``s`` may not queue (None: they may)."""
        queued = sum(x.queued_rows for x in sessions if x.client == s.client)
        if queued + rows <= self.max_queued_rows:
            return None
        return (
            f"server busy: this computer has {queued} rows waiting to be computed (the "
            f"per-client limit is {self.max_queued_rows}); wait for its steps to finish"
        )

    def resend(self, s: Session, m: P.Step, now: float) -> bool | tuple[str, str]:
        """A step sent again, after its reply was lost: send the cached reply again (True), say
        nothing (False: it is still being computed and its reply is on the way, or the key's
        re-sent replies are over budget — the client's next re-send gets it), or refuse it
        (code, message). The re-send must be the answered step's size, so a client never gets
        back more than it sends."""
        if s.in_flight or not s.reply:
            return False
        if m.hidden.shape[0] != s.prev_block:
            return P.E_SHAPE, f"step {m.step} was {s.prev_block} rows; a re-send must be the same"
        return self.resends.take(s.client, sum(memoryview(f).nbytes for f in s.reply), now)

    @staticmethod
    def to_reap(
        live: Iterable[Session], now: float, ttl: float, silent: float
    ) -> list[tuple[Session, str]]:
        """Sessions to drop, and why: no step for ``ttl`` seconds (pings do not count), or steps
        queued and not a word from the client for ``silent`` seconds."""
        out = []
        for s in live:
            if s.in_flight == 0 and now - s.last_used > ttl:
                out.append((s, f"expired after {ttl:g} s idle (no step)"))
            elif s.in_flight and now - s.last_heard > silent:
                why = f"dropped with {s.in_flight} step(s) queued: its client went silent"
                out.append((s, why))
        return out


def with_admin(
    allowed: Callable[[str], bool] | None, admin: str | None
) -> Callable[[str], bool] | None:
    """The allow-list, plus the server's own public key (the admin's)."""
    if admin is None:
        return allowed
    return _WithAdmin(allowed, admin)


class _WithAdmin:
    """An allow-list that also admits ``admin``; its read trouble stays visible
    (``failing``, remote/allowlist.py) so a handshake is never refused because of it."""

    def __init__(self, allowed: Callable[[str], bool] | None, admin: str) -> None:
        self.allowed = allowed
        self.admin = admin

    @property
    def failing(self) -> object | None:
        return getattr(self.allowed, "failing", None)

    def __call__(self, key: str) -> bool:
        return key == self.admin or (self.allowed is not None and self.allowed(key))
