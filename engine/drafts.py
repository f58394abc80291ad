"""Draft sources for speculative decoding: each proposes a token tree under a node budget and
learns from what the model verified.

A draft tree hangs off the *root* — the last committed token, which is not yet in the caches.
Its nodes are in topological order (``parents[i] < i``, ``-1`` = child of the root), and each
node carries an estimate of P(node's token is the target | its parent was accepted).

Sources (all behind :class:`DraftSource`):

* :class:`SuffixDraft` — context n-grams: the longest suffixes of the context (prompt + everything
  generated so far) that occurred before, found through an n-gram index; the continuations after
  several earlier occurrences are merged into one trie.
* :class:`RecyclingDraft` — token recycling: the client computes full logits for every verified
  node, so it keeps, per token, the model's own top-k successors and expands them into a tree.
* :class:`TreeDrafter` — the merger: it unions the sources' trees, turns each source's raw
  confidence into a calibrated acceptance probability learned online from verification results,
  and keeps the ``budget`` nodes with the highest path probability (best-first, so any prefix of
  the result is itself a valid tree and the expected accepted length of a prefix is known).

A learned draft head (a small local model over the tail's hidden states) fits the same
interface: ``propose`` from the context, ``observe`` the :class:`Verified` block (which carries
the block's final hidden states for exactly that use).
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
    chosen after node i, for the nodes on the accepted
    path (``path``, block indices starting at 0); other nodes are absent. ``hidden`` [B, H]
    (optional): the block's final hidden states, for a learned draft head.
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


def _bucket(x: float, edges: Sequence[float]) -> int:
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


class SuffixDraft:
    """Context n-grams: what followed earlier occurrences of the longest suffix of the context
    (prompt + everything generated so far, + the draft path below a node).

    The index maps every n-gram (``1 <= n <= max_n``) of the context to the positions where it
    ended, and grows incrementally with the context. For a node, the longest n-gram ending there
    that occurred before is found by walking n down from ``max_n``; the next tokens after its
    ``max_matches`` most recent occurrences are counted, so several continuations merge into
    one trie. A child's raw probability is its share of those continuations, discounted for
    short matches (the calibration learns how far to trust each match length).
    """

    name = "suffix"

    def __init__(self, max_n: int = 8, max_matches: int = 16, max_depth: int = 16) -> None:
        self.max_n = max_n
        self.max_matches = max_matches
        self.max_depth = max_depth
        self.reset()

    def reset(self) -> None:
        self._ctx: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}

    def prepare(self, context: Sequence[int]) -> None:
        n_old = len(self._ctx)
        if n_old and (
            len(context) < n_old
            or context[n_old - 1] != self._ctx[-1]
            or list(context[: min(n_old, 64)]) != self._ctx[:64]
        ):
            self.reset()
            n_old = 0
        ctx = self._ctx
        for i in range(n_old, len(context)):
            ctx.append(int(context[i]))
            for n in range(1, min(self.max_n, i + 1) + 1):
                self._index.setdefault(tuple(ctx[i - n + 1 : i + 1]), []).append(i)

    def children(self, seq: Sequence[int], depth: int) -> list[Child]:
        if depth > self.max_depth:
            return []
        ctx = self._ctx
        last = len(ctx) - 1  # a continuation must exist: occurrence end < last
        for n in range(min(self.max_n, len(seq)), 0, -1):
            ends = self._index.get(tuple(seq[len(seq) - n :]))
            if not ends:
                continue
            counts: dict[int, int] = {}
            seen = 0
            for e in reversed(ends):
                if e >= last:
                    continue
                t = ctx[e + 1]
                counts[t] = counts.get(t, 0) + 1
                seen += 1
                if seen >= self.max_matches:
                    break
            if not seen:
                continue
            conf = min(0.3 + 0.1 * n, 0.9)
            out: list[Child] = []
            for t, c in counts.items():
                share = c / seen
                key = (min(n, 8), _bucket(share, (0.3, 0.6, 0.99)), min(seen, 3), min(depth, 3))
                out.append((t, share * conf, key))
            return out
        return []

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        self.prepare(context)
        return best_first(context, budget, self.children, self.max_depth)[0]

    def observe(self, verified: Verified) -> None:
        pass  # the index follows the context in prepare()


class RecyclingDraft:
    """Token recycling: the model's own top-k successors of each token, from past logits.

    ``observe`` stores, for every node of every verified block (and every prompt position),
    the top-k next tokens and their probabilities as the successors of that node's token, and
    also of the (previous token, token) pair; the most recent observation wins. Children come
    from both tables, one per token, keyed by which tables list it. The tables are kept across
    conversations (they are the model's own prior, not user text).
    """

    name = "recycle"

    def __init__(
        self,
        k: int = 8,
        max_depth: int = 16,
        pairs: bool = True,
        embeddings: torch.Tensor | None = None,
        min_similarity: float = 0.3,
    ) -> None:
        self.k = k
        self.max_depth = max_depth
        self.pairs = pairs
        self.table: dict[int, tuple[list[int], list[float]]] = {}
        self.pair_table: dict[tuple[int, int], tuple[list[int], list[float]]] = {}
        # A token never seen yet borrows the successors of the most similar seen token (cosine
        # similarity of the input embeddings), when similar enough.
        self.embeddings = embeddings  # [V, H], shared with the model, not copied
        self.min_similarity = min_similarity
        self._known: list[int] = []
        self._known_mat = torch.empty(0)  # [K, H] normalized embeddings of self._known
        # successors for the next root, from the rejected sibling the model liked best
        self._hint: tuple[int, tuple[list[int], list[float]]] | None = None

    def reset(self) -> None:
        pass  # the successor tables are worth keeping

    def prepare(self, context: Sequence[int]) -> None:
        pass

    def learn(
        self,
        tokens: Sequence[int],
        topk_ids: torch.Tensor,
        topk_probs: torch.Tensor,
        prev: Sequence[int] | None = None,
    ) -> None:
        """Successors of ``tokens[i]`` (preceded by ``prev[i]``; default: ``tokens[i - 1]``)."""
        ids = topk_ids[:, : self.k].tolist()  # [B, k]
        probs = topk_probs[:, : self.k].tolist()  # [B, k]
        if prev is None:
            prev = [-1, *tokens[:-1]]
        for t, pv, i, p in zip(tokens, prev, ids, probs, strict=True):
            self.table[int(t)] = (i, p)
            if self.pairs and pv >= 0:
                self.pair_table[(int(pv), int(t))] = (i, p)

    def observe(self, verified: Verified) -> None:
        toks = verified.tokens
        r = verified.root_index
        before = verified.context[r - 1] if r > 0 else -1
        prev = [before, *(toks[p] for p in verified.parents[1:])]
        self.learn(toks, verified.topk_ids, verified.topk_probs, prev)
        # The next root (the bonus token) replaces a rejected child of the last accepted node;
        # what the model predicted after the likeliest such sibling, in this very context, is a
        # good guess at what follows the bonus token.
        self._hint = None
        last = verified.path[-1]
        bonus = verified.targets.get(last)
        kids = [i for i, p in enumerate(verified.parents) if p == last]
        if bonus is None or not kids:
            return
        at_last = dict(
            zip(verified.topk_ids[last].tolist(), verified.topk_probs[last].tolist(), strict=True)
        )
        c = max(kids, key=lambda i: at_last.get(toks[i], 0.0))
        ids = verified.topk_ids[c, : self.k].tolist()  # [k]
        probs = verified.topk_probs[c, : self.k].tolist()  # [k]
        self._hint = (bonus, (ids, probs))

    def children(self, seq: Sequence[int], depth: int) -> list[Child]:
        if depth > self.max_depth or not seq:
            return []
        pair = None
        if self.pairs and len(seq) > 1:
            pair = self.pair_table.get((int(seq[-2]), int(seq[-1])))
        single, single_kind = self.table.get(int(seq[-1])), 0
        if pair is None and single is None:  # never seen: borrow a similar token's successors
            single, single_kind = self._similar(int(seq[-1])), 2
        # One child per token; its key says which tables list it (both agreeing is stronger
        # evidence than either alone, but not independent evidence), its best rank and
        # probability, so the drafter's calibration learns what each combination is worth.
        found: dict[int, tuple[float, int, int]] = {}  # token -> (prob, rank, kind mask)
        for entry, bit in ((pair, 1), (single, 2)):
            if entry is None:
                continue
            for rank, (t, p) in enumerate(zip(*entry, strict=True)):
                q, r, mask = found.get(t, (0.0, rank, 0))
                found[t] = (max(q, p), min(r, rank), mask | bit)
        kind_of = {1: 1, 2: single_kind, 3: 4}  # pair only, single only, both
        out: list[Child] = [
            (
                t,
                p,
                (kind_of[mask], min(rank, 4), _bucket(p, (0.1, 0.3, 0.5, 0.7, 0.9)), min(depth, 3)),
            )
            for t, (p, rank, mask) in found.items()
        ]
        hint = self._hint
        if depth == 1 and hint is not None and hint[0] == int(seq[-1]):
            out += [
                (t, p, (3, min(rank, 4), _bucket(p, (0.1, 0.3, 0.5, 0.7, 0.9))))
                for rank, (t, p) in enumerate(zip(*hint[1], strict=True))
            ]
        return out

    def _similar(self, token: int) -> tuple[list[int], list[float]] | None:
        emb = self.embeddings
        if emb is None or not self.table or not 0 <= token < emb.shape[0]:
            return None
        if len(self._known) != len(self.table):
            new = list(self.table)[len(self._known) :]  # dicts keep insertion order
            rows = torch.nn.functional.normalize(emb[new].float(), dim=-1)  # [N, H]
            self._known_mat = torch.cat([self._known_mat.reshape(-1, rows.shape[1]), rows])
            self._known.extend(new)
        q = torch.nn.functional.normalize(emb[token].float(), dim=-1)  # [H]
        sims = self._known_mat @ q  # [K]
        j = int(torch.argmax(sims))
        if float(sims[j]) < self.min_similarity:
            return None
        ids, probs = self.table[self._known[j]]
        return ids, [p * 0.5 for p in probs]

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        return best_first(context, budget, self.children, self.max_depth)[0]


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


Contrib = list[tuple[str, Hashable, float]]  # (source, key, raw probability) behind a node


class TreeDrafter:
    """One tree from several sources under a node budget.

    Best-first by calibrated path probability: every :class:`NodeSource` is asked for the
    children of every node taken, sources that only ``propose`` whole trees contribute their
    trees' nodes; a child proposed by several sources gets ``1 - prod(1 - p_source)`` with each
    ``p_source`` calibrated online from verification. Best-first order means any prefix of the
    result is a valid tree whose expected accepted length is the sum of its path probabilities,
    which is what the decoder's cost model trims by.
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
        self._last: list[Contrib] = []  # per node of the last proposal
        self._last_tree = DraftTree()

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
        contribs: dict[int, Contrib] = {}

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
            out: list[Child] = []
            for q, t, c in scored[: self.max_children]:
                token_key = len(contribs)
                contribs[token_key] = c
                out.append((t, q, token_key))
            return out

        tree, keys = best_first(context, budget, expand, self.max_depth)
        self._last = [contribs[k] for k in keys if isinstance(k, int)]
        tree.keys = [None] * len(tree)
        self._last_tree = tree
        return tree

    def observe(self, verified: Verified) -> None:
        """Calibrate every proposed node whose parent was accepted, then feed the sources."""
        tree = self._last_tree
        n = min(len(tree), len(verified.tokens) - 1)  # the block may hold a prefix of the tree
        for i in range(n):
            target = verified.targets.get(tree.parents[i] + 1)
            if target is None:
                continue
            hit = tree.tokens[i] == target
            for name, key, _ in self._last[i]:
                self.calibrator.update(name, key, hit)
        for s in self.sources:
            s.observe(verified)

    def learn_prompt(
        self, tokens: Sequence[int], topk_ids: torch.Tensor, topk_probs: torch.Tensor
    ) -> None:
        """Seed sources that learn from logits with the prompt's prefill logits."""
        for s in self.sources:
            learn = getattr(s, "learn", None)
            if callable(learn):
                learn(tokens, topk_ids, topk_probs)


def default_drafter(embeddings: torch.Tensor | None = None) -> TreeDrafter:
    """Suffix n-grams + token recycling in one tree; ``embeddings`` [V, H] (the model's input
    embedding) lets recycling guess successors for tokens it has not seen yet."""
    return TreeDrafter([SuffixDraft(), RecyclingDraft(embeddings=embeddings)])
