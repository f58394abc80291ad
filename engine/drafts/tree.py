"""Draft trees, the verification record the sources learn from, and the merger.

A draft tree hangs off the *root* — the last committed token, which is not yet in the caches.
Its nodes are in topological order (``parents[i] < i``, ``-1`` = child of the root), and each
node carries an estimate of P(node's token is the target | its parent was accepted).

:class:`TreeDrafter` unions the sources' trees into one, turns each source's raw confidence into
a calibrated acceptance probability learned online from verification results
(:class:`Calibrator`), and keeps the ``budget`` nodes with the highest path probability
(best-first, so any prefix of the result is itself a valid tree and the expected accepted length
of a prefix is known).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class DraftTree:
    """Draft nodes below the root: ``tokens[i]`` hangs off ``parents[i]`` (-1 = the root).

    ``probs[i]``: estimated P(tokens[i] is accepted | its parent is accepted).
    ``keys[i]``: what the node's source knows about it, used to calibrate ``probs`` online.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    keys: list[Hashable] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, prob: float, key: Hashable = None) -> int:
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not an earlier node")
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.probs.append(float(prob))
        self.keys.append(key)
        return len(self.tokens) - 1

    def path_probs(self) -> list[float]:
        """P(node is accepted) = product of the conditional estimates along its path."""
        out: list[float] = []
        for p, q in zip(self.parents, self.probs, strict=True):
            out.append(q * (out[p] if p >= 0 else 1.0))
        return out

    def depths(self) -> list[int]:
        out: list[int] = []
        for p in self.parents:
            out.append(out[p] + 1 if p >= 0 else 1)
        return out

    def prefix(self, n: int) -> DraftTree:
        """The first ``n`` nodes (a valid tree: parents come first)."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.probs[:n], self.keys[:n])

    def block(self, root: int) -> tuple[list[int], list[int]]:
        """Token ids and parents of the verification block [root, nodes...]."""
        return [root, *self.tokens], [-1, *(p + 1 for p in self.parents)]


@dataclass
class Verified:
    """What one verification round showed, for the sources to learn from.

    ``tokens``/``parents``: the block (index 0 = root, parents[0] = -1). ``topk_ids`` and
    ``topk_probs`` [B, k]: the model's most likely next tokens after every node (softmax of the
    raw logits). ``root_index``: where the root sits in ``context``. ``targets[i]``: the token
    chosen after node i, for the nodes on the accepted path (``path``, block indices starting
    at 0); other nodes are absent. ``hidden`` [B, 3H] (optional): the block's hidden states
    after ``hidden_layers`` decoder layers (head, trunk, final; see
    :class:`engine.split.BlockStates`), for a learned draft head.

    The prompt's prefill is reported the same way: the prompt is a chain whose every node is
    "accepted" and whose last target is the first generated token.
    """

    context: Sequence[int]
    tokens: list[int]
    parents: list[int]
    topk_ids: torch.Tensor
    topk_probs: torch.Tensor
    path: list[int]
    targets: dict[int, int]
    root_index: int = -1  # index of the root in ``context``
    hidden: torch.Tensor | None = None
    hidden_layers: tuple[int, int, int] | None = None


Child = tuple[int, float, Hashable]  # (token, raw probability, calibration key)


@runtime_checkable
class DraftSource(Protocol):
    """Proposes a tree after ``context`` (whose last token is the root) and learns."""

    name: str

    def propose(self, context: Sequence[int], budget: int) -> DraftTree: ...

    def observe(self, verified: Verified) -> None: ...

    def reset(self) -> None:
        """Forget per-conversation state (a new prompt follows)."""
        ...


@runtime_checkable
class NodeSource(DraftSource, Protocol):
    """A source that can extend any node of a shared tree: :class:`TreeDrafter` asks every such
    source for the children of every node it expands, so one tree mixes all of them (a suffix
    continuation can be extended by recycled successors and the other way round)."""

    def prepare(self, context: Sequence[int]) -> None:
        """Called once per round before :meth:`children`."""
        ...

    def children(self, seq: Sequence[int], depth: int) -> list[Child]:
        """Likely next tokens after ``seq`` (the context followed by a draft path). A token may
        be listed more than once with different keys (several pieces of evidence); the drafter
        calibrates each and combines them."""
        ...


def bucket(x: float, edges: Sequence[float]) -> int:
    """Index of the first edge above ``x`` (calibration keys bucket raw probabilities)."""
    for i, e in enumerate(edges):
        if x < e:
            return i
    return len(edges)


def best_first(
    context: Sequence[int],
    budget: int,
    expand: Callable[[Sequence[int], int], list[Child]],
    max_depth: int = 16,
) -> tuple[DraftTree, list[Hashable]]:
    """Grow a tree best-first by path probability, asking ``expand(context + path, depth)`` for
    the children of each node as it is taken. Returns the tree and each node's key."""
    tree = DraftTree()
    heap: list[tuple[float, int, int, int, float]] = []  # (-path p, id, token, parent, q)
    keys: dict[int, Hashable] = {}
    counter = 0
    seqs: list[list[int]] = []

    def push(seq: Sequence[int], path_p: float, parent: int, depth: int) -> None:
        nonlocal counter
        if depth > max_depth:
            return
        for t, q, key in expand(seq, depth):
            counter += 1
            keys[counter] = key
            heapq.heappush(heap, (-path_p * q, counter, t, parent, q))

    base = list(context)
    push(base, 1.0, -1, 1)
    while heap and len(tree) < budget:
        neg, cnt, t, parent, q = heapq.heappop(heap)
        idx = tree.add(t, parent, q, keys.pop(cnt))
        seq = [*(seqs[parent] if parent >= 0 else base), t]
        seqs.append(seq)
        push(seq, -neg, idx, len(seq) - len(base) + 1)
    return tree, tree.keys


class Calibrator:
    """Online P(accepted | parent accepted) per (source, key), with the source's own estimate as a
    prior worth ``prior_weight`` observations."""

    def __init__(self, prior_weight: float = 4.0) -> None:
        self.prior_weight = prior_weight
        self.stats: dict[tuple[str, Hashable], list[float]] = {}

    def estimate(self, source: str, key: Hashable, prior: float) -> float:
        s = self.stats.get((source, key))
        if s is None:
            return prior
        hits, n = s
        return (hits + self.prior_weight * prior) / (n + self.prior_weight)

    def update(self, source: str, key: Hashable, hit: bool) -> None:
        s = self.stats.setdefault((source, key), [0.0, 0.0])
        s[0] += float(hit)
        s[1] += 1.0


class MergedCalibration:
    """Online map from a node's combined estimate to how often such nodes were accepted.

    Each source's estimates are calibrated per key (:class:`Calibrator`), but combining several
    sources' estimates for one token (as independent evidence, which they are not) and picking
    the best candidates out of many (the ones whose estimate happened to be high) still
    overstates a node's chance: measured on the default model, tree nodes whose combined
    estimate was 0.15 were accepted 4 % of the time and 0.45 ones 18 %, and a round's path
    probabilities promised 6.1 accepted nodes where 2.4 came. The cost model sizes the tree by
    those numbers, so this second stage learns, per bucket of the combined estimate, the
    acceptance rate actually seen (the estimate itself is the prior, worth ``prior_weight``
    observations)."""

    def __init__(self, buckets: int = 20, prior_weight: float = 8.0) -> None:
        self.buckets = buckets
        self.prior_weight = prior_weight
        self.hits = [0.0] * buckets
        self.seen = [0.0] * buckets

    def _bucket(self, q: float) -> int:
        return min(max(int(q * self.buckets), 0), self.buckets - 1)

    def __call__(self, q: float) -> float:
        b = self._bucket(q)
        return (self.hits[b] + self.prior_weight * q) / (self.seen[b] + self.prior_weight)

    def update(self, q: float, hit: bool) -> None:
        b = self._bucket(q)
        self.hits[b] += float(hit)
        self.seen[b] += 1.0


Contrib = list[tuple[str, Hashable, float]]  # (source, key, raw probability) behind a node


def _at_most_one(probs: list[float]) -> list[float]:
    """Siblings' acceptance estimates, scaled down together when they add up to more than 1
    (at most one child of a node is the target)."""
    total = sum(probs)
    return [p / total for p in probs] if total > 1.0 else probs


class TreeDrafter:
    """One tree from several sources under a node budget.

    Best-first by calibrated path probability: every :class:`NodeSource` is asked for the
    children of every node taken, sources that only ``propose`` whole trees contribute their
    trees' nodes; a child proposed by several sources gets ``1 - prod(1 - p_source)`` with each
    ``p_source`` calibrated online from verification. Best-first order means any prefix of the
    result is a valid tree whose expected accepted length is the sum of its path probabilities,
    which is what the decoder's cost model trims by. The combined estimates go through a second
    calibration (:class:`MergedCalibration`), and a node's children are scaled down when their
    estimates add up to more than 1 (at most one of them can be accepted), so those sums and
    products are close to what verification then shows.
    """

    name = "merged"

    def __init__(
        self, sources: Sequence[DraftSource], max_children: int = 8, max_depth: int = 16
    ) -> None:
        if not sources:
            raise ValueError("at least one draft source is needed")
        self.sources = list(sources)
        self.max_children = max_children
        self.max_depth = max_depth
        self.calibrator = Calibrator()
        self.merged = MergedCalibration()
        # per node of the last proposal: what proposed it, and its combined estimate
        self._last: list[tuple[Contrib, float]] = []
        self._last_tree = DraftTree()
        self._last_root = -1  # the root position of the last proposal

    def reset(self) -> None:
        for s in self.sources:
            s.reset()
        self._last = []
        self._last_tree = DraftTree()

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        node_sources: list[NodeSource] = []
        static: dict[tuple[int, ...], dict[int, Contrib]] = {}
        for s in self.sources:
            if isinstance(s, NodeSource):
                s.prepare(context)
                node_sources.append(s)
                continue
            tree = s.propose(context, budget)
            paths: list[tuple[int, ...]] = []
            for t, p, q, key in zip(tree.tokens, tree.parents, tree.probs, tree.keys, strict=True):
                up = paths[p] if p >= 0 else ()
                static.setdefault(up, {}).setdefault(t, []).append((s.name, key, q))
                paths.append((*up, t))
        cal = self.calibrator
        n_ctx = len(context)
        contribs: dict[int, tuple[Contrib, float]] = {}
        merged_cal = self.merged

        def expand(seq: Sequence[int], depth: int) -> list[Child]:
            merged: dict[int, Contrib] = {
                t: list(c) for t, c in static.get(tuple(seq[n_ctx:]), {}).items()
            }
            for s in node_sources:
                for t, q, key in s.children(seq, depth):
                    merged.setdefault(t, []).append((s.name, key, q))
            scored: list[tuple[float, int, Contrib]] = []
            for t, c in merged.items():
                miss = 1.0
                for name, key, q in c:
                    miss *= 1.0 - min(max(cal.estimate(name, key, q), 0.0), 0.999)
                scored.append((1.0 - miss, t, c))
            scored.sort(key=lambda x: -x[0])
            scored = scored[: self.max_children]
            # scaled to add up to at most 1, calibrated, and scaled again if the map took them
            # above 1
            raw = _at_most_one([q for q, _, _ in scored])
            final = _at_most_one([merged_cal(q) for q in raw])
            out: list[Child] = []
            for (_, t, c), q, p in zip(scored, raw, final, strict=True):
                token_key = len(contribs)
                contribs[token_key] = (c, q)
                out.append((t, p, token_key))
            return out

        tree, keys = best_first(context, budget, expand, self.max_depth)
        self._last = [contribs[k] for k in keys if isinstance(k, int)]
        tree.keys = [None] * len(tree)
        self._last_tree = tree
        self._last_root = len(context) - 1
        return tree

    def observe(self, verified: Verified) -> None:
        """Calibrate every proposed node whose parent was accepted — once, and only when
        ``verified`` is the round that verified the last proposal — then feed the sources.

        Other rounds are shown too (the prompt, one-token steps caught up as one chain, a
        proposal that was never sent): calibrating the last tree against those would count its
        nodes as hits or misses at unrelated positions."""
        tree, last = self._last_tree, self._last
        n = min(len(tree), len(verified.tokens) - 1)  # the block may hold a prefix of the tree
        block_tokens, block_parents = tree.prefix(n).block(verified.tokens[0])
        if (
            verified.root_index != self._last_root
            or verified.tokens[: n + 1] != block_tokens
            or verified.parents[: n + 1] != block_parents
        ):
            n = 0
        self._last_tree, self._last = DraftTree(), []
        for i in range(n):
            target = verified.targets.get(tree.parents[i] + 1)
            if target is None:
                continue
            hit = tree.tokens[i] == target
            contrib, raw = last[i]
            for name, key, _ in contrib:
                self.calibrator.update(name, key, hit)
            self.merged.update(raw, hit)
        for s in self.sources:
            s.observe(verified)
