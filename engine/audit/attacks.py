"""Attacks on what the server sees. Each maps observed states to a ranked top-5 per position.

Input side (target: the token at the same position): frequency prior, nearest embedding,
learned per-position decoders (ridge regression, small MLP) and known-weights inversion
(SipIt-style search verified by re-running the public head). Output side (target: the next
token, i.e. what the client is about to generate): frequency prior, logit lens (final norm +
LM head on the trunk output, as if the tail were private), learned decoders, and the public
tail + LM head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model import LayerStack, rms_norm

Cancel = Callable[[], bool]


def prior_top5(train_targets: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 5 most frequent training targets [5]."""
    counts = torch.bincount(torch.cat(list(train_targets)))
    return counts.topk(min(5, counts.numel())).indices


def nearest_embedding(
    states: Sequence[torch.Tensor], embed: torch.Tensor, k: int = 5
) -> list[torch.Tensor]:
    """Top-k tokens by cosine similarity of the state to the embedding rows."""
    e = F.normalize(embed.float(), dim=-1)  # [V, H]
    return [(F.normalize(s.float(), dim=-1) @ e.T).topk(k, dim=-1).indices for s in states]


def logit_lens(
    states: Sequence[torch.Tensor], norm_w: torch.Tensor, lm_head: torch.Tensor, eps: float
) -> list[torch.Tensor]:
    """Top-5 of the final norm + LM head ([V, H]) applied directly to each state."""
    return [F.linear(rms_norm(s, norm_w, eps), lm_head).topk(5, dim=-1).indices for s in states]


class Standardizer:
    def __init__(self, x: torch.Tensor) -> None:
        self.mu = x.mean(0)  # [H]
        self.sd = x.std(0).clamp_min(1e-6)  # [H]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() - self.mu) / self.sd


class RidgeDecoder:
    """One-vs-all ridge regression from a standardised state to the token (closed form)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, lam: float = 10.0) -> None:
        x = x.double()
        self.classes = torch.unique(y)  # [C]
        yc = torch.searchsorted(self.classes, y)  # [N]
        self.std = Standardizer(x.float())
        xs = self.std(x).double()  # [N, H]
        h = xs.shape[1]
        a = xs.T @ xs + lam * torch.eye(h, dtype=torch.float64)  # [H, H]
        b = torch.zeros(h, len(self.classes), dtype=torch.float64)
        b.index_add_(1, yc, xs.T)  # [H, C]: X^T Y for one-hot Y
        self.w = torch.linalg.solve(a, b).float()  # [H, C]
        self.bias = torch.bincount(yc, minlength=len(self.classes)).float() / len(y)  # [C]

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.std(x) @ self.w + self.bias  # [T, C]

    def ranked(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Top-k token ids [T, k] (k capped at the number of classes)."""
        idx = self.scores(x).topk(min(k, len(self.classes)), dim=-1).indices
        return self.classes[idx]


class EmbeddingRegressor:
    """Ridge regression from a standardised state to the token's input embedding, then nearest
    embedding rows by cosine: a learned decoder that can name tokens never seen in training."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, embed: torch.Tensor, lam: float = 10.0):
        self.std = Standardizer(x.float())
        xs = self.std(x).double()  # [N, H]
        h = xs.shape[1]
        a = xs.T @ xs + lam * torch.eye(h, dtype=torch.float64)  # [H, H]
        self.w = torch.linalg.solve(a, xs.T @ embed[y].double()).float()  # [H, H_embed]
        self.embed_n = F.normalize(embed.float(), dim=-1)  # [V, H]

    def ranked(self, x: torch.Tensor, k: int) -> torch.Tensor:
        pred = F.normalize(self.std(x) @ self.w, dim=-1)  # [T, H]
        return (pred @ self.embed_n.T).topk(k, dim=-1).indices  # [T, k]


class MLPDecoder:
    """A small MLP (one hidden layer) trained with cross-entropy; seeded and deterministic."""

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        seed: int,
        hidden: int = 384,
        epochs: int = 8,
        batch: int = 256,
        lr: float = 2e-3,
        cancel: Cancel | None = None,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.classes = torch.unique(y)
        yc = torch.searchsorted(self.classes, y)
        self.std = Standardizer(x.float())
        xs = self.std(x)
        h, c = xs.shape[1], len(self.classes)
        self.w1 = (torch.randn(h, hidden, generator=g) / h**0.5).requires_grad_()
        self.b1 = torch.zeros(hidden, requires_grad=True)
        self.w2 = (torch.randn(hidden, c, generator=g) / hidden**0.5).requires_grad_()
        self.b2 = torch.zeros(c, requires_grad=True)
        params = [self.w1, self.b1, self.w2, self.b2]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
        n = len(yc)
        with torch.enable_grad():
            for _ in range(epochs):
                perm = torch.randperm(n, generator=g)
                for i in range(0, n, batch):
                    if cancel is not None and cancel():
                        return
                    j = perm[i : i + batch]
                    loss = F.cross_entropy(self._logits(xs[j]), yc[j])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()

    def _logits(self, xs: torch.Tensor) -> torch.Tensor:
        return F.gelu(xs @ self.w1 + self.b1) @ self.w2 + self.b2  # [N, C]

    @torch.no_grad()
    def ranked(self, x: torch.Tensor, k: int) -> torch.Tensor:
        idx = self._logits(self.std(x)).topk(min(k, len(self.classes)), dim=-1).indices
        return self.classes[idx]


@dataclass
class InversionResult:
    top5: torch.Tensor  # [T, 5] candidates ordered by distance (best first; -1 = none)
    verified: torch.Tensor  # [T] bool: best candidate reproduces the observed state exactly
    margin: torch.Tensor  # [T] second-best minus best relative distance (inf if one candidate)
    best_dist: torch.Tensor  # [T] relative distance of the best candidate
    tried: list[int] = field(default_factory=list)


def invert_known_weights(
    head: LayerStack,
    embed: torch.Tensor,
    observed: torch.Tensor,
    candidate_order: Callable[[int], list[int]],
    stages: Sequence[int] = (1, 7, 24, 32),
    tol: float = 1e-3,
    fallback: int = 0,
    fallback_dist: float = 0.25,
) -> InversionResult:
    """SipIt-style inversion with the public head weights.

    Left to right: for position t, candidates (from ``candidate_order(t)``, best guesses first)
    are run through the public head as a tree block hanging off the already-recovered prefix
    (so one forward checks a whole batch), and compared with the observed state. A candidate
    whose state matches to relative distance < ``tol`` is "verified exact" and the search stops;
    otherwise the closest candidate is the best guess and becomes the prefix for t + 1.
    ``stages`` are the batch sizes tried in turn; when even the best of them is far off
    (relative distance > ``fallback_dist``: the token itself, not an earlier guess, is wrong),
    ``fallback`` further candidates are tried in one batch. Their sum caps the search per
    position — the published attack searches the whole vocabulary; this one is bounded.
    """
    obs_all = observed.float()  # [T, H]

    def distance(t: int, out: torch.Tensor) -> list[float]:
        obs = obs_all[t]  # [H]
        norm = obs.norm().clamp_min(1e-12)
        return ((out.float() - obs).norm(dim=-1) / norm).tolist()  # [b]

    return search_left_to_right(
        head,
        embed,
        observed.shape[0],
        candidate_order,
        distance,
        stages,
        tol,
        fallback,
        fallback_dist,
    )


def search_left_to_right(
    head: LayerStack,
    embed: torch.Tensor,
    t_len: int,
    candidate_order: Callable[[int], list[int]],
    distance: Callable[[int, torch.Tensor], list[float]],
    stages: Sequence[int],
    tol: float,
    fallback: int = 0,
    fallback_dist: float = 0.25,
    chosen: Callable[[int, torch.Tensor], None] | None = None,
) -> InversionResult:
    """The search both inversions share: for each position t, batches of candidates (``stages``,
    then ``fallback`` more when even the best is farther than ``fallback_dist``) run through the
    public head as a tree block off the recovered prefix; ``distance(t, states [b, H])`` scores
    them, below ``tol`` is verified and stops the search; the closest becomes the prefix for
    t + 1 (``chosen(t, its state)`` is told)."""
    head.reset()
    top5 = torch.full((t_len, 5), -1, dtype=torch.long)
    verified = torch.zeros(t_len, dtype=torch.bool)
    margin = torch.full((t_len,), float("inf"))
    best_dist = torch.zeros(t_len)
    tried_counts = []
    keep: list[int] | None = None
    for t in range(t_len):
        order = candidate_order(t)
        cand_all: list[int] = []
        dist_all: list[float] = []
        out_all: list[torch.Tensor] = []
        pos0 = 0
        last_block: list[int] = []
        for size in (*stages, fallback):
            if size == fallback and (not fallback or min(dist_all) <= fallback_dist):
                break
            cands = order[pos0 : pos0 + size]
            pos0 += size
            if not cands:
                break
            b = len(cands)
            x = embed[torch.tensor(cands)]  # [b, H]
            out = head.forward(x, torch.full((b,), t), [-1] * b, keep)  # [b, H]
            keep = []  # a further batch at this position replaces this one
            d = distance(t, out)  # [b]
            cand_all += cands
            dist_all += d
            out_all += list(out)
            last_block = cands
            if min(d) < tol:
                break
        ranked = sorted(range(len(cand_all)), key=lambda i: dist_all[i])
        best = cand_all[ranked[0]]
        tried_counts.append(len(cand_all))
        top = [cand_all[i] for i in ranked[:5]]
        top5[t, : len(top)] = torch.tensor(top)
        best_dist[t] = dist_all[ranked[0]]
        verified[t] = dist_all[ranked[0]] < tol
        if len(ranked) > 1:
            margin[t] = dist_all[ranked[1]] - dist_all[ranked[0]]
        if chosen is not None:
            chosen(t, out_all[ranked[0]])
        if best in last_block:
            keep = [last_block.index(best)]
        else:  # re-run the chosen token alone so the cache holds it
            head.forward(embed[best : best + 1], torch.tensor([t]), [-1], [])
            keep = None
    head.reset()
    return InversionResult(top5, verified, margin, best_dist, tried_counts)


def candidate_order_fn(*rankings: torch.Tensor) -> Callable[[int], list[int]]:
    """Candidates for position t: several rankings ([T, k] each, best first) interleaved in the
    order given, without repeats."""

    def order(t: int) -> list[int]:
        seen: set[int] = set()
        out = []
        lists = [r[t].tolist() for r in rankings]
        for i in range(max(len(x) for x in lists)):
            for lst in lists:
                if i < len(lst) and lst[i] not in seen:
                    seen.add(lst[i])
                    out.append(lst[i])
        return out

    return order
