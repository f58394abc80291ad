"""Speculative tree decoding: exactly the sequential output (greedy), exactly its distribution
(sampling), and in-place KV compaction equal to feeding the accepted tokens one by one."""

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
from engine.config import ModelConfig
from engine.drafts import DraftTree, TreeDrafter, Verified
from engine.generate import available_decoders, generate, generate_sequential
from engine.sampling import SamplingParams, process_logits, target_probs
from engine.split import SplitRunner, load_client, load_trunk
from tests.tiny import make_model

# mistral: sliding window 8 inside tree blocks; qwen3: q/k norms; gemma3: sliding and global
# layers with their own rotary bases, Gemma's norms, query scale and capped logits
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-models")
    out = {}
    for i, fam in enumerate(FAMILIES):
        make_model(root / fam, fam, seed=40 + i)
        out[fam] = root / fam
    return out


_RUNNERS: dict[tuple[str, int], SplitRunner] = {}
_CONFIGS: dict[tuple[str, int], ModelConfig] = {}


def _runner(folder: Path, k: int = 1) -> SplitRunner:
    key = (str(folder), k)
    if key not in _RUNNERS:
        client = load_client(str(folder), k)
        s, e = client.plan.trunk_range
        trunk = None if client.plan.fully_local else load_trunk(str(folder), s, e)
        _RUNNERS[key] = SplitRunner(client, trunk)
        _CONFIGS[key] = client.config
    return _RUNNERS[key]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models: one thread is fastest, and the machine is shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _restore_config() -> Iterator[None]:
    """Tests below change EOS and the context limit on the (shared) runners' configs."""
    yield
    for k, r in _RUNNERS.items():
        r.client.config = _CONFIGS[k]


def test_registered_as_a_decoder() -> None:
    assert available_decoders()["speculative"] is spec.generate_speculative


prompts = st.one_of(
    st.lists(st.integers(3, 300), min_size=1, max_size=24),
    # repetitive prompts: long paths get accepted
    st.tuples(st.lists(st.integers(3, 300), min_size=1, max_size=5), st.integers(2, 8)).map(
        lambda t: t[0] * t[1]
    ),
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fam=st.sampled_from(FAMILIES),
    k=st.sampled_from((1, 2)),
    prompt=prompts,
    max_new=st.integers(1, 28),
    budget=st.one_of(st.none(), st.integers(0, 12)),
    eos_at=st.one_of(st.none(), st.integers(0, 27)),
    limit_at=st.one_of(st.none(), st.integers(1, 30)),
)
def test_speculative_greedy_equals_sequential(
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
    cfg = _CONFIGS[(str(models[fam]), k)]  # examples share the runner: start from the original
    params = SamplingParams(max_new_tokens=max_new)
    runner.client.config = dataclasses.replace(cfg, eos_token_ids=())
    free = generate_sequential(runner, prompt, params).token_ids
    # stop conditions that fall inside accepted paths: an EOS token taken from the free-running
    # output, and a context limit a few tokens past the prompt
    eos = (free[eos_at],) if eos_at is not None and eos_at < len(free) else ()
    limit = len(prompt) + limit_at if limit_at is not None else cfg.max_position_embeddings
    runner.client.config = dataclasses.replace(
        cfg, eos_token_ids=eos, max_position_embeddings=limit
    )
    ref = generate_sequential(runner, prompt, params)
    opts = spec.SpecOptions(fixed_budget=budget)
    got = spec.generate_speculative(runner, prompt, params, options=opts)
    assert got.token_ids == ref.token_ids
    assert got.finish_reason == ref.finish_reason
    assert got.text == ref.text
    st_ = got.stats
    assert st_.new_tokens == len(ref.token_ids)
    assert sum(n * c for n, c in st_.accepted_hist.items()) == st_.new_tokens - 1
    assert st_.round_trips == 1 + sum(st_.accepted_hist.values())
    assert st_.round_trips <= ref.stats.round_trips


def test_repetitive_text_accepts_long_paths(models: dict[str, Path]) -> None:
    runner = _runner(models["llama"], 1)
    runner.client.config = dataclasses.replace(runner.client.config, eos_token_ids=())
    prompt = [17, 42, 99, 7, 250, 31] * 6
    params = SamplingParams(max_new_tokens=48)
    ref = generate_sequential(runner, prompt, params)
    got = spec.generate_speculative(
        runner, prompt, params, options=spec.SpecOptions(fixed_budget=16)
    )
    assert got.token_ids == ref.token_ids
    assert got.stats.tokens_per_round_trip > 1.3, got.stats
    assert max(got.stats.accepted_hist) >= 4


def test_stop_string_inside_an_accepted_path(models: dict[str, Path]) -> None:
    runner = _runner(models["qwen2"], 1)
    runner.client.config = dataclasses.replace(runner.client.config, eos_token_ids=())
    prompt = [5, 6, 7, 8] * 5
    free = generate_sequential(runner, prompt, SamplingParams(max_new_tokens=30))
    text = free.text
    assert len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(max_new_tokens=30, stop=(stop,))
    ref = generate_sequential(runner, prompt, params)
    streamed: list[str] = []
    got = generate(runner, prompt, params, decoder="speculative", on_text=streamed.append)
    assert (got.token_ids, got.text, got.finish_reason) == (
        ref.token_ids,
        ref.text,
        ref.finish_reason,
    )
    assert "".join(streamed) == got.text
    assert stop not in got.text


# ---------------------------------------------------------------- KV compaction


def _caches(runner: SplitRunner) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    stacks = [runner.client.head, runner.client.tail]
    trunk = runner.trunk
    if trunk is not None:
        stacks.insert(1, trunk.stack)  # type: ignore[attr-defined]
    out = []
    for s in stacks:
        c = s.cache
        n = c.length
        out.append((c.k[:, :, :n].clone(), c.v[:, :, :n].clone(), c.pos[:n].clone()))
    return out


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fam=st.sampled_from(FAMILIES),
    prompt=st.lists(st.integers(3, 300), min_size=1, max_size=12),
    tree_spec=st.lists(st.tuples(st.integers(0, 30), st.integers(3, 300)), min_size=1, max_size=14),
    pick=st.integers(0, 10_000),
)
def test_compaction_equals_feeding_accepted_tokens(
    models: dict[str, Path],
    fam: str,
    prompt: list[int],
    tree_spec: list[tuple[int, int]],
    pick: int,
) -> None:
    # a random tree below a root token, and a random root-to-node path in it to keep
    parents = [-1]
    ids = [11]
    for p, t in tree_spec:
        parents.append(p % len(ids))
        ids.append(t)
    node = pick % len(ids)
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    n = len(prompt)
    runner = _runner(models[fam], 1)
    runner.reset()
    runner.forward(prompt, range(n))
    runner.forward(ids, [n + d for d in depth], parents, None)
    nxt = runner.forward([5], [n + len(path)], None, path)  # [1, V] after compaction
    tree_caches = _caches(runner)
    chain = [*prompt, *(ids[i] for i in path), 5]
    runner.reset()
    ref = runner.forward(chain, range(len(chain)))  # [L, V]
    for (k1, v1, p1), (k2, v2, p2) in zip(tree_caches, _caches(runner), strict=True):
        assert torch.equal(p1, p2)
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(nxt[-1], ref[-1], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- sampling exactness


class _TopChildren:
    """A deterministic draft: the target's top-3 tokens after the root (precomputed)."""

    name = "oracle"

    def __init__(self, table: dict[int, list[int]]) -> None:
        self.table = table

    def propose(self, context: list[int], budget: int) -> DraftTree:
        t = DraftTree()
        for tok in self.table.get(context[-1], [])[:budget]:
            t.add(tok, -1, 0.9)
        return t

    def observe(self, verified: Verified) -> None:
        pass

    def reset(self) -> None:
        pass


def _biased_choose(
    logits: torch.Tensor,
    params: SamplingParams,
    context: list[int],
    generator: torch.Generator | None,
    children: dict[int, int],
) -> int:
    """A classic bug: accept the first draft child with probability p(d), else draw from p
    (instead of from the residual) — so p(d) is inflated to p + (1 - p) p."""
    p = process_logits(logits, params, context).softmax(-1)  # [V]
    for d in children:
        if float(torch.rand((), generator=generator)) < float(p[d]):
            return d
        break
    return int(torch.multinomial(p, 1, generator=generator))


def _chi_square_p(counts: dict[tuple[int, int], int], probs: dict[tuple[int, int], float]) -> float:
    n = sum(counts.values())
    stat = 0.0
    for key, p in probs.items():
        e = n * p
        stat += (counts.get(key, 0) - e) ** 2 / e
    assert set(counts) <= set(probs)
    df = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def _two_token_distribution(
    runner: SplitRunner, prompt: list[int], params: SamplingParams
) -> dict[tuple[int, int], float]:
    runner.reset()
    p1 = target_probs(runner.forward(prompt, range(len(prompt)), last_only=True)[0], params, prompt)
    out = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        runner.reset()
        ctx = [*prompt, t1]
        logits = runner.forward(ctx, range(len(ctx)), last_only=True)[0]  # [V]
        p2 = target_probs(logits, params, ctx)
        for t2 in torch.nonzero(p2).flatten().tolist():
            out[(t1, t2)] = float(p1[t1] * p2[t2])
    return out


def _sample_pairs(
    runner: SplitRunner,
    prompt: list[int],
    params: SamplingParams,
    table: dict[int, list[int]],
    n: int,
) -> dict[tuple[int, int], int]:
    drafter = TreeDrafter([_TopChildren(table)])
    counts: dict[tuple[int, int], int] = {}
    for seed in range(n):
        p = dataclasses.replace(params, seed=seed)
        r = spec.generate_speculative(
            runner, prompt, p, drafter=drafter, options=spec.SpecOptions(fixed_budget=3)
        )
        assert r.stats.round_trips == 2  # the second token went through a draft tree
        key = (r.token_ids[0], r.token_ids[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_sampling_keeps_the_exact_distribution(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(models["llama"], 1)
    prompt = [20, 21, 22, 23]
    params = SamplingParams(max_new_tokens=2, temperature=1.3, top_k=3, repetition_penalty=1.2)
    exact = _two_token_distribution(runner, prompt, params)
    assert len(exact) == 9
    table: dict[int, list[int]] = {}
    for t1, t2 in sorted(exact, key=lambda k: -exact[k]):
        table.setdefault(t1, []).append(t2)
    n = 600
    good = _sample_pairs(runner, prompt, params, table, n)
    p_good = _chi_square_p(good, exact)
    assert p_good > 1e-3, (p_good, good)
    # same seeds, same draws: speculative sampling reproduces sequential sampling token for token
    for seed in range(5):
        p = dataclasses.replace(params, seed=seed, max_new_tokens=12)
        a = generate_sequential(runner, prompt, p).token_ids
        b = spec.generate_speculative(runner, prompt, p).token_ids
        assert a == b
    # the deliberately biased acceptance rule is caught by the same test
    monkeypatch.setattr(spec, "choose_token", _biased_choose)
    bad = _sample_pairs(runner, prompt, params, table, n)
    p_bad = _chi_square_p(bad, exact)
    assert p_bad < 1e-6, (p_bad, bad)


# ------------------------------------------- learning and modes (cost model: test_spec_cost.py)


def test_prefill_is_not_a_cost_model_observation(models: dict[str, Path]) -> None:
    runner = _runner(models["llama"])
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
    runner = _runner(models["llama"], 1)
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
    runner = _runner(models["llama"], 1)
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
    runner = _runner(models["llama"], 1)
    runner.client.config = _CONFIGS[(str(models["llama"]), 1)]
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
    runner = _runner(models[fam], 1)
    cfg = _CONFIGS[(str(models[fam]), 1)]
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
    runner = _runner(models["llama"], 1)

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
    runner = _runner(models["llama"], 1)
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
    runner = _runner(models["llama"], 1)
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
    base = _runner(models[fam], 1)
    runner = SplitRunner(base.client, _LoadedTrunk(base.trunk, P.Load(peers, row_ms, 1.0)))
    params = SamplingParams(max_new_tokens=max_new)
    ref = generate_sequential(base, prompt, params)
    got = spec.generate_speculative(runner, prompt, params)
    assert got.token_ids == ref.token_ids and got.text == ref.text
    assert spec.trunk_load(runner) == P.Load(peers, row_ms, 1.0)
    spec.forget(runner)


def test_a_saturated_trunk_gets_one_row_per_round(models: dict[str, Path]) -> None:
    """Rows priced at 1000 peers x 1 s: no tree pays (no exploration rounds either)."""
    base = _runner(models["llama"], 1)
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
