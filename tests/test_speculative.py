"""Speculative tree decoding: exactly the sequential output (greedy), exactly its distribution
(sampling), and in-place KV compaction equal to feeding the accepted tokens one by one."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine.speculative as spec
from engine.drafts import DraftTree, TreeDrafter, Verified
from engine.generate import available_decoders, generate, generate_sequential
from engine.sampling import SamplingParams, process_logits, target_probs
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


def test_registered_as_a_decoder() -> None:
    assert available_decoders()["speculative"] is spec.generate_speculative


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
    runner = runner_for(models[fam], k)
    cfg = original_config(models[fam], k)  # examples share the runner: start from the original
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
    runner = runner_for(models["llama"], 1)
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
    runner = runner_for(models["qwen2"], 1)
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
    runner = runner_for(models[fam], 1)
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
    runner = runner_for(models["llama"], 1)
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
