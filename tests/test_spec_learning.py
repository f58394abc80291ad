"""What the speculative decoder learns from, and when it drafts: which rounds feed the cost
model and the mode chooser (not the prompt, not a round with a first-use compile or a one-off
stall), one-token steps mixed with drafted rounds, what the drafter is shown, and sizing by the
trunk's reported load — all with the output still exactly sequential's. The cost model's own
arithmetic is tested in test_spec_cost.py, exactness in test_speculative.py."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine.spec_cost as sc
import engine.speculative as spec
from engine import protocol as P
from engine.drafts import DraftTree, TreeDrafter, Verified
from engine.generate import generate_sequential
from engine.sampling import SamplingParams
from engine.split import SplitRunner
from tests.spec_support import (
    FAMILIES,
    build_models,
    one_thread,
    original_config,
    prompts,
    restore_configs,
    runner_for,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_models(tmp_path_factory)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(autouse=True)
def _restore_config() -> Iterator[None]:
    yield
    restore_configs()


def test_prefill_is_not_a_cost_model_observation(models: dict[str, Path]) -> None:
    runner = runner_for(models["llama"])
    spec.forget(runner)
    spec.generate_speculative(runner, list(range(3, 40)), SamplingParams(max_new_tokens=1))
    cm = spec.runner_state(runner).cost
    assert cm._w == 0.0  # one token: only the prefill ran, and it taught the cost model nothing


class _Recorder(sc.ModeChooser):
    """A chooser that drafts every round and records the rounds it is shown."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, float, int]] = []

    def next_is_sequential(self) -> bool:
        return False

    def observe(self, sequential: bool, seconds: float, committed: int) -> None:
        self.seen.append((sequential, seconds, committed))


@pytest.mark.parametrize("cold", [(), (0,), (1, 2), (0, 3)])
def test_rounds_with_a_first_use_compile_are_not_learned_from(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, cold: tuple[int, ...]
) -> None:
    """A numba compile inside a round (a fresh install's first drafted round compiled the top-k
    kernel: ~1.5 s) made drafting look ten times dearer and kept it off for the session. Rounds
    whose time includes a compile (``kernels.compiles()`` moved) are left out of the cost model
    and the mode chooser; the prompt's time with one does not seed the slope; the tokens are
    the same either way. ``cold``: the rounds (0 = the prompt) during which a compile ran."""
    runner = runner_for(models["llama"], 1)
    prompt, params = [5, 9, 3, 5, 9, 3, 5, 9, 11, 4], SamplingParams(max_new_tokens=10)
    spec.forget(runner)
    ref = spec.generate_speculative(runner, prompt, params)
    count = {"now": 0, "calls": 0}

    def compiles() -> int:  # called at the start and the end of the prompt and of each round
        count["calls"] += 1
        part = (count["calls"] - 1) // 2  # 0: the prompt, r: round r
        if count["calls"] % 2 == 0 and part in cold:
            count["now"] += 1  # a compile ran inside this part
        return count["now"]

    monkeypatch.setattr(spec.kernels, "compiles", compiles)
    spec.forget(runner)
    state = spec.runner_state(runner)
    state.mode = chooser = _Recorder()
    state.cost.seed_slope = lambda rows, seconds: seeded.append(rows)  # type: ignore[method-assign]
    state.cost.stalled = lambda rows, seconds: False  # type: ignore[method-assign]
    seeded: list[int] = []
    got = spec.generate_speculative(runner, prompt, params)
    assert got.token_ids == ref.token_ids
    rounds = got.stats.round_trips - 1
    assert rounds >= 4  # (so every case above has a round after its compile)
    learned = [r for r in range(1, rounds + 1) if r not in cold]
    # the last round ends the reply before anything is learned from it
    assert len(chooser.seen) == len([r for r in learned if r < rounds])
    assert got.stats.cold_rounds == len([r for r in cold if 0 < r < rounds])
    assert state.cost._w == pytest.approx(
        sum(state.cost.decay**i for i in range(len(chooser.seen)))
    )
    assert seeded == ([] if 0 in cold else [len(prompt)])
    spec.forget(runner)


@pytest.mark.parametrize(
    ("stalls", "skipped"), [((), ()), ((1,), (1,)), ((2, 3), (2,)), ((1, 3), (1, 3))]
)
def test_a_stalled_round_alone_is_not_learned_from(
    models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    stalls: tuple[int, ...],
    skipped: tuple[int, ...],
) -> None:
    """A round whose verification waited two seconds more (a network or machine hiccup) is left
    out of the cost model and the mode chooser, unless the round before was left out too: then
    the link really changed. A fake clock (1 ms a reading) makes every other round fast."""
    runner = runner_for(models["llama"], 1)
    prompt, params = [5, 9, 3, 5, 9, 3, 5, 9, 11, 4], SamplingParams(max_new_tokens=10)
    spec.forget(runner)
    ref = spec.generate_speculative(runner, prompt, params)
    clock = {"now": 0.0, "calls": 0}

    def perf_counter() -> float:
        clock["now"] += 0.001
        return clock["now"]

    def compiles() -> int:  # called at the start and the end of the prompt and of each round
        clock["calls"] += 1
        return 0

    finish = runner.finish

    def stalling_finish(flight: Any) -> Any:
        part = clock["calls"] // 2  # 0 while the prompt is read, r during round r
        if clock["calls"] % 2 == 1 and part in stalls:
            clock["now"] += 2.0
        return finish(flight)

    monkeypatch.setattr(spec, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(spec.kernels, "compiles", compiles)
    monkeypatch.setattr(runner, "finish", stalling_finish)
    spec.forget(runner)
    state = spec.runner_state(runner)
    state.mode = chooser = _Recorder()
    got = spec.generate_speculative(runner, prompt, params)
    assert got.token_ids == ref.token_ids
    rounds = got.stats.round_trips - 1
    assert rounds >= 4
    assert got.stats.stalled_rounds == len(skipped)
    learned = [r for r in range(1, rounds) if r not in skipped]
    assert len(chooser.seen) == len(learned)
    assert all(s < 0.5 for _, s, _ in chooser.seen) == (stalls == skipped)
    spec.forget(runner)


def test_top_successors_are_the_softmax_top_k() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 50, generator=g) * 4  # [B, V]
    ids, probs = spec.top_successors(logits, 6)
    ref = logits.softmax(-1).topk(6, dim=-1)
    assert torch.equal(ids, ref.indices)
    assert torch.allclose(probs, ref.values, rtol=1e-5, atol=1e-7)


def test_forget_drops_what_a_runner_learned(models: dict[str, Path]) -> None:
    runner = runner_for(models["llama"], 1)
    runner.client.config = original_config(models["llama"])
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    params = SamplingParams(max_new_tokens=6)
    spec.generate_speculative(runner, prompt, params)
    learned = spec.runner_state(runner)
    assert spec.runner_state(runner) is learned  # kept across generations
    recycle = learned.drafter.sources[-1]
    assert getattr(recycle, "table", None)  # the prompt's successors were recorded
    spec.forget(runner)
    fresh = spec.runner_state(runner)
    assert fresh is not learned and not getattr(fresh.drafter.sources[-1], "table", None)
    assert fresh.recent == []


class _Scripted(sc.ModeChooser):
    """A chooser that follows a fixed pattern of round kinds whatever the rounds' times; with
    ``looking`` its choice stands at one-token steps, so its drafted rounds are looks."""

    def __init__(self, pattern: list[bool], looking: bool = False) -> None:
        super().__init__()
        self.pattern = pattern
        self.i = 0
        self.sequential = looking

    def next_is_sequential(self) -> bool:
        one = self.pattern[self.i % len(self.pattern)]
        self.i += 1
        return one

    def observe(self, sequential: bool, seconds: float, committed: int) -> None:
        pass  # timing never changes the script


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fam=st.sampled_from(FAMILIES),
    pattern=st.lists(st.booleans(), min_size=1, max_size=6),
    temperature=st.sampled_from([0.0, 0.9]),
    seed=st.integers(0, 2**16),
)
def test_one_token_steps_mixed_with_drafted_rounds_stay_exact(
    models: dict[str, Path], fam: str, pattern: list[bool], temperature: float, seed: int
) -> None:
    runner = runner_for(models[fam], 1)
    cfg = original_config(models[fam])
    runner.client.config = dataclasses.replace(cfg, eos_token_ids=())
    try:
        prompt = [5, 9, 3, 5, 9, 3, 5, 9, 11, 4]
        params = SamplingParams(max_new_tokens=14, temperature=temperature, top_k=20, seed=seed)
        ref = generate_sequential(runner, prompt, params)
        spec.forget(runner)
        chooser = _Scripted(pattern)
        spec.runner_state(runner).mode = chooser
        got = spec.generate_speculative(runner, prompt, params)
        assert got.token_ids == ref.token_ids and got.text == ref.text
        assert chooser.i == got.stats.round_trips - 1  # asked once per round after the prompt
        steps = [pattern[i % len(pattern)] for i in range(chooser.i)]
        assert got.stats.one_token_steps == sum(steps)
    finally:
        runner.client.config = cfg
        spec.forget(runner)


def test_one_token_steps_draft_nothing(models: dict[str, Path]) -> None:
    runner = runner_for(models["llama"], 1)

    class Counting(TreeDrafter):
        calls = 0

        def propose(self, context: list[int], budget: int) -> DraftTree:  # type: ignore[override]
            Counting.calls += 1
            return super().propose(context, budget)

    spec.forget(runner)
    spec.runner_state(runner).mode = _Scripted([True])
    drafter = Counting(spec.runner_state(runner).drafter.sources)
    got = spec.generate_speculative(
        runner, [5, 6, 7, 8, 5, 6, 7], SamplingParams(max_new_tokens=8), drafter=drafter
    )
    assert Counting.calls == 0
    assert got.stats.one_token_steps == got.stats.round_trips - 1 == got.stats.new_tokens - 1
    spec.forget(runner)


def test_one_token_steps_are_shown_to_the_drafter_as_one_chain_without_gaps(
    models: dict[str, Path],
) -> None:
    """One-token steps skip the drafter's learning (so they cost what sequential steps cost);
    before the next drafted round it is shown them as one accepted chain, so every committed
    position reaches it once, in order (a learned head loses its cache at any gap)."""
    runner = runner_for(models["llama"], 1)
    seen: list[tuple[int, int]] = []

    class Recording(TreeDrafter):
        def observe(self, verified: Verified) -> None:
            seen.append((verified.root_index, len(verified.path)))
            assert verified.topk_ids.shape[0] == len(verified.tokens)
            super().observe(verified)

    spec.forget(runner)
    spec.runner_state(runner).mode = _Scripted([True, True, True, False])
    drafter = Recording(spec.runner_state(runner).drafter.sources)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    ref = generate_sequential(runner, prompt, SamplingParams(max_new_tokens=24))
    got = spec.generate_speculative(
        runner, prompt, SamplingParams(max_new_tokens=24), drafter=drafter
    )
    assert got.token_ids == ref.token_ids
    assert got.stats.one_token_steps > 0
    assert seen[0] == (0, len(prompt))  # the prompt's chain
    for (r, m), (r2, _) in itertools.pairwise(seen):
        assert r2 == r + m  # no position skipped or shown twice
    assert any(m == 3 for _, m in seen[1:])  # three one-token steps shown together
    assert len(seen) < got.stats.round_trips  # fewer observations than rounds
    spec.forget(runner)


def test_the_prompts_logits_wait_for_the_first_drafted_round(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill computes the LM head for the prompt's last row only (as sequential decoding
    does): the rows the drafter learns from are computed before the first drafted round, a few
    at a time and only the prompt's last PROMPT_ROWS, and never while every round is a
    one-token step; one-token steps waiting to be shown keep their last PENDING_ROWS rows."""
    runner = runner_for(models["llama"], 1)
    rows: list[int] = []
    logits = runner.client.logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return logits(hidden)

    monkeypatch.setattr(runner.client, "logits", counting)
    monkeypatch.setattr(spec, "PROMPT_ROWS", 8)
    monkeypatch.setattr(spec, "PROMPT_PIECE", 3)
    monkeypatch.setattr(spec, "PENDING_ROWS", 1)  # one-token steps waiting keep 1 logits row
    prompt = [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6, 7]
    params = SamplingParams(max_new_tokens=10)
    ref = generate_sequential(runner, prompt, params)
    seen: list[Verified] = []

    class Recording(TreeDrafter):
        wide = False  # propose a 40-node chain of likely guesses (room for an exploring tree)

        def observe(self, verified: Verified) -> None:
            seen.append(verified)
            super().observe(verified)

        def propose(self, context: Sequence[int], max_nodes: int) -> DraftTree:
            if not self.wide:
                return super().propose(context, max_nodes)
            tree = DraftTree()
            for i in range(min(40, max_nodes)):
                tree.add(3, i - 1, 0.9)
            return tree

    spec.forget(runner)
    spec.runner_state(runner).mode = _Scripted([True])  # one-token steps only
    rows.clear()
    drafter = Recording(spec.runner_state(runner).drafter.sources)
    got = spec.generate_speculative(runner, prompt, params, drafter=drafter)
    assert got.token_ids == ref.token_ids
    assert rows == [1] * len(rows) and not seen  # the prompt's other rows never computed

    spec.forget(runner)
    spec.runner_state(runner).mode = _Scripted([True, True, False])
    rows.clear()
    drafter = Recording(spec.runner_state(runner).drafter.sources)
    got = spec.generate_speculative(runner, prompt, params, drafter=drafter)
    assert got.token_ids == ref.token_ids
    assert rows[:3] == [1, 1, 1]  # the first token, then two one-token steps
    assert rows[3:6] == [3, 3, 2]  # the prompt's last 8 rows, 3 at a time
    first = seen[0]
    assert first.root_index == 0 and first.tokens == prompt and len(first.path) == len(prompt)
    assert (first.topk_ids[:4] == -1).all() and (first.topk_ids[4:] >= 0).all()
    assert first.targets[len(prompt) - 1] == ref.token_ids[0]
    steps = seen[1]  # the two one-token steps as one chain: the older one's row was dropped
    assert steps.root_index == len(prompt) and len(steps.tokens) == 2
    assert (steps.topk_ids[0] == -1).all() and (steps.topk_ids[1] >= 0).all()
    runner.reset()
    full = spec.top_successors(logits(runner.hidden(prompt, range(len(prompt)))), spec.TOPK)
    runner.reset()
    assert torch.equal(first.topk_ids[4:], full[0][4:].long())  # the same rows as all at once

    # a look at drafting while one-token steps win: the prompt is shown without its LM-head
    # rows (the drafter still gets its tokens), and the look is sized, never an exploring round
    spec.forget(runner)
    state = spec.runner_state(runner)
    state.mode = _Scripted([True, True, False], looking=True)
    state.rounds = 3  # the next drafted round would explore, were it not a look
    seen.clear()
    drafter = Recording(state.drafter.sources)
    drafter.wide = True
    # fixed round costs (10 ms + 2 ms per row): the sizes chosen do not depend on this machine
    monkeypatch.setattr(state.cost, "coefficients", lambda: (0.010, 0.002))
    chosen: list[int] = []
    choose = state.cost.choose
    monkeypatch.setattr(state.cost, "choose", lambda p: chosen.append(choose(p)) or chosen[-1])
    explored: list[int] = []
    explore = spec.explore_size
    monkeypatch.setattr(spec, "explore_size", lambda *a: explored.append(1) or explore(*a))
    long = SamplingParams(max_new_tokens=50)  # room for a deep tree
    want = generate_sequential(runner, prompt, long).token_ids
    rows.clear()
    got = spec.generate_speculative(runner, prompt, long, drafter=drafter)
    assert got.token_ids == want
    first = seen[0]
    assert first.tokens == prompt and (first.topk_ids == -1).all()
    assert rows[:3] == [1, 1, 1] and rows[3] == len(seen[2].tokens)  # no prompt rows computed
    assert len(chosen) > 4 and state.recent == chosen[-8:] and not explored  # sent as sized
    spec.forget(runner)


# ---------------------------------------------------------------- under load (issue 32)


class _LoadedTrunk:
    """A local trunk that reports a load, as a remote one does after each reply."""

    def __init__(self, inner: object, load: P.Load) -> None:
        self.inner, self.load = inner, load
        self.start, self.end = inner.start, inner.end  # type: ignore[attr-defined]

    def forward(self, *a: object, **k: object) -> torch.Tensor:
        return self.inner.forward(*a, **k)  # type: ignore[attr-defined]

    def reset(self) -> None:
        self.inner.reset()  # type: ignore[attr-defined]

    def close(self) -> None:
        pass


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fam=st.sampled_from(FAMILIES),
    prompt=prompts,
    max_new=st.integers(1, 24),
    peers=st.sampled_from([0.0, 1.0, 7.0, 1000.0]),
    row_ms=st.sampled_from([0.5, 3.0, 1000.0]),
)
def test_load_aware_sizing_keeps_greedy_output_exact(
    models: dict[str, Path], fam: str, prompt: list[int], max_new: int, peers: float, row_ms: float
) -> None:
    base = runner_for(models[fam], 1)
    runner = SplitRunner(base.client, _LoadedTrunk(base.trunk, P.Load(peers, row_ms, 1.0)))
    params = SamplingParams(max_new_tokens=max_new)
    ref = generate_sequential(base, prompt, params)
    got = spec.generate_speculative(runner, prompt, params)
    assert got.token_ids == ref.token_ids and got.text == ref.text
    assert spec.trunk_load(runner) == P.Load(peers, row_ms, 1.0)
    spec.forget(runner)


def test_a_saturated_trunk_gets_one_row_per_round(models: dict[str, Path]) -> None:
    """Rows priced at 1000 peers x 1 s: no tree pays (no exploration rounds either)."""
    base = runner_for(models["llama"], 1)
    heavy = P.Load(peers=1000.0, row_ms=1000.0, busy=1.0)
    runner = SplitRunner(base.client, _LoadedTrunk(base.trunk, heavy))
    prompt = [5, 9, 3, 5, 9, 3, 5, 9, 3, 5, 9]  # repetitive: drafts are confident
    params = SamplingParams(max_new_tokens=24)
    ref = generate_sequential(base, prompt, params)
    spec.forget(runner)
    got = spec.generate_speculative(runner, prompt, params)
    assert got.token_ids == ref.token_ids
    assert got.stats.tree_nodes_sent == got.stats.round_trips - 1  # the roots alone
    spec.forget(runner)
    free = spec.generate_speculative(
        runner, prompt, params, options=spec.SpecOptions(load_aware=False)
    )
    assert free.token_ids == ref.token_ids
    assert free.stats.tree_nodes_sent > free.stats.round_trips - 1  # alone it drafts
    spec.forget(runner)
