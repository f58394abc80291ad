"""How the trunk client cuts work into protocol steps, and how long it keeps trying.

Kept apart from the socket code in ``engine.transport.remote`` so the rules read in one place:

* **Chunking.** A protocol step holds at most :data:`engine.protocol.MAX_BLOCK` rows. A long
  *chain* block (a prompt, a re-split's re-prefill) goes as consecutive steps of
  :data:`PREFILL_CHUNK` rows: each step attends to everything cached before it, which for a
  chain is exactly the prefix, so the result is the same computation. A tree block cannot be
  cut that way (a later piece would attend to sibling branches), so it must fit one step.
* **Budgets.** Every step has one overall deadline (``step_timeout_s``). Recovering a step —
  reopening a session and replaying the journal — is bounded three ways: the server may lose
  the session at most ``max_session_losses`` times, fail with ``internal`` at most
  ``max_faults`` times, and reaching it again may take at most ``reconnect_s`` from the first
  loss. Attempts back off exponentially. So a server that misbehaves in any of these ways ends
  the client with one error instead of a retry storm.
* **Sanity.** Activations that come back must be finite: NaN/Inf is a server fault, never text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.errors import TransportError
from engine.model import is_chain

# Rows per step when a long chain block is split: a multiple of the 256-row pieces the server's
# chunked prefill computes, and small enough that one step stays well under a second of server
# work on the default model while still amortizing the round trip.
PREFILL_CHUNK = 512


def chunk_bounds(n: int, parents: Sequence[int] | None, chunk: int, limit: int) -> list[range]:
    """Row ranges, one per protocol step, for a block of ``n`` nodes.

    A chain longer than ``chunk`` is cut into ``chunk``-row pieces; anything else goes whole and
    must fit ``limit`` (the protocol's block cap)."""
    if n > chunk and is_chain(parents):
        return [range(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
    if n > limit:
        raise TransportError(
            f"a tree block of {n} nodes is larger than the protocol allows ({limit})",
            hint="use a smaller speculative tree",
        )
    return [range(n)]


def translate_keep(keep: list[int] | None, prev: tuple[int, int] | None) -> list[int] | None:
    """``keep`` of the caller's previous block, in terms of what the server saw.

    When the previous block went as several steps, the server's "previous block" is its last
    step (``prev = (rows in the block, rows in its last step)``); the rows of the earlier steps
    are already part of the cache and cannot be dropped any more."""
    if keep is None or prev is None:
        return keep
    total, last = prev
    head = total - last
    if keep[:head] != list(range(head)):
        raise TransportError("cannot drop rows of an earlier step of a long block")
    return [k - head for k in keep[head:]]


@dataclass
class StepBudget:
    """What one step may still spend; created when the step starts."""

    deadline: float  # monotonic time by which the step's result must be in
    attempts: int = 0  # recoveries so far
    losses: int = 0  # of which the server had lost the session
    faults: int = 0  # of which the server reported `internal`
    recovery_until: float | None = None  # reconnect window, fixed at the first loss


def backoff_s(attempt: int, first: float = 0.25, cap: float = 4.0) -> float:
    """Wait before recovery attempt ``attempt`` (1-based): none for the first, then doubling."""
    return 0.0 if attempt <= 1 else min(first * 2 ** (attempt - 2), cap)


def check_finite(t: torch.Tensor, address: str) -> None:
    """Refuse activations with NaN or Inf (cheap: one pass over the reply)."""
    if not bool(torch.isfinite(t).all()):
        raise TransportError(
            f"the trunk server at {address} sent invalid activations (NaN or infinity)",
            hint="the server is faulty; tell its admin (this reply was not used)",
        )
