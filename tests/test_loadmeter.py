"""The trunk's load report (remote/loadmeter.py, issue 32): what each reply says of the load."""

from __future__ import annotations

import pytest

from engine import protocol as P
from remote.loadmeter import MIN_ROW_SHARE, LoadMeter


def test_row_cost_is_the_slope_of_batch_time_over_rows() -> None:
    m = LoadMeter()
    t = 0.0
    for rows in (1, 8, 3, 16, 2, 30, 5):
        dt = 0.030 + 0.002 * rows  # 30 ms fixed, 2 ms per row
        m.batch(rows, 1, 0, t, t + dt)
        t += dt
    assert m.row_ms() == pytest.approx(2.0, rel=1e-6)
    load = m.snapshot()
    assert load.row_ms == pytest.approx(2.0, abs=1e-3)
    assert load.fixed_ms == pytest.approx(30.0, abs=1e-3)
    assert load.busy == pytest.approx(1.0)  # back to back
    assert load.peers == 0.0


def test_without_a_spread_of_sizes_the_row_cost_is_the_average_per_row() -> None:
    m = LoadMeter()
    for i in range(5):
        m.batch(4, 1, 0, float(i), float(i) + 0.040)  # 40 ms per 4-row batch, 1 s apart
    assert m.row_ms() == pytest.approx(10.0)  # an upper bound on the marginal cost
    assert m.snapshot().fixed_ms == pytest.approx(0.0)
    assert m.snapshot().busy == pytest.approx(0.04, abs=1e-3)


def test_a_noisy_fit_never_prices_a_row_at_zero() -> None:
    # a busy machine: the bigger batches happened to run faster, so the fitted slope is negative
    m = LoadMeter()
    t = 0.0
    for rows, dt in ((1, 0.012), (8, 0.010), (2, 0.013), (16, 0.009), (4, 0.011)):
        m.batch(rows, 1, 0, t, t + dt)
        t += dt
    mean_per_row_ms = 1000.0 * sum((0.012, 0.010, 0.013, 0.009, 0.011)) / sum((1, 8, 2, 16, 4))
    assert m.row_ms() > 0.0
    load = m.snapshot()
    assert load.row_ms == pytest.approx(MIN_ROW_SHARE * mean_per_row_ms, rel=0.05)
    assert load.fixed_ms > 0.0


def test_peers_count_batch_mates_and_queued_steps_smoothed() -> None:
    m = LoadMeter(decay=0.5)
    m.batch(8, 4, 2, 0.0, 0.1)  # 3 batch mates + 2 waiting
    assert m.snapshot().peers == pytest.approx(5.0)
    m.batch(1, 1, 0, 0.1, 0.2)  # alone
    assert m.snapshot().peers == pytest.approx(2.5)


def test_snapshot_stays_within_what_the_protocol_accepts() -> None:
    m = LoadMeter()
    assert m.snapshot() == P.Load(0.0, 0.0, 0.0, 0.0)  # before any batch
    m.batch(1, 10**7, 10**7, 0.0, 1e6)
    snap = m.snapshot()
    assert snap.peers <= P.MAX_LOAD_PEERS and snap.row_ms <= P.MAX_LOAD_ROW_MS
    P.check_load(
        {"peers": snap.peers, "row_ms": snap.row_ms, "busy": snap.busy, "fixed_ms": snap.fixed_ms}
    )
