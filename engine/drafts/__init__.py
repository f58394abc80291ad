"""Draft sources for speculative decoding: each proposes a token tree under a node budget and
learns from what the model verified.

* :mod:`engine.drafts.tree` — :class:`DraftTree`, :class:`Verified` (what a verification round
  showed), best-first growth, the online :class:`Calibrator` and the merger :class:`TreeDrafter`.
* :mod:`engine.drafts.suffix` — :class:`SuffixDraft`, context n-grams.
* :mod:`engine.drafts.recycling` — :class:`RecyclingDraft`, the model's own past top-k successors.
* :mod:`engine.drafts.head` — :class:`HeadDraft`, a learned EAGLE-style draft head over the
  client's hidden states, and its file format.
* :mod:`engine.drafts.train` — how such a head is trained from the model's own generations.
"""

from __future__ import annotations

import torch

from engine.drafts.recycling import RecyclingDraft
from engine.drafts.suffix import SuffixDraft
from engine.drafts.tree import (
    Calibrator,
    Child,
    DraftSource,
    DraftTree,
    MergedCalibration,
    NodeSource,
    TreeDrafter,
    Verified,
    best_first,
    bucket,
)

__all__ = [
    "Calibrator",
    "Child",
    "DraftSource",
    "DraftTree",
    "MergedCalibration",
    "NodeSource",
    "RecyclingDraft",
    "SuffixDraft",
    "TreeDrafter",
    "Verified",
    "best_first",
    "bucket",
    "default_drafter",
]


def default_drafter(
    embeddings: torch.Tensor | None = None, head: DraftSource | None = None
) -> TreeDrafter:
    """Suffix n-grams + token recycling (+ a learned ``head``) in one tree; ``embeddings``
    [V, H] (the model's input embedding) lets recycling guess successors for tokens it has not
    seen yet."""
    sources: list[DraftSource] = [SuffixDraft(), RecyclingDraft(embeddings=embeddings)]
    if head is not None:
        sources.append(head)
    return TreeDrafter(sources)
