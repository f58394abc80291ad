"""Recovery rates with 95% bootstrap confidence intervals over sequences (documents)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def _ratio_ci(
    hits: np.ndarray, counts: np.ndarray, rng: np.random.Generator, n_boot: int
) -> tuple[float, list[float]]:
    total = counts.sum()
    if total == 0:
        return float("nan"), [float("nan"), float("nan")]
    point = float(hits.sum() / total)
    idx = rng.integers(0, len(hits), size=(n_boot, len(hits)))  # resample whole sequences
    h, c = hits[idx].sum(1), counts[idx].sum(1)
    ratios = h[c > 0] / c[c > 0]
    lo, hi = np.percentile(ratios, [2.5, 97.5]) if len(ratios) else (point, point)
    return point, [float(lo), float(hi)]


def score(
    top5: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    pii: Sequence[torch.Tensor],
    seed: int,
    n_boot: int = 1000,
    subset: Sequence[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Top-1/top-5 and personal-data top-1 recovery for ranked guesses ``top5`` ([T, 5] each)
    against ``targets`` ([T] each); ``pii`` marks personal-data positions ([T] bool each);
    ``subset`` (optional [T] bool each) restricts which positions count at all."""
    rows = []
    for guess, tgt, p, sub in zip(
        top5, targets, pii, subset if subset is not None else [None] * len(top5), strict=True
    ):
        keep = torch.ones_like(tgt, dtype=torch.bool) if sub is None else sub
        hit1 = (guess[:, 0] == tgt) & keep
        hit5 = (guess == tgt[:, None]).any(-1) & keep
        rows.append(
            (
                int(hit1.sum()),
                int(hit5.sum()),
                int(keep.sum()),
                int((hit1 & p).sum()),
                int((keep & p).sum()),
            )
        )
    a = np.array(rows, dtype=np.float64).reshape(-1, 5)
    rng = np.random.default_rng(seed)
    top1, top1_ci = _ratio_ci(a[:, 0], a[:, 2], rng, n_boot)
    top5v, top5_ci = _ratio_ci(a[:, 1], a[:, 2], rng, n_boot)
    pii1, pii_ci = _ratio_ci(a[:, 3], a[:, 4], rng, n_boot)
    return {
        "top1": top1,
        "top1_ci": top1_ci,
        "top5": top5v,
        "top5_ci": top5_ci,
        "pii_top1": None if np.isnan(pii1) else pii1,
        "pii_top1_ci": None if np.isnan(pii1) else pii_ci,
        "n_tokens": int(a[:, 2].sum()),
        "n_pii_tokens": int(a[:, 4].sum()),
        "n_seqs": len(rows),
    }
