"""LM-head rows of a verified tree, computed as the walk needs them.

Verifying a draft tree needs the full-vocabulary logits of the accepted path's nodes (and of
the node after it), not of every node: at Llama-3-8B shapes the LM head is a third of the
client's bytes and, for a 32-node tree, most of its arithmetic. :class:`LazyLogits` holds the
block's final hidden states and computes rows on demand, a whole likely path at a time: first
the root and the chain of its most probable draft children, then, when the walk leaves that
chain, the chain below the node it took. The LM head products are batch-invariant, so a row's
logits are bit-identical whichever rows shared its call: no token changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.split import ClientModel


class LazyLogits:
    """Rows of ``client.logits(hidden)`` [B, V], each computed once, when first indexed."""

    def __init__(
        self,
        client: ClientModel,
        hidden: torch.Tensor,
        parents: Sequence[int],
        probs: Sequence[float],
    ) -> None:
        self.client = client
        self.hidden = hidden  # [B, H]
        self.parents = list(parents)
        self.probs = list(probs)  # draft probability of each node (root: 1)
        self.rows: dict[int, torch.Tensor] = {}
        self.calls = 0
        best: dict[int, int] = {}  # node -> its most probable child
        for i in range(1, len(self.parents)):
            p = self.parents[i]
            if p not in best or self.probs[i] > self.probs[best[p]]:
                best[p] = i
        self._best = best

    def __len__(self) -> int:
        return len(self.parents)

    def _chain(self, start: int) -> list[int]:
        out = [start]
        while out[-1] in self._best:
            out.append(self._best[out[-1]])
        return out

    def _compute(self, nodes: Sequence[int]) -> None:
        todo = [n for n in nodes if n not in self.rows]
        if not todo:
            return
        self.calls += 1
        logits = self.client.logits(self.hidden[todo])  # [n, V]
        for i, n in enumerate(todo):
            self.rows[n] = logits[i]

    def __getitem__(self, node: int) -> torch.Tensor:
        """Logits [V] after ``node``."""
        if node not in self.rows:
            self._compute(self._chain(node))
        return self.rows[node]

    def computed(self) -> int:
        return len(self.rows)

    def full(self) -> torch.Tensor:
        """All rows [B, V] (computing the missing ones in one call)."""
        self._compute(range(len(self.parents)))
        return torch.stack([self.rows[i] for i in range(len(self.parents))])
