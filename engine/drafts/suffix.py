"""Context n-grams as a draft source: what followed earlier occurrences of the context's longest
suffix (prompt + everything generated so far + the draft path below a node)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.drafts.tree import Child, DraftTree, Verified, best_first, bucket


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
                key = (min(n, 8), bucket(share, (0.3, 0.6, 0.99)), min(seen, 3), min(depth, 3))
                out.append((t, share * conf, key))
            return out
        return []

    def propose(self, context: Sequence[int], budget: int) -> DraftTree:
        self.prepare(context)
        return best_first(context, budget, self.children, self.max_depth)[0]

    def observe(self, verified: Verified) -> None:
        pass  # the index follows the context in prepare()
