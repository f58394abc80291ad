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

Tree size and the choice between drafted rounds and one-token steps: :mod:`engine.spec_cost`
(a cost model fitted from the rounds seen; under load, priced in the office's seconds).

Rounds in flight (``SpecOptions.pipeline``, the ``pipelined`` decoder): while a round is on the
wire the next one goes on bets about its outcome (:mod:`engine.spec_pipeline`). A block may then
start with a *chain* — committed tokens whose rows are sent again before the root — and a round
sent ahead is verified from the row of the bet that won; every token is still chosen by
:func:`choose_token` after its true prefix, in order, so both exactness arguments above hold.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine import kernels
from engine.drafts import DraftTree, TreeDrafter, Verified, default_drafter
from engine.drafts.head import DraftHead
from engine.drafts.learned import HeadDraft
from engine.generate import (
    DECODERS,
    CancelToken,
    GenerationResult,
    Prefill,
    TextCallback,
    cancelled_early,
    read_prompt,
    start_generation,
)
from engine.lazy_logits import LazyLogits
from engine.protocol import Load
from engine.sampling import SamplingParams, pick
from engine.spec_cost import MIN_SPREAD, CostModel, ModeChooser, explore_size, proposal_size
from engine.spec_pipeline import (
    EXTRA_NODES,
    AheadRound,
    HitCalibration,
    send_ahead,
    settle,
    start_round,
)
from engine.split import InFlight, LocalTrunk, SplitRunner

TOPK = 8  # successors recorded per verified node (token recycling)


@dataclass
class SpecOptions:
    # most draft nodes proposed per round before the cost model trims (root + 63 nodes; the
    # float32 kernel takes blocks up to engine.kernels.MAX_ROWS before BLAS)
    max_nodes: int = 63
    # skip the cost model: always send this many nodes (or fewer), and let the learned head grow
    # its tree without a time-based limit (so nothing depends on this machine's speed)
    fixed_budget: int | None = None
    # Compute LM-head rows only along the walk (engine.lazy_logits) when the drafter does not
    # learn from every node's logits (``needs_all_logits = False`` on the drafter).
    lazy_head: bool = True
    # Size trees and choose one-token steps by the office's committed tokens per second when the
    # trunk reports its load (False: by this client's own rate alone, as before the load report)
    load_aware: bool = True
    # Rounds in flight (engine.spec_pipeline): "off"; "auto" sends round r+1 while round r is
    # on the wire when the cost model says the bet pays, and only to a trunk behind a link;
    # "always" whenever there is a bet to make, on any trunk (tests, counting benchmarks)
    pipeline: str = "off"


def top_successors(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` token ids and their softmax probabilities per row of ``logits`` [B, V], without
    materializing the whole softmax (one compiled pass per row where the kernels run)."""
    fast = kernels.top_k_softmax(logits, k)
    if fast is not None:
        return fast
    vals, ids = logits.topk(k, dim=-1)  # [B, k]
    probs = (vals - logits.logsumexp(-1, keepdim=True)).exp()  # [B, k]
    return ids, probs


@dataclass
class _RunnerState:
    drafter: TreeDrafter
    cost: CostModel = field(default_factory=CostModel)
    recent: list[int] = field(default_factory=list)  # the cost model's last choices
    mode: ModeChooser = field(default_factory=ModeChooser)  # drafting at all, or one-token steps
    head: HeadDraft | None = None  # the learned source inside ``drafter``, if any
    rounds: int = 0
    hits: HitCalibration = field(default_factory=HitCalibration)  # bets on rounds' outcomes
    no_bets: int = 0  # drafted rounds since a round was sent ahead (pipeline "auto")
    looks: int = 0


_STATE: weakref.WeakKeyDictionary[SplitRunner, _RunnerState] = weakref.WeakKeyDictionary()
# per runner: "auto" (the shipped head for this model, if any), "none", or a loaded head
_HEAD: weakref.WeakKeyDictionary[SplitRunner, str | DraftHead] = weakref.WeakKeyDictionary()


def _key(runner: SplitRunner) -> SplitRunner:
    """The runner itself, also through a wrapper that exposes it as ``wrapped`` (the app counts
    round trips through one per reply; what was learned belongs to the runner underneath)."""
    inner = getattr(runner, "wrapped", None)
    return inner if isinstance(inner, SplitRunner) else runner


def runner_state(runner: SplitRunner) -> _RunnerState:
    """Drafter and cost model kept per runner across generations (they learn as they go)."""
    runner = _key(runner)
    st = _STATE.get(runner)
    if st is None:
        head = _head_source(runner, _HEAD.get(runner, "auto"))
        drafter = default_drafter(runner.client.embed_weight, head)
        st = _STATE[runner] = _RunnerState(drafter, head=head)
    return st


def _head_source(runner: SplitRunner, choice: str | DraftHead) -> HeadDraft | None:
    from engine.drafts.select import auto_head

    head = auto_head(runner.client) if choice == "auto" else choice
    if not isinstance(head, DraftHead):
        return None
    return HeadDraft(head, runner.client)


def use_draft_head(runner: SplitRunner, head: str | DraftHead) -> None:
    """Draft with ``head`` on ``runner`` from now on: a loaded :class:`DraftHead`, ``"auto"``
    (the head shipped for this model, the default) or ``"none"``. What the drafter learned so
    far is dropped."""
    _HEAD[_key(runner)] = head
    _STATE.pop(_key(runner), None)


def draft_head_of(runner: SplitRunner) -> DraftHead | None:
    """The learned head this runner drafts with (None: context sources only)."""
    src = runner_state(runner).head
    return src.head if src is not None else None


def forget(runner: SplitRunner) -> None:
    """Drop what the drafter and cost model learned with ``runner`` (benchmarks use this so a
    pass over prompts already seen does not profit from their recycled successors)."""
    _STATE.pop(_key(runner), None)


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
    return pick(logits, params, context, generator)


def generate_speculative(
    runner: SplitRunner,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    on_text: TextCallback | None = None,
    cancel: CancelToken | None = None,
    drafter: TreeDrafter | None = None,
    options: SpecOptions | None = None,
    prefill: Prefill | None = None,
) -> GenerationResult:
    """Tree speculative decoding: same output as :func:`engine.generate.generate_sequential`."""
    opts = options or SpecOptions()
    t0 = time.perf_counter()
    st = start_generation(runner, prompt_ids, params, on_text)
    out, gen, stats, limit = st.out, st.generator, st.stats, st.limit
    state = runner_state(runner)
    drafter = drafter or state.drafter
    cost = state.cost
    head = state.head if drafter is state.drafter else None
    taps = _taps(runner, head)
    drafter.reset()
    ctx = list(prompt_ids)
    t_prompt = time.perf_counter()
    compiled = kernels.compiles()  # (a time that includes a first-use compile is not observed)
    blocks = read_prompt(
        runner,
        lambda s: (s.final, s.features() if taps is not None else None),
        ctx,
        prefill,
        cancel,
    )
    if blocks is None:
        return cancelled_early(stats)
    hid, feats = _joined(blocks)  # [L, H], [L, 3H] | None
    stats.round_trips += len(blocks)
    # (the prefill is not a verification round: prompt processing, a session being opened and
    # first-call costs would make its few long blocks set the cost model's slope; its time per
    # row only bounds the per-node cost until a slope is fitted)
    if kernels.compiles() == compiled:
        cost.seed_slope(len(prompt_ids), time.perf_counter() - t_prompt)
    # Only the last row's logits now, as sequential decoding computes them: the other rows'
    # (what the drafter learns from the prompt) wait for the first drafted round, see
    # _prompt_verified
    tok = choose_token(runner.client.logits(hid[-1:])[-1], params, ctx, gen, {})
    ctx.append(tok)
    t_first = time.perf_counter()
    stats.ttft_s = t_first - t0
    done = out.push(tok)
    if not done and len(ctx) >= limit:
        out.finish("context")
        done = True
    prompt_seen: tuple[list[int], torch.Tensor, torch.Tensor | None] | None = None
    if not done:
        prompt_seen = (list(ctx), hid, feats)
    keep: list[int] | None = None
    # one-token steps are not shown to the drafter one by one (that would make them slower
    # than sequential decoding's): their roots, logits rows and features wait here and are
    # shown as one accepted chain before the next drafted round (see _catch_up)
    pending: list[tuple[int, torch.Tensor | None, torch.Tensor | None]] = []
    # rounds in flight (engine.spec_pipeline): committed tokens whose rows the next block sends
    # again before its root (after a wrong bet), and the round sent while the last was on the wire
    chain: list[int] = []
    ahead: AheadRound | None = None
    # a round sent ahead whose bets all lost: its answer is taken (and dropped) just before the
    # next round's, so that the next round goes at once instead of waiting for it
    dropped: InFlight | None = None
    pipe = _pipeline_mode(runner, opts)
    while not done:
        if cancel is not None and cancel.cancelled:
            out.finish("cancelled")
            break
        t_round = time.perf_counter()
        compiled = kernels.compiles()
        root, root_pos = ctx[-1], len(ctx) - 1
        room = min(limit - 1 - root_pos, params.max_new_tokens - len(out.token_ids))
        carried, ahead = ahead, None  # sent last round and a bet won: verified now
        proposal: DraftTree | None = None
        one_step = False
        if carried is not None:
            assert carried.won is not None
            bet, flight = carried.won, carried.flight
            tree, walk_rows, kept = bet.tree, bet.rows, bet.kept
        else:
            load = trunk_load(runner) if opts.load_aware else None
            cost.set_load(load)
            if head is not None:
                # a level of the head's tree must add at least what its time buys at the current
                # rate (with a fixed budget nothing depends on measured time: no limit)
                head.min_gain = (
                    head.level_ms / 1000 * cost.rate(max(state.recent[-1:] or [0]) + 1)
                    if opts.fixed_budget is None
                    else 0.0
                )
            # a one-token step when drafting does not pay (measured): no tree, one row verified
            one_step = opts.fixed_budget is None and state.mode.next_is_sequential()
            # (auto: the extra nodes bets are drawn from are proposed while bets are being
            # taken, and on every AHEAD_LOOK-th drafted round after none was)
            extra = EXTRA_NODES if not one_step and _looks_ahead(state, pipe) else 0
            if one_step:
                tree = DraftTree()
                stats.one_token_steps += 1
            else:
                if prompt_seen is not None:  # shown before the first drafted round, not before
                    # (a look at drafting while one-token steps win skips the prompt's LM-head
                    # rows: 80-150 ms of Qwen2.5-1.5B's for a chat prompt, paid on every reply)
                    shown = 0 if state.mode.sequential else PROMPT_ROWS
                    drafter.observe(_prompt_verified(runner, *prompt_seen, taps, shown))
                    prompt_seen = None
                if pending:
                    drafter.observe(_catch_up(ctx, pending, taps))
                    pending = []
                budget = (
                    opts.fixed_budget
                    if opts.fixed_budget is not None
                    else proposal_size(state.recent, opts.max_nodes)
                )
                proposal = limit_depth(drafter.propose(ctx, budget + extra), room)
                if opts.fixed_budget is not None:
                    tree = proposal.prefix(budget)
                else:
                    sized = _sized(proposal.prefix(budget), state, opts)
                    if sized is None:  # a look whose best tree loses by the drafter's estimates
                        one_step = True
                        stats.one_token_steps += 1
                    tree = DraftTree() if sized is None else sized
            m = len(chain)
            flight = start_round(runner, chain, tree, root, root_pos, keep)
            walk_rows, kept = list(range(m, m + 1 + len(tree))), list(range(m))
            stats.round_trips += 1
            stats.tree_nodes_sent += m + 1 + len(tree)
            chain = []
            if proposal is not None and not one_step and extra:
                ahead = send_ahead(
                    runner, proposal, len(tree), (root_pos, room, m), state.cost, state.hits, pipe
                )
                state.no_bets = 0 if ahead is not None else state.no_bets + 1
                if ahead is not None:
                    stats.round_trips += 1
                    stats.tree_nodes_sent += len(ahead.plan.tree)
        t_sent = time.perf_counter()
        draft_s = t_sent - t_round
        ids, parents = tree.block(root)
        lazy = opts.lazy_head and not getattr(drafter, "needs_all_logits", True)
        if dropped is not None:
            runner.finish(dropped)
            dropped = None
        states = runner.finish(flight)
        # the rows of the tree walked: [root, nodes...] (rows before them are not verified)
        pick_rows = (
            slice(walk_rows[0], walk_rows[-1] + 1)
            if walk_rows == list(range(walk_rows[0], walk_rows[-1] + 1))
            else torch.tensor(walk_rows)
        )
        hid = states.final[pick_rows]  # [B, H]
        feats = states.features()[pick_rows] if taps is not None else None  # [B, 3H]
        rows: torch.Tensor | LazyLogits
        if lazy:  # LM-head rows as the walk reaches them; same bits as computing them all
            rows = LazyLogits(runner.client, hid, parents, [1.0, *tree.probs])
        else:
            rows = runner.client.logits(hid)  # [B, V]
        kids: list[dict[int, int]] = [{} for _ in ids]
        for i in range(1, len(ids)):
            kids[parents[i]][ids[i]] = i
        node, path, targets, committed = 0, [0], {}, 0
        while True:
            tok = choose_token(rows[node], params, ctx, gen, kids[node])
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
        keep = [*kept, *(walk_rows[i] for i in path)]
        if ahead is not None:  # settle the bets on this round's outcome
            assert proposal is not None
            ahead.won = settle(ahead.plan, proposal, [i - 1 for i in path[1:]], ctx[-1])
            won = ahead.won.won if not done else None
            for j, p_hit in ahead.plan.bets.items():
                state.hits.update(p_hit, j == won)
            stats.pipelined_rounds += 1
            if won is not None:
                stats.pipeline_hits += 1
            else:  # its answer is dropped; the caches keep its rows on this round's path
                dropped = ahead.flight
                keep, chain = ahead.won.kept, ahead.won.chain
                ahead = None
        stats.accepted_hist[committed] = stats.accepted_hist.get(committed, 0) + 1
        if done:
            stats.draft_s += draft_s
            break
        t_learn = time.perf_counter()
        if one_step:
            row = rows.rows.get(0) if isinstance(rows, LazyLogits) else rows[0]
            pending.append((root_pos, row, None if feats is None else feats[:1]))
            if len(pending) > PENDING_ROWS:  # a long run of one-token steps: keep its last
                old_pos, _, old_feats = pending[-PENDING_ROWS - 1]  # rows' logits only
                pending[-PENDING_ROWS - 1] = (old_pos, None, old_feats)
        elif isinstance(rows, LazyLogits):  # rows never computed: ids -1, probabilities 0
            top_ids = torch.full((len(ids), TOPK), -1, dtype=torch.long)
            top_probs = torch.zeros(len(ids), TOPK)
            done_rows = sorted(rows.rows)
            t_ids, t_probs = top_successors(torch.stack([rows.rows[i] for i in done_rows]), TOPK)
            top_ids[done_rows], top_probs[done_rows] = t_ids, t_probs
        else:
            top_ids, top_probs = top_successors(rows, TOPK)  # [B, K]
        if not one_step:
            drafter.observe(
                Verified(
                    ctx, ids, parents, top_ids, top_probs, path, targets, root_pos, feats, taps
                )
            )
        draft_s += time.perf_counter() - t_learn
        stats.draft_s += draft_s
        if kernels.compiles() != compiled:
            # a first-use compile ran inside this round: its time says nothing about what a
            # round costs (one in the first drafted round of a fresh install made drafting look
            # ten times dearer and kept it off for the session), so nothing learns from it
            stats.cold_rounds += 1
            continue
        if carried is None and cost.stalled(walk_rows[-1] + 1, t_learn - t_sent):
            stats.stalled_rounds += 1  # a one-off hiccup, not what a round costs: not learned
            continue
        if carried is None:  # (a carried round's wait overlapped the round before it)
            cost.observe(walk_rows[-1] + 1, t_learn - t_sent)
        if not one_step:  # the rate a head must beat is that of drafted rounds
            cost.observe_round(draft_s, committed)
        if opts.fixed_budget is None:
            office_s = cost.office_seconds(time.perf_counter() - t_round, walk_rows[-1] + 1)
            state.mode.observe(one_step, office_s, committed)
    for late in (dropped, None if ahead is None else ahead.flight):
        if late is not None:  # sent before the round that ended the reply: dropped
            runner.finish(late)
    stats.new_tokens = len(out.token_ids)
    stats.decode_s = time.perf_counter() - t_first
    return GenerationResult(out.text, out.token_ids, out.finish_reason or "length", stats)


def _pipeline_mode(runner: SplitRunner, opts: SpecOptions) -> str:
    if opts.pipeline not in ("off", "auto", "always"):
        raise ValueError(f"unknown pipeline mode '{opts.pipeline}' (off, auto or always)")
    trunk = getattr(_key(runner), "trunk", None)
    if opts.pipeline == "auto" and (not runner.remote or isinstance(trunk, LocalTrunk)):
        return "off"  # no link whose wait a second round could fill
    return opts.pipeline


AHEAD_LOOK = 8  # pipeline "auto": after a drafted round without a bet worth sending, look again
# for one only every 8th drafted round (proposing the extra nodes costs drafting time)


def _looks_ahead(state: _RunnerState, pipe: str) -> bool:
    """Whether this drafted round proposes the extra nodes that bets are drawn from."""
    if pipe != "auto" or state.no_bets == 0:
        return pipe != "off"
    state.looks += 1
    return state.looks % AHEAD_LOOK == 0


def _sized(tree: DraftTree, state: _RunnerState, opts: SpecOptions) -> DraftTree | None:
    """The prefix of a proposed tree the cost model sends (an exploring size every fourth
    drafted round while recent sizes vary too little), or None for a look at drafting — a
    drafted round while one-token steps win — whose best prefix the drafter's own calibrated
    estimates say commits less per second than a one-token step: that step is taken instead,
    and the look still counts, so the next one waits as long as if it had been taken (looks
    that commit one token at a tree's price were most of what one-token-step runs lost to
    sequential decoding)."""
    cost, mode = state.cost, state.mode
    probs = tree.path_probs()
    n = cost.choose(probs)
    if mode.sequential:
        # (until a slope is fitted the price of a node is a guess: then only a tree expected to
        # add next to nothing is skipped, so a wrong guess cannot keep drafting off for good)
        pays = (
            cost.prefix_rate(probs, n) > mode.seq_rate()
            if cost.slope_known
            else sum(probs[:n]) >= LOOK_GAIN
        )
        if not pays:
            return None
    state.rounds += 1
    # exploration rounds learn this client's own slope; on a shared trunk the price of a row is
    # mostly the others' time, and a big exploring tree would cost them most; a look is timed
    # as it is sized (an exploring look cost Qwen2.5-1.5B 0.4-0.5 s for one token, fully local)
    explore = cost.spread() < MIN_SPREAD and state.rounds % 4 == 0
    if explore and cost.shared_s == 0 and not mode.sequential:
        n = explore_size(n, len(tree), opts.max_nodes)
    sent = tree.prefix(n)
    state.recent = [*state.recent[-7:], len(sent)]
    return sent


LOOK_GAIN = 0.5  # tokens a look's tree must be expected to add while the node price is a guess
PROMPT_ROWS = 1024  # the prompt's last rows whose top successors the drafter learns
PROMPT_PIECE = 256  # rows of LM-head logits computed at a time for them
# one-token steps whose logits rows wait for the drafter (older ones drop theirs: a 2,000-token
# run would otherwise hold 2,000 rows of the vocabulary, 1.2 GB for a 152k-token one)
PENDING_ROWS = 256


def _prompt_verified(
    runner: SplitRunner,
    ctx: Sequence[int],
    hidden: torch.Tensor,
    feats: torch.Tensor | None,
    taps: tuple[int, int, int] | None,
    rows: int = PROMPT_ROWS,
) -> Verified:
    """The prompt as a chain whose every node was "accepted" (``ctx``: the prompt and the first
    generated token; ``hidden`` [L, H]: the prompt's final hidden states). Its logits rows are
    computed here, :data:`PROMPT_PIECE` at a time and only for the last ``rows`` (the rest are
    marked never computed): a one-token step never pays for them, and a long document never
    holds an [L, V] logits matrix (an 8k-token prompt of a 152k-token vocabulary is 4.9 GB in
    float32)."""
    n = hidden.shape[0]
    top_ids = torch.full((n, TOPK), -1, dtype=torch.long)  # [L, K]
    top_probs = torch.zeros(n, TOPK)  # [L, K]
    for a in range(max(0, n - rows), n, PROMPT_PIECE):
        b = min(n, a + PROMPT_PIECE)
        top_ids[a:b], top_probs[a:b] = top_successors(runner.client.logits(hidden[a:b]), TOPK)
    return _chain(ctx, 0, top_ids, top_probs, feats, taps)


def _chain(
    ctx: Sequence[int],
    r: int,
    top_ids: torch.Tensor,
    top_probs: torch.Tensor,
    hidden: torch.Tensor | None,
    taps: tuple[int, int, int] | None,
) -> Verified:
    """Positions ``r .. r + m - 1`` of ``ctx`` (m: the rows of ``top_ids``) as one verified
    chain whose every node was accepted, each followed by the next token of ``ctx``."""
    m = top_ids.shape[0]
    return Verified(
        ctx,
        list(ctx[r : r + m]),
        list(range(-1, m - 1)),
        top_ids,
        top_probs,
        list(range(m)),
        {i: ctx[r + i + 1] for i in range(m)},
        r,
        hidden,
        taps if hidden is not None else None,
    )


def _catch_up(
    ctx: Sequence[int],
    pending: Sequence[tuple[int, torch.Tensor | None, torch.Tensor | None]],
    taps: tuple[int, int, int] | None,
) -> Verified:
    """Consecutive one-token steps as one round whose chain was all accepted (as the prompt's
    prefill is shown): their roots, each one's next token, the model's top successors where its
    logits row was computed, and the features a learned head reads (when every step had them)."""
    r = pending[0][0]
    m = len(pending)
    top_ids = torch.full((m, TOPK), -1, dtype=torch.long)  # [m, K]
    top_probs = torch.zeros(m, TOPK)  # [m, K]
    have = [i for i, (_, row, _) in enumerate(pending) if row is not None]
    rows = [row for _, row, _ in pending if row is not None]
    if rows:
        top_ids[have], top_probs[have] = top_successors(torch.stack(rows), TOPK)  # [h, V]
    feats = [f for _, _, f in pending if f is not None]
    hidden = torch.cat(feats) if len(feats) == m else None  # [m, 3H]
    return _chain(ctx, r, top_ids, top_probs, hidden, taps)


def trunk_load(runner: SplitRunner) -> Load | None:
    """The load the runner's trunk reported with its latest reply (None: a local trunk, or a
    server that does not report it)."""
    trunk = getattr(_key(runner), "trunk", None)
    load = getattr(trunk, "load", None)
    return load if isinstance(load, Load) else None


def _taps(runner: SplitRunner, head: HeadDraft | None) -> tuple[int, int, int] | None:
    """The feature layers to hand the drafter: only when a head that reads them is present."""
    if head is None or not hasattr(runner, "forward_states"):
        return None
    taps = runner.client.tap_layers()
    return taps if head.accepts(taps) else None


def _joined(
    blocks: list[tuple[torch.Tensor, torch.Tensor | None]],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits (and features) of a prompt read in several blocks, as one block's."""
    if len(blocks) == 1:
        return blocks[0]
    feats = [f for _, f in blocks if f is not None]
    return torch.cat([lg for lg, _ in blocks]), torch.cat(feats) if feats else None


DECODERS["speculative"] = generate_speculative


def generate_pipelined(
    runner: SplitRunner,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    on_text: TextCallback | None = None,
    cancel: CancelToken | None = None,
    prefill: Prefill | None = None,
) -> GenerationResult:
    """The speculative decoder with rounds in flight where they pay (``pipeline="auto"``)."""
    return generate_speculative(
        runner,
        prompt_ids,
        params,
        on_text=on_text,
        cancel=cancel,
        options=SpecOptions(pipeline="auto"),
        prefill=prefill,
    )


DECODERS["pipelined"] = generate_pipelined
