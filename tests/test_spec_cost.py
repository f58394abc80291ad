"""The cost model and the mode chooser of the speculative decoder (engine/spec_cost.py): tree
sizes from fitted round times, exploration, proposal sizes, drafted rounds against one-token
steps, and pricing in office seconds under a trunk's reported load."""

from __future__ import annotations

import itertools

import pytest

import engine.spec_cost as sc
from engine import protocol as P


def test_cost_model_fits_round_time_and_picks_the_best_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cm = sc.CostModel()
    for n in (1, 5, 10, 20, 40, 1, 30):
        cm.observe(n, 0.120 + 0.002 * n)  # 120 ms fixed, 2 ms per node
    a, b = cm.coefficients()
    assert abs(a - 0.120) < 1e-6 and abs(b - 0.002) < 1e-7
    # expected tokens/s of a prefix: (1 + sum p) / (a + b (n + 1)); for n = 0..8 of
    # [0.9, 0.8, 0.7, 0, 0, ...]: 8.20, 15.32, 21.43, 26.56 (best), 26.15, 25.76, 25.37, 25.00,
    # 24.64
    flat = [0.9, 0.8, 0.7, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    monkeypatch.setattr(sc, "SIZE_SLACK", 0.0)
    assert cm.choose(flat) == 3  # the best rate
    assert cm.choose([0.9, 0.8, 0.7, 0.01, 0.01]) == 3
    assert cm.choose([]) == 0
    # with slack, the largest prefix within it of the best rate
    monkeypatch.setattr(sc, "SIZE_SLACK", 0.03)  # floor 25.77
    assert cm.choose(flat) == 4
    assert cm.choose([0.9, 0.8, 0.7, 0.01, 0.01]) == 5  # 25.91
    monkeypatch.setattr(sc, "SIZE_SLACK", 0.06)  # floor 24.97
    assert cm.choose(flat) == 7
    cheap = sc.CostModel()
    for n in (1, 8, 16, 32):
        cheap.observe(n, 0.001 + 0.01 * n)  # compute-bound: every node costs a lot
    assert cheap.choose([0.3, 0.2, 0.1]) == 0


def test_exploration_rounds_send_a_clearly_different_size() -> None:
    assert sc.explore_size(6, 40, 63) == 20  # twice the choice plus 8
    assert sc.explore_size(6, 12, 63) == 3  # the proposal is too small to go up: half
    assert sc.explore_size(40, 63, 63) == 63  # as far as the limit goes
    assert sc.explore_size(60, 63, 63) == 30  # no room above: half
    assert sc.explore_size(0, 30, 63) == 8


def test_cost_model_slope_needs_varied_sizes() -> None:
    cm = sc.CostModel(prior_b=0.002)
    for n in (10, 12, 10, 12, 10, 12):  # variance 1: the slope would be noise
        cm.observe(n, 0.1 + 0.01 * (n == 12))
    assert cm.coefficients()[1] == pytest.approx(0.002)
    for n in (2, 30, 2, 30):
        cm.observe(n, 0.1 + 0.001 * n)
    assert cm.spread() > sc.MIN_SPREAD
    assert cm.coefficients()[1] < 0.002


def test_proposal_size_follows_the_cost_models_recent_choices() -> None:
    assert sc.proposal_size([], 64) == 64  # nothing chosen yet: draft the most
    assert sc.proposal_size([3, 5, 2], 64) == 18  # room to double the biggest recent choice
    assert sc.proposal_size([40], 64) == 64
    assert sc.proposal_size([0, 0], 64) == 8
    assert sc.proposal_size([0], 4) == 4


def _feed(mc: sc.ModeChooser, spec_round: tuple[float, int], seq_s: float, n: int) -> list[bool]:
    """Run ``n`` rounds through the chooser with fixed costs; the kinds it picked."""
    kinds = []
    for _ in range(n):
        one = mc.next_is_sequential()
        kinds.append(one)
        mc.observe(one, seq_s if one else spec_round[0], 1 if one else spec_round[1])
    return kinds


def test_mode_chooser_falls_back_to_one_token_steps_when_drafting_does_not_pay() -> None:
    mc = sc.ModeChooser()
    # drafted rounds: 0.2 s for 1.2 tokens (6 tok/s); one-token steps 0.05 s (20 tok/s)
    kinds = _feed(mc, (0.2, 1), 0.05, 200)
    assert kinds[: mc.WARM] == [False] * mc.WARM  # drafted rounds first ...
    assert kinds[mc.WARM : mc.WARM + mc.SEQ_PROBE] == [True] * mc.SEQ_PROBE  # ... then steps
    assert mc.sequential
    later = kinds[mc.WARM + mc.SEQ_PROBE :]
    looks = [i for i, one in enumerate(later) if not one]
    assert 0 < len(looks) <= 7  # drafted rounds only as looks, ever rarer
    gaps = [b - a for a, b in itertools.pairwise(looks)]
    assert gaps == sorted(gaps) and gaps[-1] > mc.MAX_PROBE // 2
    # a slower machine pays the looks at most once per MAX_PROBE rounds
    assert later[-mc.MAX_PROBE :].count(False) <= 1


def test_mode_chooser_looks_less_often_when_drafting_loses_by_far() -> None:
    far, near = sc.ModeChooser(), sc.ModeChooser()
    # drafted rounds commit 5 tok/s (far behind 20) or 15 tok/s (near): looks every 4*64 or 64
    far_kinds = _feed(far, (0.2, 1), 0.05, 1200)
    near_kinds = _feed(near, (0.2, 3), 0.05, 1200)
    assert far.sequential and near.sequential
    assert far_kinds[-600:].count(False) <= 3  # one look per 4 * MAX_PROBE rounds
    assert near_kinds[-600:].count(False) >= 600 // (near.MAX_PROBE + 2) - 1
    assert far._interval == 4 * far.MAX_PROBE and near._interval == near.MAX_PROBE


def test_mode_chooser_keeps_drafting_while_it_pays_and_switches_back() -> None:
    mc = sc.ModeChooser()
    kinds = _feed(mc, (0.1, 3), 0.05, 100)  # 30 tok/s drafted vs 20 tok/s one at a time
    assert not mc.sequential
    tail = kinds[mc.WARM + mc.SEQ_PROBE :]
    assert tail.count(True) <= 2 * 7 and tail[-mc.MAX_PROBE :].count(True) <= mc.SEQ_PROBE
    _feed(mc, (0.1, 1), 0.05, 2 * mc.MAX_PROBE + 4)  # the text stops being predictable
    assert mc.sequential
    _feed(mc, (0.1, 4), 0.05, 2 * mc.MAX_PROBE + 4)  # ... and becomes predictable again
    assert not mc.sequential


def test_cost_model_shrinks_trees_as_the_reported_row_cost_rises() -> None:
    cm = sc.CostModel()
    for n in (1, 5, 10, 20, 40, 1, 30):
        cm.observe(n, 0.030 + 0.001 * n)  # 30 ms fixed, 1 ms per node: big trees pay alone
    probs = [0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.3, 0.25, 0.2, 0.1, 0.05, 0.02]
    alone = cm.choose(probs)
    for peers in (0.0, 0.3):  # nobody else (on average): nothing changes
        cm.set_load(P.Load(peers=peers, row_ms=50.0, busy=1.0))
        assert cm.shared_s == 0.0 and cm.choose(probs) == alone
    sizes = []
    for peers, row_ms in ((1.0, 1.0), (3.0, 2.0), (7.0, 2.0), (7.0, 10.0), (50.0, 100.0)):
        cm.set_load(P.Load(peers=peers, row_ms=row_ms, busy=1.0))
        assert cm.shared_s == pytest.approx(peers * row_ms / 1000)
        sizes.append(cm.choose(probs))
    assert alone >= sizes[0] and sizes == sorted(sizes, reverse=True)
    assert sizes[0] > sizes[-1] == 0  # a saturated trunk: one-row rounds only
    # the rate a learned head must beat counts the others' time too
    cm.set_load(None)
    own = cm.rate(8)
    cm.set_load(P.Load(peers=7.0, row_ms=2.0, busy=1.0))
    assert cm.rate(8) < own


def test_office_cost_blends_own_time_and_trunk_time_by_the_others_share() -> None:
    cm = sc.CostModel()
    assert cm.office_line(0.2, 0.002) == (0.2, 0.002)  # no report: our own time
    cm.set_load(P.Load(peers=0.0, row_ms=2.0, busy=1.0, fixed_ms=30.0))
    assert cm.office_line(0.2, 0.002) == (0.2, 0.002)  # alone on the trunk: the same
    cm.set_load(P.Load(peers=3.0, row_ms=2.0, busy=0.0, fixed_ms=30.0))  # idle between steps
    a, b = cm.office_line(0.2, 0.002)
    assert (a, b) == pytest.approx((0.2, 0.002 + 3 * 0.002))  # plus the others' time per row
    cm.set_load(P.Load(peers=7.0, row_ms=2.0, busy=1.0, fixed_ms=30.0))  # saturated
    w = 7 / 8
    a, b = cm.office_line(0.2, 0.002)
    assert a == pytest.approx((1 - w) * 0.2 + w * 0.030)
    assert b == pytest.approx((1 - w) * (0.002 + 0.014) + w * 8 * 0.002)
    assert cm.office_seconds(0.2, 5) == pytest.approx(
        (1 - w) * 0.2 + 5 * ((1 - w) * 0.014 + w * 0.016) + w * 0.030
    )


def test_mode_chooser_weighs_office_seconds() -> None:
    """A drafted round of 8 rows that commits 2 tokens in 0.15 s beats one-token steps of
    0.1 s alone, but not on a trunk that is busy with seven others (2 ms per row, 30 ms per
    batch): there a one-token step costs the office about 0.05 s, the drafted round 0.15 s."""
    cost = sc.CostModel()
    cost.set_load(P.Load(peers=7.0, row_ms=2.0, busy=1.0, fixed_ms=30.0))
    alone, loaded = sc.ModeChooser(), sc.ModeChooser()
    for _ in range(60):
        for mc, office in ((alone, False), (loaded, True)):
            one = mc.next_is_sequential()
            rows, wall = (1, 0.1) if one else (8, 0.15)
            mc.observe(one, cost.office_seconds(wall, rows) if office else wall, 1 if one else 2)
    assert not alone.sequential and loaded.sequential


def test_a_fitted_slope_outlives_a_run_of_one_token_steps() -> None:
    cm = sc.CostModel(prior_b=0.002)
    for n in (1, 20, 4, 30, 2):
        cm.observe(n, 0.06 + 0.02 * n)  # a laptop verifying alone: 20 ms per node
    assert cm.coefficients()[1] == pytest.approx(0.02)
    for _ in range(200):  # drafting did not pay: one-token steps only, the big rounds decay
        cm.observe(1, 0.08)
    assert cm.spread() < sc.MIN_SPREAD
    assert cm.coefficients()[1] == pytest.approx(0.02)  # not back to the 2 ms prior
    # so the next look sends a small tree: with a = 60 ms the rates of 0..4 nodes are 12.5,
    # 13.0, 12.5, 11.5, 10.3 tokens/s, and 2 is the largest within the slack; the prior's
    # 2 ms per node would have sent all 4
    assert cm.choose([0.3, 0.2, 0.1, 0.05]) == 2


def test_the_prompts_time_per_row_bounds_the_slope_until_one_is_fitted() -> None:
    cm = sc.CostModel(prior_b=0.002)
    cm.seed_slope(40, 0.8)  # 20 ms per prompt row
    assert cm.coefficients() == (cm.prior_a, pytest.approx(0.02))
    cm.seed_slope(40, 0.04)  # a faster prompt never lowers it below what was seen
    assert cm.coefficients()[1] == pytest.approx(0.02)
    for n in (1, 20, 4, 30, 2):
        cm.observe(n, 0.1 + 0.005 * n)
    assert cm.coefficients()[1] == pytest.approx(0.005)
    cm.seed_slope(10, 1.0)  # once fitted, prompts no longer move it
    for _ in range(200):
        cm.observe(1, 0.105)
    assert cm.coefficients()[1] == pytest.approx(0.005)


def test_a_lone_stall_is_not_learned_from_but_two_in_a_row_are() -> None:
    cm = sc.CostModel()
    for n in itertools.islice(itertools.cycle([1, 9, 17, 25]), 40):
        assert not cm.stalled(n, 0.1 + 0.002 * n)  # ordinary rounds
        cm.observe(n, 0.1 + 0.002 * n)
    limit = sc.STALL_FACTOR * cm.predict(20) + sc.STALL_MARGIN  # ~0.81 s
    assert not cm.stalled(20, 0.5)  # slow, but within what the link's jitter may do
    assert cm.stalled(20, limit + 0.01)  # a one-second hiccup: not learned
    assert not cm.stalled(20, 0.14)  # an ordinary round after it
    assert cm.stalled(1, 2.0)  # one-token steps too
    assert not cm.stalled(1, 2.0)  # a second slow round in a row: the link changed
    assert cm.stalled(1, 2.0)  # (and the fit follows from the rounds learned)


def test_a_stall_before_anything_was_fitted_is_judged_by_the_priors() -> None:
    cm = sc.CostModel()
    assert cm.predict(20) == pytest.approx(0.05 + 20 * 0.002)
    assert not cm.stalled(20, 0.3)  # a first round at 150-200 ms of RTT
    assert cm.stalled(20, 1.05)  # the fresh install's first drafted round (a compile inside)
    cm.seed_slope(60, 1.2)  # a slow machine: the prompt read at 20 ms a row
    assert not cm.stalled(20, 1.05)
