"""Draft sources: suffix index, token recycling, the merger and its calibration."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.drafts import (
    DraftSource,
    DraftTree,
    MergedCalibration,
    RecyclingDraft,
    SuffixDraft,
    TreeDrafter,
    Verified,
    default_drafter,
)


def _paths(tree: DraftTree) -> list[list[int]]:
    out: list[list[int]] = []
    for t, p in zip(tree.tokens, tree.parents, strict=True):
        out.append([*(out[p] if p >= 0 else []), t])
    return out


def _valid(tree: DraftTree, budget: int) -> None:
    assert len(tree) <= budget
    assert all(-1 <= p < i for i, p in enumerate(tree.parents))
    paths = _paths(tree)
    assert len({tuple(p) for p in paths}) == len(paths)  # no duplicate sibling tokens
    pp = tree.path_probs()
    assert all(0.0 <= p <= 1.0 for p in pp)


def test_sources_implement_the_protocol() -> None:
    for s in (SuffixDraft(), RecyclingDraft(), default_drafter()):
        assert isinstance(s, DraftSource)


def test_suffix_draft_continues_the_longest_match() -> None:
    ctx = [1, 2, 3, 4, 5, 9, 9, 7, 2, 3, 4, 6, 8, 1, 2, 3, 4]
    tree = SuffixDraft().propose(ctx, 8)
    _valid(tree, 8)
    paths = _paths(tree)
    # the longest match "1 2 3 4" was followed by 5 9 9 7: that chain comes first
    assert paths[:4] == [[5], [5, 9], [5, 9, 9], [5, 9, 9, 7]]


def test_suffix_draft_merges_several_continuations() -> None:
    ctx = [1, 2, 3, 5, 9, 1, 2, 3, 6, 8, 1, 2, 3, 6, 4, 1, 2, 3]
    s = SuffixDraft()
    s.prepare(ctx)
    kids = {t: q for t, q, _ in s.children(ctx, 1)}
    assert set(kids) == {5, 6}
    assert kids[6] == pytest.approx(2 * kids[5])  # two of the three occurrences continue with 6
    paths = _paths(s.propose(ctx, 6))
    assert [6] in paths and [5] in paths
    assert [6, 8] in paths or [6, 4] in paths


def test_suffix_draft_index_follows_a_growing_context() -> None:
    s = SuffixDraft()
    ctx = [5, 6, 7, 8, 5, 6]
    assert _paths(s.propose(ctx, 4))[0] == [7]
    ctx += [7, 8, 5]
    assert [6, 7, 8] in _paths(s.propose(ctx, 8))
    # a different conversation resets the index
    assert len(s.propose([1, 2, 3], 4)) == 0


def test_recycling_expands_stored_successors() -> None:
    r = RecyclingDraft(k=2)
    ids = torch.tensor([[11, 12], [21, 22], [31, 32]])  # [B, k]
    probs = torch.tensor([[0.9, 0.05], [0.6, 0.3], [0.6, 0.3]])  # [B, k]
    r.learn([10, 11, 21], ids, probs)
    tree = r.propose([3, 10], 4)
    _valid(tree, 4)
    # path probabilities 0.9, 0.54, 0.324, 0.27 (then [12] at 0.05 is over budget)
    assert _paths(tree) == [[11], [11, 21], [11, 21, 31], [11, 22]]
    assert len(r.propose([3, 99], 4)) == 0


def test_recycling_skips_rows_whose_logits_were_not_computed() -> None:
    # the lazy LM head marks rows it never computed with ids -1 and probabilities 0
    r = RecyclingDraft(k=2)
    ids = torch.tensor([[11, 12], [-1, -1], [31, 32]])  # [B, k]
    probs = torch.tensor([[0.9, 0.05], [0.0, 0.0], [0.6, 0.3]])  # [B, k]
    r.learn([10, 11, 21], ids, probs)
    assert r.children([3, 11], 1) == []  # nothing learned for 11: no token -1 proposed
    assert [t for t, _, _ in r.children([3, 21], 1)] == [31, 32]
    assert all(t >= 0 for t in r.propose([3, 10], 8).tokens)


def test_recycling_lists_pair_and_single_successors() -> None:
    r = RecyclingDraft(k=2)
    # token 5 after 1 was followed by {7, 8}; token 5 after 2 (more recent) by {8, 9}
    r.learn([1, 5], torch.tensor([[5, 6], [7, 8]]), torch.tensor([[0.5, 0.2], [0.6, 0.3]]))
    r.learn([2, 5], torch.tensor([[5, 6], [8, 9]]), torch.tensor([[0.5, 0.2], [0.7, 0.2]]))
    kids = {t: (p, key) for t, p, key in r.children([1, 5], 1)}
    # one child per token: 7 only in the pair (1, 5), 9 only in the single-token table, 8 in
    # both (with its best probability and rank); the key's kind says which
    assert sorted(kids) == [7, 8, 9]
    assert [kids[t][1][0] for t in (7, 8, 9)] == [1, 4, 0]
    assert kids[8][0] == pytest.approx(0.7) and kids[8][1][1] == 0  # max prob, best rank
    assert kids[7][1] != kids[8][1]  # calibrated separately
    tree = r.propose([1, 5], 2)
    _valid(tree, 2)
    assert tree.tokens == [8, 7]
    # the merged drafter does not count the correlated tables as independent evidence (0.7, not
    # 1 - 0.3 * 0.4); the three children's estimates (0.7, 0.6, 0.2) add up to more than 1, so
    # they are scaled down together
    merged = TreeDrafter([r]).propose([1, 5], 1)
    assert merged.tokens == [8] and merged.probs[0] == pytest.approx(0.7 / 1.5)


@settings(max_examples=40, deadline=None)
@given(
    ctx=st.lists(st.integers(0, 6), min_size=1, max_size=60),
    budget=st.integers(0, 24),
)
def test_merged_tree_is_valid_and_best_first(ctx: list[int], budget: int) -> None:
    d = default_drafter()
    rec = d.sources[1]
    assert isinstance(rec, RecyclingDraft)
    g = torch.Generator().manual_seed(len(ctx))
    logits = torch.randn(len(ctx), 7, generator=g)  # [L, V]
    top = logits.softmax(-1).topk(4, dim=-1)  # [L, 4]
    rec.learn(ctx, top.indices, top.values)
    tree = d.propose(ctx, budget)
    _valid(tree, budget)
    pp = tree.path_probs()
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(pp))
    for n in range(len(tree) + 1):
        _valid(tree.prefix(n), n)


class _Children:
    """A draft source that proposes the same children of the root every round:
    (token, raw probability, calibration key) each."""

    name = "fixed"

    def __init__(self, children: list[tuple[int, float, object]]) -> None:
        self.children = children

    def propose(self, context: list[int], budget: int) -> DraftTree:
        t = DraftTree()
        for tok, p, key in self.children:
            t.add(tok, -1, p, key=key)
        return t

    def observe(self, verified: Verified) -> None:
        pass

    def reset(self) -> None:
        pass


def test_calibration_learns_from_verification() -> None:
    d = TreeDrafter([_Children([(7, 0.9, "k")])])
    before = d.propose([1], 4).probs[0]
    for _ in range(20):  # the model never picks 7
        tree = d.propose([1], 4)
        top = torch.zeros(2, 1)  # [B, 1]
        d.observe(Verified([1, 5], [1, 7], [-1, 0], top.long(), top, [0], {0: 5}, root_index=0))
    after = d.propose([1], 4).probs[0]
    assert before == 0.9
    assert after < 0.25
    assert len(tree) == 1


def test_only_the_round_that_verified_a_proposal_calibrates_it() -> None:
    """Other rounds shown to the drafter (the prompt, one-token steps caught up as a chain, a
    proposal never sent) say nothing about the last tree: they must not count as its misses."""
    d = TreeDrafter([_Children([(7, 0.9, "k")])])
    top = torch.zeros(2, 1)  # [B, 1]
    for _ in range(20):
        d.propose([1], 4)  # root at position 0, never verified: a chain from elsewhere follows
        d.observe(Verified([3, 4, 5], [4, 5], [-1, 0], top.long(), top, [0, 1], {0: 5}, 1))
        d.propose([1], 4)
        d.observe(Verified([1, 5], [1, 8], [-1, 0], top.long(), top, [0], {0: 5}, 0))  # other
    assert d.propose([1], 4).probs[0] == 0.9  # nothing learned
    for _ in range(2):  # the same round seen twice counts once
        d.propose([1], 4)
        v = Verified([1, 5], [1, 7], [-1, 0], top.long(), top, [0], {0: 5}, 0)
        d.observe(v)
        d.observe(v)
    once = TreeDrafter([_Children([(7, 0.9, "k")])])
    for _ in range(2):
        once.propose([1], 4)
        once.observe(Verified([1, 5], [1, 7], [-1, 0], top.long(), top, [0], {0: 5}, 0))
    assert d.propose([1], 4).probs[0] == once.propose([1], 4).probs[0] < 0.9


def test_merged_calibration_learns_the_acceptance_rate_per_bucket() -> None:
    m = MergedCalibration(buckets=20, prior_weight=8.0)
    assert m(0.6) == pytest.approx(0.6)  # nothing seen: the estimate itself
    for i in range(100):  # estimates of 0.6 were right one time in four
        m.update(0.6, i % 4 == 0)
    assert m(0.61) == pytest.approx((25 + 8 * 0.61) / 108)
    assert m(0.2) == pytest.approx(0.2)  # other buckets keep their own (no) evidence


def test_siblings_estimates_never_add_up_to_more_than_one() -> None:
    d = TreeDrafter([_Children([(tok, 0.9, tok) for tok in (7, 8, 9)])])  # each "90 % sure"
    tree = d.propose([1], 8)
    assert sorted(tree.tokens) == [7, 8, 9]
    assert sum(tree.probs) == pytest.approx(1.0)  # at most one of them can be the target
    for _ in range(40):  # 7 is the target every time
        d.propose([1], 8)
        top = torch.zeros(4, 1)  # [B, 1]
        block = [1, 7, 8, 9], [-1, 0, 0, 0]
        d.observe(Verified([1, 7], *block, top.long(), top, [0, 1], {0: 7}, root_index=0))
    tree = d.propose([1], 8)
    probs = dict(zip(tree.tokens, tree.probs, strict=True))
    assert tree.tokens[0] == 7 and probs[7] > 0.7 and probs[8] < 0.2
    assert sum(tree.probs) <= 1.0 + 1e-9


def test_recycling_borrows_successors_of_a_similar_token() -> None:
    emb = torch.eye(6)  # [V, H]
    emb[5] = torch.tensor([0.0, 0.0, 0.95, 0.05, 0.0, 0.0])  # token 5 looks like token 2
    r = RecyclingDraft(k=2, embeddings=emb, min_similarity=0.5)
    r.learn([2], torch.tensor([[3, 4]]), torch.tensor([[0.8, 0.1]]))
    kids = r.children([1, 5], 1)
    assert [t for t, _, _ in kids] == [3, 4]
    assert kids[0][1] == pytest.approx(0.4)  # discounted: borrowed, not observed
    assert r.children([1, 0], 1) == []  # token 0 is like nothing seen


def test_similar_token_lookup_stays_exact_as_tokens_are_learned() -> None:
    """The nearest known token is remembered and only newly learned tokens are compared on a
    later query: the answer must equal a comparison against every known token each time."""
    g = torch.Generator().manual_seed(9)
    emb = torch.randn(40, 8, generator=g)  # [V, H]
    r = RecyclingDraft(k=1, embeddings=emb, min_similarity=-1.0)
    unit = torch.nn.functional.normalize(emb, dim=-1)
    for step, tok in enumerate([3, 17, 25, 8, 31, 12, 5, 36]):
        r.learn([tok], torch.tensor([[100 + step]]), torch.tensor([[0.5]]))
        known = list(r.table)
        for query in (0, 1, 2, 39):
            got = r._similar(query)
            best = known[int(torch.argmax(unit[known] @ unit[query]))]
            assert got is not None and got[0] == r.table[best][0], (step, query)


def test_recycling_hint_from_the_rejected_sibling() -> None:
    r = RecyclingDraft(k=2)
    # block: root 10 -> 11 (accepted) -> 12 (rejected: the model chose 13 after 11)
    v = Verified(
        context=[1, 10, 11, 13],
        tokens=[10, 11, 12],
        parents=[-1, 0, 1],
        topk_ids=torch.tensor([[11, 5], [13, 12], [40, 41]]),  # [B, k]
        topk_probs=torch.tensor([[0.9, 0.1], [0.6, 0.3], [0.7, 0.2]]),  # [B, k]
        path=[0, 1],
        targets={0: 11, 1: 13},
        root_index=1,
    )
    r.observe(v)
    kids = r.children([1, 10, 11, 13], 1)  # 13 was never seen: only the hint knows
    assert [t for t, _, _ in kids] == [40, 41]
    assert r.children([1, 10, 11, 13, 7, 13], 2) == []  # the hint is for the next root only
    assert r.pair_table[(11, 12)] == ([40, 41], pytest.approx([0.7, 0.2]))
