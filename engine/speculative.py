"""Speculative tree decoding over the split: one draft tree verified per trunk round trip.

Each round sends one block ``[root, draft nodes...]`` through head → trunk → tail → LM head,
where the root is the last committed token (not yet in any cache) and ``parents`` describe the
tree. The same call tells every cache which nodes of the *previous* block to keep (the accepted
path), so caches are compacted in place and nothing is recomputed or resent.

Verification walks from the root: the token the model picks after the current node (argmax, or
one seeded draw from the processed target distribution when sampling) is committed through
:class:`engine.generate.Output` — so EOS, stop strings and max tokens inside an accepted path are
honoured exactly — and the walk moves to the child holding that token, if the tree has one;
otherwise that token is the round's bonus token and the root of the next block.

Exactness. Greedy: every committed token is the argmax after its true prefix, i.e. the
sequential greedy output. Sampling: drafts are a deterministic function of the past, and each
committed token is drawn from the target distribution at its node with the same generator calls
sequential decoding makes; accepting the draft child equal to the draw is the speculative
sampling rule for deterministic drafts (accept draft d with probability p(d), else resample from
the residual p minus d, renormalized — which is a draw from p), so the output distribution is
exactly the non-speculative one.

Tree size. :class:`CostModel` fits the wall time of a round as ``a + b * block_size`` from the
rounds it has seen (``a``: round trip, fixed local and server overhead; ``b``: per-node compute
at both ends plus bytes over the link), and each round keeps the prefix of the best-first
draft tree that maximizes ``(1 + expected accepted nodes) / predicted round time``. On a GPU
trunk behind a WAN that means big trees; on a small CPU box, small ones.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.drafts import DraftTree, TreeDrafter, Verified, default_drafter
from engine.generate import (
    DECODERS,
    CancelToken,
    GenerationResult,
    TextCallback,
    start_generation,
)
from engine.sampling import SamplingParams, process_logits
from engine.split import SplitRunner

TOPK = 8  # successors recorded per verified node (token recycling)


class CostModel:
    """Round time ≈ a + b · block_size, by exponentially weighted least squares."""

    def __init__(self, decay: float = 0.97, prior_a: float = 0.05, prior_b: float = 0.002) -> None:
        self.decay = decay
        self.prior_a = prior_a
        self.prior_b = prior_b
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def observe(self, block_size: int, seconds: float) -> None:
        d = self.decay
        n = float(block_size)
        self._w = d * self._w + 1.0
        self._n = d * self._n + n
        self._t = d * self._t + seconds
        self._nn = d * self._nn + n * n
        self._nt = d * self._nt + n * seconds

    def coefficients(self) -> tuple[float, float]:
        if self._w <= 0:
            return self.prior_a, self.prior_b
        mn = self._n / self._w
        mt = self._t / self._w
        var = self._nn / self._w - mn * mn
        # the slope needs enough spread in block sizes; until then, the prior
        b = (self._nt / self._w - mn * mt) / var if var > 4.0 else self.prior_b
        b = max(b, 1e-5)
        a = max(mt - b * mn, 1e-4)
        return a, b

    def predict(self, block_size: int) -> float:
        a, b = self.coefficients()
        return a + b * block_size

    def choose(self, path_probs: Sequence[float]) -> int:
        """How many draft nodes (a prefix of the best-first order) maximize tokens/second."""
        a, b = self.coefficients()
        best_rate, best_n = 1.0 / (a + b), 0
        expected = 1.0
        for i, p in enumerate(path_probs):
            expected += p
            rate = expected / (a + b * (i + 2))
            if rate > best_rate:
                best_rate, best_n = rate, i + 1
        return best_n


@dataclass
class SpecOptions:
    max_nodes: int = 64  # most draft nodes proposed per round before the cost model trims
    fixed_budget: int | None = None  # skip the cost model: always send this many nodes (or fewer)


def proposal_size(recent: Sequence[int], max_nodes: int) -> int:
    """How many nodes to draft before the cost model trims: twice the biggest recent choice plus
    some slack (drafting costs CPU time per node; the cost model rarely wants much more than it
    just chose, and can double its choice every round), at most ``max_nodes``."""
    if not recent:
        return max_nodes
    return max(1, min(max_nodes, 8 + 2 * max(recent)))


def top_successors(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` token ids and their softmax probabilities per row of ``logits`` [B, V], without
    materializing the whole softmax."""
    vals, ids = logits.topk(k, dim=-1)  # [B, k]
    probs = (vals - logits.logsumexp(-1, keepdim=True)).exp()  # [B, k]
    return ids, probs


@dataclass
class _RunnerState:
    drafter: TreeDrafter
    cost: CostModel = field(default_factory=CostModel)
    recent: list[int] = field(default_factory=list)  # the cost model's last choices


_STATE: weakref.WeakKeyDictionary[SplitRunner, _RunnerState] = weakref.WeakKeyDictionary()


def runner_state(runner: SplitRunner) -> _RunnerState:
    """Drafter and cost model kept per runner across generations (they learn as they go)."""
    st = _STATE.get(runner)
    if st is None:
        st = _STATE[runner] = _RunnerState(default_drafter(runner.client.embed_weight))
    return st


def forget(runner: SplitRunner) -> None:
    """Drop what the drafter and cost model learned with ``runner`` (benchmarks use this so a
    pass over prompts already seen does not profit from their recycled successors)."""
    _STATE.pop(runner, None)


def limit_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """Drop nodes deeper than ``max_depth`` (and so their subtrees), keeping the order."""
    if max_depth <= 0:
        return DraftTree()
    depths = tree.depths()
    if not depths or max(depths) <= max_depth:
        return tree
    out = DraftTree()
    where: dict[int, int] = {}
    for i, d in enumerate(depths):
        if d <= max_depth:
            p = tree.parents[i]
            where[i] = out.add(tree.tokens[i], where[p] if p >= 0 else -1, tree.probs[i])
            out.keys[-1] = tree.keys[i]
    return out


def choose_token(
    logits: torch.Tensor,
    params: SamplingParams,
    context: Sequence[int],
    generator: torch.Generator | None,
    children: dict[int, int],
) -> int:
    """The token committed after a node: argmax, or one draw from the target distribution.

    ``children`` (draft token → node) is unused by the exact rule — the draw does not depend on
    the draft — but is part of the signature so a variant can be tested against it.
    """
    x = process_logits(logits, params, context)  # [V]
    if params.greedy:
        return int(torch.argmax(x))
    return int(torch.multinomial(x.softmax(-1), 1, generator=generator))


def generate_speculative(
    runner: SplitRunner,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    on_text: TextCallback | None = None,
    cancel: CancelToken | None = None,
    drafter: TreeDrafter | None = None,
    options: SpecOptions | None = None,
) -> GenerationResult:
    """Tree speculative decoding: same output as :func:`engine.generate.generate_sequential`."""
    opts = options or SpecOptions()
    t0 = time.perf_counter()
    st = start_generation(runner, prompt_ids, params, on_text)
    out, gen, stats, limit = st.out, st.generator, st.stats, st.limit
    state = runner_state(runner)
    drafter = drafter or state.drafter
    cost = state.cost
    drafter.reset()
    ctx = list(prompt_ids)
    logits = runner.forward(ctx, range(len(ctx)))  # [L, V]
    stats.round_trips += 1
    top_ids, top_probs = top_successors(logits, TOPK)  # [L, K]
    drafter.learn_prompt(ctx, top_ids, top_probs)
    cost.observe(len(ctx), time.perf_counter() - t0)
    tok = choose_token(logits[-1], params, ctx, gen, {})
    ctx.append(tok)
    t_first = time.perf_counter()
    stats.ttft_s = t_first - t0
    done = out.push(tok)
    if not done and len(ctx) >= limit:
        out.finish("context")
        done = True
    keep: list[int] | None = None
    while not done:
        if cancel is not None and cancel.cancelled:
            out.finish("cancelled")
            break
        t_round = time.perf_counter()
        root, root_pos = ctx[-1], len(ctx) - 1
        room = min(limit - 1 - root_pos, params.max_new_tokens - len(out.token_ids))
        if opts.fixed_budget is not None:
            tree = drafter.propose(ctx, opts.fixed_budget)
            tree = limit_depth(tree, room)
        else:
            size = proposal_size(state.recent, opts.max_nodes)
            tree = limit_depth(drafter.propose(ctx, size), room)
            tree = tree.prefix(cost.choose(tree.path_probs()))
            state.recent = [*state.recent[-7:], len(tree)]
        ids, parents = tree.block(root)
        positions = [root_pos] + [root_pos + d for d in tree.depths()]
        logits = runner.forward(ids, positions, parents, keep)  # [B, V]
        stats.round_trips += 1
        stats.tree_nodes_sent += len(ids)
        kids: list[dict[int, int]] = [{} for _ in ids]
        for i in range(1, len(ids)):
            kids[parents[i]][ids[i]] = i
        node, path, targets, committed = 0, [0], {}, 0
        while True:
            tok = choose_token(logits[node], params, ctx, gen, kids[node])
            targets[node] = tok
            ctx.append(tok)
            committed += 1
            if out.push(tok):
                done = True
                break
            if len(ctx) >= limit:
                out.finish("context")
                done = True
                break
            child = kids[node].get(tok)
            if child is None:
                break  # tok is the bonus token: the next block's root
            node = child
            path.append(child)
        keep = path
        stats.accepted_hist[committed] = stats.accepted_hist.get(committed, 0) + 1
        if done:
            break
        top_ids, top_probs = top_successors(logits, TOPK)  # [B, K]
        drafter.observe(Verified(ctx, ids, parents, top_ids, top_probs, path, targets, root_pos))
        cost.observe(len(ids), time.perf_counter() - t_round)
    stats.new_tokens = len(out.token_ids)
    stats.decode_s = time.perf_counter() - t_first
    return GenerationResult(out.text, out.token_ids, out.finish_reason or "length", stats)


DECODERS["speculative"] = generate_speculative
