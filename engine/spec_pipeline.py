"""Rounds in flight: while round r is on the wire, bet on its outcome and send round r+1.

A drafted round r sends the first ``n`` nodes of a best-first proposal (``engine.drafts``). A
proposal node ``i`` not sent whose parent ``e`` was sent (or is the root) is a *bet*: if the walk
ends at ``e`` and the model's next token is node ``i``'s token, that token is round r's bonus
token and node ``i``'s subtree in the proposal is what round r+1 would verify. The drafter's
estimate of that outcome is node ``i``'s path probability, calibrated online by the bets seen
(:class:`HitCalibration`). No drafting call happens while the round is in flight (a learned
head cannot draft from an unverified context anyway).

Round r+1 (:func:`plan_ahead`) is an ordinary step sent before r's answer. It keeps only the
root of round r's block (``keep`` = the root and any rows sent again before it), and its block
is a tree hanging off that root: the bets, their subtrees, and the sent nodes on the way to
them again (their rows are computed again, with the same bits, as every row is computed the
same way whatever block it is in). Bets are taken while each pays (:func:`plan_ahead`: a hit
saves about a round's fixed and drafting cost; a lost bet's rows cost ``b`` each; in office
seconds under load).

When r's answer comes (:func:`settle`), either a bet won — its row and subtree are verified at
once, two rounds for about one round trip — or none did: r+1's answer is dropped, and the next
round keeps the rows of r+1 that lie on r's true path and sends the rest of that path as a
*chain* of rows before its root. Nothing else changes: the server sees ordinary steps (replays
and reconnects as before), each committed token is still chosen by the same rule from the same
logits, and so the output is exactly the sequential one (greedy and sampling).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.drafts import DraftTree
from engine.drafts.tree import MergedCalibration
from engine.spec_cost import CostModel
from engine.split import InFlight, SplitRunner

EXTRA_NODES = 16  # nodes proposed beyond what a round sends, to draw round r+1 from


@dataclass
class Ahead:
    """Round r+1's block: ``tree`` hangs off round r's root; ``source[j]`` is the proposal node
    of its node ``j``; ``bets``: its nodes that are bets, with their estimates."""

    tree: DraftTree
    source: list[int]
    bets: dict[int, float]


def frontier(proposal: DraftTree, sent: int) -> list[int]:
    """The bets a round of ``proposal.prefix(sent)`` allows: nodes not sent whose parent was,
    most likely first (a best-first order puts them so already)."""
    return [i for i in range(sent, len(proposal)) if proposal.parents[i] < sent]


def plan_ahead(
    proposal: DraftTree,
    sent: int,
    depth_room: int,
    price: tuple[float, float] | None,
    calibrate: Callable[[float], float] = float,
) -> Ahead | None:
    """The bets worth sending ahead of a round that sent ``proposal.prefix(sent)``: in order of
    likelihood, each with the rows it adds (itself, its subtree within ``depth_room`` of the
    root, and the sent nodes on the way not yet in the block), kept while
    ``p * a > (1 - p) * rows * b`` for ``price = (a, b)``, ``p = calibrate(estimate)`` (a won
    bet saves ``a``; the rows replace the next round's then, and are lost otherwise; None:
    every bet). None: no bet."""
    depths = proposal.depths()
    probs = proposal.path_probs()
    parents = proposal.parents
    taken: set[int] = set()
    bets: dict[int, float] = {}
    for i in frontier(proposal, sent):
        if depths[i] > depth_room:
            continue
        new = []  # the sent nodes on the way not in the block yet, the bet, its subtree
        up = parents[i]
        while up >= 0 and up not in taken:
            new.append(up)
            up = parents[up]
        inside = {i}
        for j in range(i + 1, len(proposal)):
            if parents[j] in inside and depths[j] <= depth_room:
                inside.add(j)
        new += inside
        p = calibrate(probs[i])
        if price is not None and not p * price[0] > (1.0 - p) * len(new) * price[1]:
            continue
        taken.update(new)
        bets[i] = probs[i]
    if not bets:
        return None
    order = sorted(taken)  # a best-first order is topological
    where = {t: j for j, t in enumerate(order)}
    tree = DraftTree()
    for t in order:
        p = parents[t]
        tree.add(proposal.tokens[t], where[p] if p >= 0 else -1, proposal.probs[t])
    return Ahead(tree, order, {where[i]: p for i, p in bets.items()})


@dataclass
class Settled:
    """Round r+1 after round r's outcome. A won bet (``won``): the block's rows ``rows`` (the
    bet's row, then its subtree's in ``tree``'s order) are verified as a round whose tree is
    ``tree`` (rooted at the bonus), after ``kept`` (the block's rows of r's path). Otherwise
    ``kept`` are the block rows on r's path to keep, and ``chain`` the path's tokens still to
    send again."""

    won: int | None
    kept: list[int]
    rows: list[int]
    tree: DraftTree
    chain: list[int]


def settle(ahead: Ahead, proposal: DraftTree, walked: list[int], bonus: int) -> Settled:
    """Round r walked the proposal's nodes ``walked`` (from the root's child down) and chose
    ``bonus`` next: which bet won, if any, and what of round r+1's block the caches keep."""
    where = {t: j for j, t in enumerate(ahead.source)}
    kept: list[int] = []
    for t in walked:
        if t not in where:
            break
        kept.append(where[t])
    parent = kept[-1] if kept else -1
    if len(kept) == len(walked):
        for j in ahead.bets:
            if ahead.tree.parents[j] == parent and ahead.tree.tokens[j] == bonus:
                sub = subtree(ahead.tree, j)
                rows = [j, *_descendants(ahead.tree, j)]
                return Settled(j, kept, rows, sub, [])
    chain = [proposal.tokens[t] for t in walked[len(kept) :]]
    return Settled(None, kept, [], DraftTree(), chain)


def subtree(tree: DraftTree, node: int) -> DraftTree:
    """The nodes below ``node`` as a tree of their own (``node``'s children hang off its root),
    in the same order."""
    out = DraftTree()
    where = {node: -1}
    for i in range(node + 1, len(tree)):
        p = tree.parents[i]
        if p in where:
            where[i] = out.add(tree.tokens[i], where[p], tree.probs[i], tree.keys[i])
    return out


def _descendants(tree: DraftTree, node: int) -> list[int]:
    """The nodes below ``node``, in the tree's order (the order :func:`subtree` keeps)."""
    below = {node}
    out = []
    for i in range(node + 1, len(tree)):
        if tree.parents[i] in below:
            below.add(i)
            out.append(i)
    return out


@dataclass
class AheadRound:
    """Round r+1, sent while round r was on the wire, and its bets (settled once r is back)."""

    plan: Ahead
    flight: InFlight
    won: Settled | None = None


def start_round(
    runner: SplitRunner,
    chain: Sequence[int],
    tree: DraftTree,
    root: int,
    root_pos: int,
    keep: Sequence[int] | None,
) -> InFlight:
    """Send a round's block: ``chain`` (committed tokens whose rows are sent again, ending just
    before the root), then the root and its tree."""
    m = len(chain)
    ids, parents = tree.block(root)
    positions = [root_pos - m + i for i in range(m)] + [root_pos]
    positions += [root_pos + d for d in tree.depths()]
    parents = [*range(-1, m - 1), *(p + m if p >= 0 else m - 1 for p in parents)]
    return runner.start([*chain, *ids], positions, parents, keep)


def send_ahead(
    runner: SplitRunner,
    proposal: DraftTree,
    sent: int,
    where: tuple[int, int, int],
    cost: CostModel,
    hits: HitCalibration,
    pipe: str,
) -> AheadRound | None:
    """Bet on the outcome of the round just sent — the first ``sent`` nodes of ``proposal``;
    ``where`` = (its root's position, the tokens it may still commit, its chain rows) — and
    send the round that follows, or None when no bet pays (``pipe`` "always": every bet)."""
    root_pos, room, m = where
    a, b = cost.coefficients()
    # a won bet saves the next round's drafting and fixed cost (its rows are paid either way)
    price = None if pipe == "always" else cost.office_line(a + cost.draft_s, b)
    plan = plan_ahead(proposal, sent, room, price, hits)
    if plan is None:
        return None
    positions = [root_pos + d for d in plan.tree.depths()]
    # it keeps the round's chain and root; its nodes hang off that root
    flight = runner.start(plan.tree.tokens, positions, plan.tree.parents, list(range(m + 1)))
    return AheadRound(plan, flight)


class HitCalibration(MergedCalibration):
    """How often bets with a given estimate were exact (the drafter's path probabilities
    overstate its chances, as :class:`MergedCalibration` explains)."""
