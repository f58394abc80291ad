"""Rounds in flight (engine/spec_pipeline.py): round r+1 sent on a bet while round r is on the
wire. Whatever the bets, hits or misses, the tokens are exactly the sequential ones (greedy and
sampling), every block sent is counted, and a lost session or a refusal with two steps in flight
ends as it would with one."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine.speculative as spec
from engine import protocol as P
from engine.drafts import DraftTree
from engine.errors import ServerBusy
from engine.generate import GenerationStats, available_decoders, generate_sequential
from engine.sampling import SamplingParams
from engine.spec_pipeline import plan_ahead, settle
from engine.split import ClientModel, SplitRunner, load_client, load_trunk
from engine.transport import RemoteTrunk
from remote.server import TrunkServer
from tests.inproc_trunk import connect_without_eos, record_overlapped, trunk_in_thread
from tests.tiny import make_model

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
ALWAYS = spec.SpecOptions(pipeline="always")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipe-models")
    out = {}
    for i, fam in enumerate(FAMILIES):
        make_model(root / fam, fam, seed=40 + i)
        out[fam] = root / fam
    return out


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


_RUNNERS: dict[tuple[str, int], SplitRunner] = {}


def _runner(folder: Path, k: int = 1) -> SplitRunner:
    """A split runner with a local trunk, EOS off (random-weight outputs run long)."""
    key = (str(folder), k)
    if key not in _RUNNERS:
        client = load_client(str(folder), k)
        s, e = client.plan.trunk_range
        trunk = None if client.plan.fully_local else load_trunk(str(folder), s, e)
        runner = SplitRunner(client, trunk)
        client.config = dataclasses.replace(client.config, eos_token_ids=())
        _RUNNERS[key] = runner
    return _RUNNERS[key]


def _blocks_add_up(st_: GenerationStats) -> None:
    """Every block sent is the prompt, a verified round, or a round sent on a lost bet."""
    verified = sum(st_.accepted_hist.values())
    assert st_.round_trips == 1 + verified + st_.pipelined_rounds - st_.pipeline_hits
    assert sum(n * c for n, c in st_.accepted_hist.items()) == st_.new_tokens - 1
    assert 0 <= st_.pipeline_hits <= st_.pipelined_rounds


def test_registered_as_a_decoder() -> None:
    assert available_decoders()["pipelined"] is spec.generate_pipelined


def _proposal() -> DraftTree:
    t = DraftTree()
    a = t.add(10, -1, 0.9)  # 0
    b = t.add(11, a, 0.8)  # 1: a -> b
    t.add(12, -1, 0.05)  # 2
    c = t.add(13, b, 0.5)  # 3: a bet once 3 nodes are sent (parent b was sent)
    t.add(14, c, 0.7)  # 4: below it
    t.add(15, a, 0.1)  # 5: a bet below a
    return t


def test_bets_are_the_nodes_not_sent_below_sent_ones() -> None:
    t = _proposal()
    ahead = plan_ahead(t, 3, 10, None)
    assert ahead is not None
    # the block: the sent nodes on the way (0, 1), the bets (3, 5) and the subtree of 3 (4)
    assert ahead.source == [0, 1, 3, 4, 5]
    assert ahead.tree.tokens == [10, 11, 13, 14, 15]
    assert ahead.tree.parents == [-1, 0, 1, 2, 0]
    assert ahead.bets == {2: pytest.approx(0.9 * 0.8 * 0.5), 4: pytest.approx(0.9 * 0.1)}
    won = settle(ahead, t, [0, 1], 13)  # the walk took 0 and 1, then the model chose 13
    assert (won.won, won.kept, won.rows, won.chain) == (2, [0, 1], [2, 3], [])
    assert won.tree.tokens == [14] and won.tree.parents == [-1]
    other = settle(ahead, t, [0], 15)
    assert (other.won, other.kept, other.rows, len(other.tree)) == (4, [0], [4], 0)
    lost = settle(ahead, t, [0, 1], 99)  # no bet on 99: keep the path's rows of the block
    assert (lost.won, lost.kept, lost.chain) == (None, [0, 1], [])
    off = settle(ahead, t, [2], 7)  # the path left the block at once: send it again
    assert (off.won, off.kept, off.chain) == (None, [], [12])
    # priced: a bet is taken while p * a > (1 - p) * rows * b (the rows it adds)
    assert plan_ahead(t, 3, 10, (1.0, 0.2)) is None  # 0.36 < 0.64 * 4 * 0.2, 0.09 < 0.91 * 2 * 0.2
    cheap = plan_ahead(t, 3, 10, (1.0, 0.05))
    assert cheap is not None and cheap.source == [0, 1, 3, 4, 5]
    shallow = plan_ahead(t, 3, 2, None)  # no room below depth 2: only the bet on 15
    assert shallow is not None and shallow.source == [0, 5] and list(shallow.bets) == [1]
    assert plan_ahead(t, 6, 10, None) is None  # everything was sent


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fam=st.sampled_from(FAMILIES),
    k=st.sampled_from((1, 2)),
    prompt=st.one_of(
        st.lists(st.integers(3, 300), min_size=1, max_size=20),
        st.tuples(st.lists(st.integers(3, 300), min_size=1, max_size=5), st.integers(2, 8)).map(
            lambda t: t[0] * t[1]
        ),
    ),
    max_new=st.integers(1, 32),
    budget=st.one_of(st.none(), st.integers(0, 12)),
    eos_at=st.one_of(st.none(), st.integers(0, 31)),
    limit_at=st.one_of(st.none(), st.integers(1, 34)),
)
def test_rounds_in_flight_give_the_sequential_tokens(
    models: dict[str, Path],
    fam: str,
    k: int,
    prompt: list[int],
    max_new: int,
    budget: int | None,
    eos_at: int | None,
    limit_at: int | None,
) -> None:
    runner = _runner(models[fam], k)
    cfg = runner.client.config
    params = SamplingParams(max_new_tokens=max_new)
    try:
        free = generate_sequential(runner, prompt, params).token_ids
        # an EOS and a context limit that fall inside accepted paths and inside bets
        eos = (free[eos_at],) if eos_at is not None and eos_at < len(free) else ()
        limit = len(prompt) + limit_at if limit_at is not None else cfg.max_position_embeddings
        runner.client.config = dataclasses.replace(
            cfg, eos_token_ids=eos, max_position_embeddings=limit
        )
        ref = generate_sequential(runner, prompt, params)
        opts = dataclasses.replace(ALWAYS, fixed_budget=budget)
        got = spec.generate_speculative(runner, prompt, params, options=opts)
    finally:
        runner.client.config = cfg
    assert got.token_ids == ref.token_ids
    assert got.finish_reason == ref.finish_reason
    assert got.text == ref.text
    _blocks_add_up(got.stats)


# (prompt, new tokens) on the llama model, k = 1, a fixed budget of 6: bets are won and lost
REPEATS = [([7, 8, 9] * 6, 40), ([5, 6] * 8, 40), ([31, 32, 33, 34] * 3, 40), ([100, 101], 40)]


def test_bets_are_won_and_lost_and_the_tokens_do_not_change(models: dict[str, Path]) -> None:
    runner = _runner(models["llama"], 1)
    params = SamplingParams(max_new_tokens=40)
    hits = misses = 0
    for prompt, _ in REPEATS:
        ref = generate_sequential(runner, prompt, params)
        spec.forget(runner)
        got = spec.generate_speculative(
            runner, prompt, params, options=dataclasses.replace(ALWAYS, fixed_budget=6)
        )
        assert got.token_ids == ref.token_ids
        _blocks_add_up(got.stats)
        hits += got.stats.pipeline_hits
        misses += got.stats.pipelined_rounds - got.stats.pipeline_hits
    # both paths ran: a hit verifies round r+1 at once, a miss drops it and resends the chain
    assert hits > 0 and misses > 0


def test_sampling_with_rounds_in_flight_draws_what_sequential_draws(
    models: dict[str, Path],
) -> None:
    runner = _runner(models["qwen2"], 1)
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=5, repetition_penalty=1.1)
    bets = 0
    for seed in range(6):
        p = dataclasses.replace(params, seed=seed)
        want = generate_sequential(runner, [40, 41, 42] * 4, p).token_ids
        opts = dataclasses.replace(ALWAYS, fixed_budget=6)
        got = spec.generate_speculative(runner, [40, 41, 42] * 4, p, options=opts)
        assert got.token_ids == want
        bets += got.stats.pipelined_rounds
    assert bets > 0


def test_auto_sends_nothing_ahead_without_a_link(models: dict[str, Path]) -> None:
    runner = _runner(models["llama"], 1)
    auto = spec.SpecOptions(pipeline="auto")
    got = spec.generate_speculative(
        runner, [7, 8, 9] * 6, SamplingParams(max_new_tokens=24), options=auto
    )
    assert got.stats.pipelined_rounds == 0
    with pytest.raises(ValueError, match="unknown pipeline mode"):
        bad = spec.SpecOptions(pipeline="twice")
        spec.generate_speculative(runner, [7, 8], SamplingParams(max_new_tokens=4), options=bad)


# ---------------------------------------------------------------- through a real trunk server


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("pipe-remote") / "llama4"
    make_model(f, "llama", seed=4, n_layers=4)
    return f


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[TrunkServer]:
    with trunk_in_thread(folder, max_sessions=8, max_sessions_per_client=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(folder: Path) -> ClientModel:
    return load_client(str(folder), 1)


PROMPT = [7, 8, 9] * 6
PARAMS = SamplingParams(max_new_tokens=40)


@pytest.fixture(scope="module")
def reference(server: TrunkServer, client: ClientModel) -> list[int]:
    with connect_without_eos(server, client) as trunk:
        return generate_sequential(SplitRunner(client, trunk), PROMPT, PARAMS).token_ids


@pytest.fixture
def overlapped(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Step ids the client sent while an earlier step's answer was still out."""
    return record_overlapped(monkeypatch)


def _pipelined(trunk: RemoteTrunk, client: ClientModel) -> spec.GenerationResult:
    runner = SplitRunner(client, trunk)
    spec.forget(runner)
    return spec.generate_speculative(
        runner, PROMPT, PARAMS, options=dataclasses.replace(ALWAYS, fixed_budget=6)
    )


def test_two_steps_in_flight_over_the_server(
    server: TrunkServer, client: ClientModel, reference: list[int]
) -> None:
    with connect_without_eos(server, client) as trunk:
        got = _pipelined(trunk, client)
        assert got.token_ids == reference
        _blocks_add_up(got.stats)
        stats = trunk.json_stats()
        assert got.stats.pipelined_rounds > 0
        # sent before an earlier answer came: every round sent ahead, and the round after a
        # lost bet (it goes before the dropped answer is back)
        st_ = got.stats
        lost = st_.pipelined_rounds - st_.pipeline_hits
        assert st_.pipelined_rounds <= stats["overlapped_steps"] <= st_.pipelined_rounds + lost
        assert stats["round_trips"] == got.stats.round_trips and stats["replays"] == 0
        assert len(trunk.journal) == got.stats.round_trips
        # auto on a link: the same tokens whatever it decides
        runner = SplitRunner(client, trunk)
        auto = spec.generate_pipelined(runner, PROMPT, PARAMS)
        assert auto.token_ids == reference
        _blocks_add_up(auto.stats)


@pytest.mark.parametrize("lost_at", [5, 6, 17])
def test_a_session_lost_with_steps_in_flight_is_replayed(
    server: TrunkServer,
    client: ClientModel,
    reference: list[int],
    monkeypatch: pytest.MonkeyPatch,
    overlapped: set[int],
    lost_at: int,
) -> None:
    """The server forgets the session when the ``lost_at``-th decode step arrives (a restart):
    the steps in flight are sent again after a replay, and the tokens do not change."""
    real = TrunkServer._step_problem
    seen: list[int] = []

    def problem(self: TrunkServer, s: Any, m: P.Step, *a: Any) -> Any:
        seen.append(m.step)
        if len(seen) == lost_at + 1:
            self._drop(s, "dropped by the test")
            return P.E_UNKNOWN_SESSION, "no such session"
        return real(self, s, m, *a)

    monkeypatch.setattr(TrunkServer, "_step_problem", problem)
    with connect_without_eos(server, client) as trunk:
        got = _pipelined(trunk, client)
        assert got.token_ids == reference
        assert trunk.replays == 1
    # the lost step had another step in flight with it (sent after it, or before it)
    assert seen[lost_at] == lost_at and {lost_at, lost_at + 1} & overlapped


@pytest.mark.parametrize("refused", [5, 6])
def test_a_refused_step_in_flight_is_the_callers_error_and_the_next_reply_works(
    server: TrunkServer,
    client: ClientModel,
    reference: list[int],
    monkeypatch: pytest.MonkeyPatch,
    overlapped: set[int],
    refused: int,
) -> None:
    """The server refuses a decode step (busy) while another is in flight: the reply fails with
    the refusal's one clear error, and the next reply on the same connection is exact."""
    real = TrunkServer._step_problem
    seen: list[int] = []

    def problem(self: TrunkServer, s: Any, m: P.Step, *a: Any) -> Any:
        seen.append(m.step)
        if len(seen) == refused + 1:
            return P.E_BUSY, "server busy: test"
        return real(self, s, m, *a)

    monkeypatch.setattr(TrunkServer, "_step_problem", problem)
    with connect_without_eos(server, client) as trunk:
        with pytest.raises(ServerBusy):
            _pipelined(trunk, client)
        assert not trunk._inflight
        assert seen[refused] == refused and {refused, refused + 1} & overlapped
        monkeypatch.setattr(TrunkServer, "_step_problem", real)
        assert _pipelined(trunk, client).token_ids == reference
