"""Attacks on the organisation-keyed split by a trunk operator who knows the scheme.

The attacker (honest-but-curious trunk operator) has: the public model, the keyed trunk
weights it serves, the keyed activations it receives and returns, and the chat template. It
does not have the :class:`engine.keyed.transform.OrgKey` — no function here takes a key or a
:class:`~engine.keyed.transform.KeyedTransform`, so none can peek at ``q``.

Every attack first estimates the secret rotation ``q`` (``q_hat``, [H, H] orthogonal) so the
observed states can be turned back (``observed @ q_hat.T``) and fed to the ordinary audit
attacks (:mod:`engine.audit.attacks`), except :func:`vocabulary_match`, which needs no ``q``:

1. :func:`align_weights`: the keyed MLP weights are the public ones (norm folded in) turned by
   ``q`` with their channels permuted and scaled. Per channel, inner products between the
   gate row, up row and down column are rotation- and scale-invariant; matching channels on them
   (Hungarian), then orthogonal Procrustes over all trunk layers, then re-matching by cosine
   under the current ``q_hat`` and re-fitting. :func:`gram_eigen` is the closed-form variant
   (eigenvectors of the summed gate Grams, signs from a second Gram) — exact without noise,
   fragile with it.
2. :func:`procrustes` on known-plaintext pairs (chat-template positions).
3. :func:`distribution_match`: covariance eigenvectors of received vs public activations,
   signs from the third moment.
4. :func:`vocabulary_match`: left-to-right search over candidate tokens comparing only rotation
   invariants (norms and inner products with earlier positions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.audit.attacks import InversionResult, search_left_to_right
from engine.config import ModelConfig
from engine.model import LayerStack, LayerWeights


def procrustes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The orthogonal ``q`` [H, H] minimising ||a @ q - b|| for rows a, b [N, H] (float64).
    With fewer than H independent rows the part of ``q`` outside their span is arbitrary."""
    u, _, vt = torch.linalg.svd(a.double().T @ b.double())
    return u @ vt


def _mlp_rows(w: LayerWeights, inter: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate rows, up rows, down columns) [I, H] each, float64, with ln2 folded into gate/up."""
    if not isinstance(w.wgu, torch.Tensor) or not isinstance(w.wdown, torch.Tensor):
        raise TypeError("weight alignment needs float weights")
    g = w.ln2.double()[None, :]
    gu = w.wgu.double()
    return gu[:inter] * g, gu[inter:] * g, w.wdown.double().T


def _features(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Per-channel features [I, 6] unchanged by the keyed scheme (rotation ``q``, channel
    scale ``s`` on up and 1/s on down): |gate|, |up||down|, up·down and three cosines."""
    ng, nu, nd = gate.norm(dim=1), up.norm(dim=1), down.norm(dim=1)
    gu = (gate * up).sum(1) / (ng * nu)
    gd = (gate * down).sum(1) / (ng * nd)
    ud = (up * down).sum(1)
    return torch.stack([ng, nu * nd, ud, gu, gd, ud / (nu * nd)], dim=1)


def _hungarian(cost: torch.Tensor) -> torch.Tensor:
    """perm [I]: keyed channel j is public channel perm[j] (minimises the summed cost[pub, key])."""
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(cost.numpy())
    perm = np.empty(len(rows), dtype=np.int64)
    perm[cols] = rows
    return torch.from_numpy(perm)


@dataclass
class Alignment:
    q_hat: torch.Tensor  # [H, H] float64
    iterations: int
    matched_agreement: float  # fraction of channels whose match did not change in the last step
    residual: float  # relative Procrustes residual ||A q - B|| / ||B|| over the gate rows


def _fit(
    pub: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    perms: list[torch.Tensor],
) -> tuple[torch.Tensor, float]:
    a_rows, b_rows = [], []
    for (g, u, d), (g2, u2, d2), p in zip(pub, seen, perms, strict=True):
        g, u, d = g[p], u[p], d[p]
        s = (u2.norm(dim=1) / u.norm(dim=1).clamp_min(1e-30))[:, None]  # channel scale
        a_rows += [g, u * s, d / s]
        b_rows += [g2, u2, d2]
    a, b = torch.cat(a_rows), torch.cat(b_rows)
    q = procrustes(a, b)
    res = float((a @ q - b).norm() / b.norm())
    return q, res


def align_weights(
    public: Sequence[LayerWeights],
    keyed: Sequence[LayerWeights],
    config: ModelConfig,
    iters: int = 8,
    init: torch.Tensor | None = None,
) -> Alignment:
    """Estimate ``q`` from the keyed trunk weights and the same public layers (row matching +
    Procrustes, iterated). ``init`` starts from a given ``q_hat`` instead of the invariant
    features."""
    inter = config.intermediate_size
    pub = [_mlp_rows(w, inter) for w in public]
    seen = [_mlp_rows(w, inter) for w in keyed]
    if init is None:
        perms = []
        for p, k in zip(pub, seen, strict=True):
            fp, fk = _features(*p), _features(*k)
            mu, sd = fp.mean(0), fp.std(0).clamp_min(1e-12)
            perms.append(_hungarian(torch.cdist((fp - mu) / sd, (fk - mu) / sd)))
        q, res = _fit(pub, seen, perms)
    else:
        q, res, perms = init.double(), float("nan"), [torch.arange(inter) for _ in pub]
    agree, done = 0.0, 0
    for _ in range(iters):
        done += 1
        new = []
        for (g, _, _), (g2, _, _) in zip(pub, seen, strict=True):
            a = torch.nn.functional.normalize(g @ q, dim=1)
            b = torch.nn.functional.normalize(g2, dim=1)
            new.append(_hungarian(-(a @ b.T)))
        agree = float(
            torch.cat([(x == y).double() for x, y in zip(new, perms, strict=True)]).mean()
        )
        perms = new
        q, res = _fit(pub, seen, perms)
        if agree == 1.0:
            break
    return Alignment(q, done, agree, res)


def gram_eigen(
    public: Sequence[LayerWeights], keyed: Sequence[LayerWeights], config: ModelConfig
) -> torch.Tensor:
    """Closed-form ``q_hat`` from gate Grams: sum_l W'^T W' = q^T (sum_l W^T W) q, so the
    eigenvectors agree up to per-vector signs; the signs come from a second Gram (the odd
    layers alone), the global sign from which of ±q matches the gate rows better."""
    inter = config.intermediate_size
    pub = [_mlp_rows(w, inter)[0] for w in public]
    seen = [_mlp_rows(w, inter)[0] for w in keyed]
    m1 = sum(g.T @ g for g in pub)
    k1 = sum(g.T @ g for g in seen)
    m2 = sum(g.T @ g for g in pub[1::2]) if len(pub) > 1 else sum(g.T.abs() @ g for g in pub)
    k2 = sum(g.T @ g for g in seen[1::2]) if len(seen) > 1 else sum(g.T.abs() @ g for g in seen)
    _, u = torch.linalg.eigh(m1)
    _, v = torch.linalg.eigh(k1)
    prod = (u.T @ m2 @ u) * (v.T @ k2 @ v)  # [H, H]: s_i s_j times a positive number
    _, ev = torch.linalg.eigh(prod)
    s = torch.sign(ev[:, -1])
    s[s == 0] = 1
    q = u @ torch.diag(s) @ v.T
    best, score = q, -1.0
    for cand in (q, -q):
        a = torch.nn.functional.normalize(pub[0] @ cand, dim=1)
        b = torch.nn.functional.normalize(seen[0], dim=1)
        sc = float((a @ b.T).max(dim=1).values.mean())
        if sc > score:
            best, score = cand, sc
    return best


def _skew_signs(x: torch.Tensor, vecs: torch.Tensor) -> torch.Tensor:
    p = (x - x.mean(0)) @ vecs  # [N, H]
    s = torch.sign(p.pow(3).mean(0))
    s[s == 0] = 1
    return s


def distribution_match(public: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
    """``q_hat`` from moments: observed = public @ q in distribution, so the covariance
    eigenvectors map onto each other (up to sign, fixed by the third moment along each)."""
    pub, obs = public.double(), observed.double()
    _, u = torch.linalg.eigh(torch.cov(pub.T))
    _, v = torch.linalg.eigh(torch.cov(obs.T))
    su, sv = _skew_signs(pub, u), _skew_signs(obs, v)
    return (u * su) @ (v * sv).T


def invariants(states: torch.Tensor) -> torch.Tensor:
    """The rotation invariants of a sequence [T, H]: its Gram matrix [T, T]."""
    s = states.double()
    return s @ s.T


def vocabulary_match(
    head: LayerStack,
    embed: torch.Tensor,
    observed: torch.Tensor,
    candidate_order: Callable[[int], list[int]],
    stages: Sequence[int] = (32, 96, 128),
    tol: float = 1e-4,
) -> InversionResult:
    """Invert keyed states [T, H] without ``q``: left to right, run candidate tokens through the
    public head after the recovered prefix and keep the one whose squared norm and inner
    products with the earlier (recovered) states best match the observed ones (relative
    distance; < ``tol`` counts as verified). At most ``sum(stages)`` candidates per position,
    in ``candidate_order(t)`` (e.g. by frequency in a public corpus)."""
    obs = observed.double()
    prev: list[torch.Tensor] = []  # the recovered prefix's public states

    def distance(t: int, out: torch.Tensor) -> list[float]:
        target = obs[: t + 1] @ obs[t]  # [t + 1]: inner products with earlier positions, norm²
        scale = float(target.norm().clamp_min(1e-30))
        o = out.double()  # [b, H]
        sq = (o * o).sum(1, keepdim=True)  # [b, 1]
        v = torch.cat([o @ torch.stack(prev).T, sq], dim=1) if prev else sq  # [b, t + 1]
        return ((v - target[None, :]).norm(dim=1) / scale).tolist()

    return search_left_to_right(
        head,
        embed,
        obs.shape[0],
        candidate_order,
        distance,
        stages,
        tol,
        chosen=lambda _t, state: prev.append(state.double()),
    )


def rotation_error(q_hat: torch.Tensor, q: torch.Tensor) -> float:
    """||q_hat - q||_F / sqrt(H): 0 = exact, ~1.41 = unrelated (for the auditor and tests;
    the attacker cannot compute it)."""
    return float((q_hat.double() - q.double()).norm() / q.shape[0] ** 0.5)
