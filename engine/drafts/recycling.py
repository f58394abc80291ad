"""Token recycling as a draft source: the model's own top-k successors of each token, kept from
the logits of every verified node."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.drafts.tree import Child, DraftTree, Verified, best_first, bucket


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
        # token -> (index into _known of its most similar known token, that similarity, how
        # many known tokens were compared): later queries compare only the tokens added since
        self._nearest: dict[int, tuple[int, float, int]] = {}
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
            if i and i[0] < 0:  # a row whose logits were never computed (lazy LM head)
                continue
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
        if ids and ids[0] >= 0:  # -1: that row's logits were never computed
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
                (kind_of[mask], min(rank, 4), bucket(p, (0.1, 0.3, 0.5, 0.7, 0.9)), min(depth, 3)),
            )
            for t, (p, rank, mask) in found.items()
        ]
        hint = self._hint
        if depth == 1 and hint is not None and hint[0] == int(seq[-1]):
            out += [
                (t, p, (3, min(rank, 4), bucket(p, (0.1, 0.3, 0.5, 0.7, 0.9))))
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
        j, best, seen = self._nearest.get(token, (-1, float("-inf"), 0))
        if seen < len(self._known):
            q = torch.nn.functional.normalize(emb[token].float(), dim=-1)  # [H]
            sims = self._known_mat[seen:] @ q  # [K - seen]
            i = int(torch.argmax(sims))
            if float(sims[i]) > best:  # ties keep the earlier known token
                j, best = seen + i, float(sims[i])
            self._nearest[token] = (j, best, len(self._known))
        if best < self.min_similarity:
            return None
        ids, probs = self.table[self._known[j]]
        return ids, [p * 0.5 for p in probs]

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        return best_first(context, budget, self.children, self.max_depth)[0]
