"""The learned draft head: training data equals what the client computes, training learns,
head files belong to one model, drafting follows the training semantics, and speculative
decoding with the head is still exactly sequential decoding (greedy and sampled)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine.speculative as spec
from engine.drafts.head import (
    DraftHead,
    DraftHeadError,
    DraftHeadNet,
    HeadShape,
    load_head,
    model_fingerprint,
    save_head,
)
from engine.drafts.learned import HeadDraft
from engine.drafts.pipeline import DraftTrainOptions, train_draft
from engine.drafts.select import client_fingerprint, load_for_client
from engine.drafts.selfgen import BatchModel, user_turn_prefix
from engine.drafts.train import Batch, Frozen, draft_logits, unroll
from engine.generate import generate_sequential
from engine.loading import resolve
from engine.model import rope_inv_freq
from engine.sampling import SamplingParams, target_probs
from engine.split import SplitRunner, load_client, load_trunk
from tests.spec_support import assert_same_head_cache, chain_verified
from tests.tiny import make_model

FAMILIES = ("llama", "mistral", "qwen2")  # mistral: sliding window; qwen2: bias + tied LM head


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("head-models")
    out = {}
    for i, fam in enumerate(FAMILIES):
        make_model(root / fam, fam, seed=70 + i)
        out[fam] = root / fam
    return out


_RUNNERS: dict[str, SplitRunner] = {}


def _runner(folder: Path) -> SplitRunner:
    """k = 1: head layer 0, trunk layers 1-2, tail layer 3 (features after 1, 3 and 4)."""
    key = str(folder)
    if key not in _RUNNERS:
        client = load_client(key, 1)
        s, e = client.plan.trunk_range
        _RUNNERS[key] = SplitRunner(client, load_trunk(key, s, e))
    return _RUNNERS[key]


def _random_head(runner: SplitRunner, seed: int, vocab: torch.Tensor | None = None) -> DraftHead:
    client = runner.client
    net = DraftHeadNet(HeadShape.for_model(client.config))
    net.reset_parameters(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # a bigger residual branch than the init, so rows differ visibly
        net.wo.mul_(10)
        net.wdown.mul_(10)
    net.requires_grad_(False)
    cf, wf = client_fingerprint(client)
    return DraftHead(net, "tiny", cf, wf, client.tap_layers(), vocab)


@pytest.fixture(scope="module")
def trained(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A head trained on the tiny Llama (seconds), with its training record."""
    tmp = tmp_path_factory.mktemp("trained")
    out = tmp / "head.safetensors"
    losses: list[float] = []
    acc: list[float] = []

    def report(stage: str, done: float, total: float, info: dict[str, float]) -> None:
        if stage == "training":
            losses.append(info["loss"])
            acc.append(info["acc1"])

    opts = DraftTrainOptions(
        tokens=1500,
        steps=40,
        local_layers=1,
        vocab_size=160,
        gen_batch=16,
        reply_tokens=40,
        work_dir=tmp / "work",
        heldout=0.3,
    )
    info = train_draft(str(models["llama"]), out, opts, report)
    return {"path": out, "info": info, "losses": losses, "acc": acc}


# ---------------------------------------------------------------- training data


@pytest.mark.parametrize("fam", FAMILIES)
def test_batch_model_records_what_the_client_computes(models: dict[str, Path], fam: str) -> None:
    runner = _runner(models[fam])
    taps = runner.client.tap_layers()
    bm = BatchModel(resolve(str(models[fam])), taps)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41, 42], [7] * 20]
    res = bm.run(prompts, 12, eos=[], record_from=[0, 0, 0])
    for p, (new, sample) in zip(prompts, res, strict=True):
        # greedy continuation of a padded batch = sequential decoding of the prompt alone
        ref = generate_sequential(runner, p, SamplingParams(max_new_tokens=12)).token_ids
        assert new == ref
        assert sample is not None
        seq = [*p, *new]
        assert sample.tokens.tolist() == seq
        runner.reset()
        states = runner.forward_states(seq[:-1], range(len(seq) - 1))
        torch.testing.assert_close(
            sample.feats.float(), states.features().to(torch.float16).float(), atol=2e-2, rtol=0
        )
        logits = runner.client.logits(states.final)  # [T-1, V]
        assert torch.equal(sample.top_ids[:, 0].long(), logits.argmax(-1))


def test_rows_that_finish_early_leave_the_batch_unchanged(models: dict[str, Path]) -> None:
    """Rows ending at different steps (EOS) are dropped from the batch in groups; every row's
    tokens and records equal those of the same prompt run alone."""
    bm = BatchModel(resolve(str(models["llama"])), (1, 3, 4))
    prompts = [[5 + i, 6, 7 + 2 * i, 8][: 2 + i % 3] + [30 + i] * (i % 4) for i in range(8)]
    free = bm.run(prompts, 10, eos=[])
    # end-of-text: tokens that some rows emit early, so rows finish at different steps
    eos = sorted({free[0][0][1], free[3][0][3], free[5][0][0]})
    dropped: list[int] = []
    keep_rows = bm.keep_rows

    def counting(rows: torch.Tensor) -> None:
        dropped.append(int(rows.numel()))
        keep_rows(rows)

    bm.keep_rows = counting  # type: ignore[method-assign]
    batched = bm.run(prompts, 10, eos=eos, record_from=[1] * len(prompts))
    bm.keep_rows = keep_rows  # type: ignore[method-assign]
    assert dropped, "no row left the batch: the test does not cover compaction"
    ends = {len(new) for new, _ in batched}
    assert len(ends) > 2
    for p, (new, sample) in zip(prompts, batched, strict=True):
        [(alone, ref)] = bm.run([p], 10, eos=eos, record_from=[1])
        assert new == alone
        assert sample is not None and ref is not None
        assert sample.tokens.tolist() == ref.tokens.tolist() == [*p, *new]
        assert sample.feats.shape == ref.feats.shape == (len(p) + len(new) - 1, 3 * 64)
        torch.testing.assert_close(sample.feats.float(), ref.feats.float(), atol=2e-2, rtol=0)
        assert torch.equal(sample.top_ids[:, 0], ref.top_ids[:, 0])
        assert sample.start == 1


def test_generation_rows_fit_the_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU generates up to 1,024 rows at once, fewer where the model's caches would not fit
    in half of the free memory; a CPU always 64. (No GPU needed: its memory is simulated.)"""
    from engine.config import ModelConfig
    from engine.drafts.pipeline import default_gen_batch

    smol = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 1e5)
    llama8b = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 5e5)
    gib = 2**30
    free = [120 * gib]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 140 * gib))
    assert default_gen_batch("cpu", llama8b) == 64
    assert default_gen_batch("cuda") == 1024  # no model to size by
    assert default_gen_batch("cuda", smol) == 1024
    # Llama-3-8B: 2 x (2 x 32 layers x 8 heads x 128 x 384 positions x 4 bytes) ~ 201 MB a row
    rows = default_gen_batch("cuda", llama8b)
    assert 250 <= rows <= 310
    assert default_gen_batch("cuda", llama8b, reply_tokens=1024) < rows
    free[0] = 8 * gib
    assert 1 <= default_gen_batch("cuda", llama8b) <= 25
    free[0] = 0
    assert default_gen_batch("cuda", smol) == 1


def test_self_prompts_start_at_the_user_turn(models: dict[str, Path]) -> None:
    tok = BatchModel(resolve(str(models["llama"])), (1, 3, 4)).tokenizer
    prefix = user_turn_prefix(tok)
    assert tok.decode(prefix) == "<|im_start|>user\n"


# ---------------------------------------------------------------- training and head files


def test_training_learns_and_the_head_reloads(trained: dict[str, object]) -> None:
    # a random tiny model's next-next-token distribution is hard to fit; the trend is what counts
    losses, acc = trained["losses"], trained["acc"]
    assert isinstance(losses, list) and isinstance(acc, list) and len(losses) == 4
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < losses[0] - 0.04, losses
    assert acc[-1] > acc[0] + 0.03, acc
    info = trained["info"]
    assert isinstance(info, dict)
    acc = info["heldout_acceptance"]
    assert acc["positions"] > 0 and len(acc["conditional"]) == 6
    head = load_head(trained["path"])  # type: ignore[arg-type]
    assert head.feature_layers == (1, 3, 4)
    assert head.vocab is not None and head.vocab.numel() == 160
    assert head.info["train_steps"] == 40
    again = save_head(head, Path(str(trained["path"])).with_name("copy.safetensors"))
    twice = load_head(again)
    for name in ("fc", "wqkv", "wdown"):
        assert torch.equal(getattr(head.net, name), getattr(twice.net, name))


def test_a_time_budget_ends_training_early(
    models: dict[str, Path], trained: dict[str, object]
) -> None:
    """``minutes``: the step count is fixed once the first steps are timed (here the budget is
    spent before that, so training ends right after the probe) and the schedule's last step is
    reported as the last one."""
    from engine.drafts.dataset import load_samples
    from engine.drafts.pipeline import feature_sample, load_frozen
    from engine.drafts.train import TrainOptions, train_head
    from engine.loading import WeightReader, load_config

    folder = resolve(str(models["llama"])).folder
    cfg = load_config(folder)
    samples = load_samples(Path(str(trained["path"])).parent / "work")
    frozen = load_frozen(WeightReader(folder), cfg, None, "cpu")
    done: list[tuple[float, float]] = []

    def report(stage: str, step: float, total: float, info: dict[str, float]) -> None:
        done.append((step, total))

    def run(minutes: float) -> int:
        net = DraftHeadNet(HeadShape.for_model(cfg, 32))
        net.set_feature_stats(feature_sample(samples))
        net.reset_parameters(torch.Generator().manual_seed(1))
        opts = TrainOptions(steps=200, batch_tokens=64, minutes=minutes)
        return train_head(net, frozen, samples, rope_inv_freq(cfg), opts, report=report).steps

    # warm-up is 21 steps (a tenth of 200, plus one); the probe runs after them
    assert run(1e-6) == 22
    assert done[-1] == (22, 22)
    done.clear()
    assert run(0.0) == 200 and done[-1] == (200, 200)


def test_a_head_for_another_model_is_refused(
    models: dict[str, Path], trained: dict[str, object]
) -> None:
    llama = _runner(models["llama"]).client
    assert load_for_client(trained["path"], llama).feature_layers == (1, 3, 4)  # type: ignore[arg-type]
    other = _runner(models["mistral"]).client
    with pytest.raises(DraftHeadError) as exc:
        load_for_client(trained["path"], other)  # type: ignore[arg-type]
    msg = str(exc.value)
    assert "another model" in msg and "\n" not in msg
    # same model, different split: the features it was trained on are not computed locally
    two = load_client(str(models["llama"]), 2)
    with pytest.raises(DraftHeadError, match="split"):
        load_for_client(trained["path"], two)  # type: ignore[arg-type]


def test_bad_head_files_are_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    for p in (tmp_path / "missing.safetensors", tmp_path / "junk.safetensors"):
        with pytest.raises(DraftHeadError) as exc:
            load_head(p)
        assert "\n" not in str(exc.value)


def test_private_weights_change_the_fingerprint(models: dict[str, Path]) -> None:
    client = _runner(models["llama"]).client

    class Overlay:  # what engine.audit.overlay.OverlayReader looks like to the fingerprint
        def __init__(self, base: object) -> None:
            self.base = base
            self.tensors = {"model.layers.0.mlp.up_proj.weight": torch.ones(3, 3)}

    plain = model_fingerprint(client.reader, client.config)
    private = model_fingerprint(Overlay(client.reader), client.config)
    assert plain[0] == private[0] and plain[1] != private[1]


# ---------------------------------------------------------------- drafting = training semantics


def test_drafted_tree_follows_the_training_unroll(models: dict[str, Path]) -> None:
    """The head's tree at inference (committed cache + tree attention) gives the same children
    and probabilities as the training-time-test unroll of the same chain."""
    runner = _runner(models["llama"])
    client = runner.client
    head = _random_head(runner, 3)
    src = HeadDraft(head, client, width=1, top_k=3, max_depth=3)
    prompt = [9, 30, 31, 32, 33, 34, 35, 36, 37, 38]
    root = 60
    runner.reset()
    states = runner.forward_states(prompt, range(len(prompt)))
    n = len(prompt)
    ctx = [*prompt, root]
    src.observe(chain_verified(ctx, n, states, client))
    tree = src.propose(ctx, 32)
    d1 = tree.tokens[0]  # the most likely child of the root
    d1_kids = [i for i, p in enumerate(tree.parents) if p == 0]
    d2 = tree.tokens[d1_kids[0]]
    # the same chain through the training code: row n-1 reads root, then d1, then d2
    v = client.config.vocab_size
    frozen = Frozen(
        client.embed_weight,
        client.norm_weight,
        client.lm_head,
        client.config.rms_eps,
        torch.arange(v),
    )
    tokens = torch.tensor([[*prompt[1:], root, d1, d2]])
    w = tokens.shape[1]
    empty = torch.zeros(1, w, dtype=torch.bool)
    batch = Batch(
        states.features()[None],
        tokens,
        torch.zeros(1, w, 1, dtype=torch.long),
        torch.zeros(1, w, 1),
        empty,
        empty,
        empty,
    )
    hid = unroll(head.net, frozen, batch, rope_inv_freq(client.config), 2)
    p1 = draft_logits(hid[0][0, -1], frozen).softmax(-1)
    p2 = draft_logits(hid[1][0, -1], frozen).softmax(-1)
    top1 = p1.topk(3)
    assert [
        t for t, p in zip(tree.tokens, tree.parents, strict=True) if p == -1
    ] == top1.indices.tolist()
    root_kids = [q for q, p in zip(tree.probs, tree.parents, strict=True) if p == -1]
    torch.testing.assert_close(torch.tensor(root_kids), top1.values, atol=1e-4, rtol=1e-4)
    top2 = p2.topk(3)
    assert [tree.tokens[i] for i in d1_kids] == top2.indices.tolist()
    torch.testing.assert_close(
        torch.tensor([tree.probs[i] for i in d1_kids]), top2.values, atol=1e-4, rtol=1e-4
    )


def test_head_cache_follows_the_accepted_path(models: dict[str, Path]) -> None:
    """After rounds of speculative decoding, the head's cache holds exactly the rows a fresh
    prefill of the committed text gives (rejected branches leave no trace)."""
    runner = _runner(models["qwen2"])
    head = _random_head(runner, 5)
    spec.use_draft_head(runner, head)
    try:
        prompt = [11, 12, 13, 14, 15, 16, 11, 12, 13]
        got = spec.generate_speculative(runner, prompt, SamplingParams(max_new_tokens=20))
        src = spec.runner_state(runner).head
        assert src is not None and got.stats.round_trips > 2
        text = [*prompt, *got.token_ids]
        n = src.cache.length  # rows for every position before the last root
        fresh = HeadDraft(head, runner.client)
        runner.reset()
        states = runner.forward_states(text[:n], range(n))
        fresh.observe(chain_verified(text, n, states, runner.client))
        assert fresh.cache.length == n
        assert_same_head_cache(src, fresh, n)
    finally:
        spec.use_draft_head(runner, "auto")


# ---------------------------------------------------------------- exactness with the head on


prompts = st.one_of(
    st.lists(st.integers(3, 300), min_size=1, max_size=20),
    st.tuples(st.lists(st.integers(3, 300), min_size=1, max_size=5), st.integers(2, 6)).map(
        lambda t: t[0] * t[1]
    ),
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    fam=st.sampled_from(FAMILIES),
    prompt=prompts,
    max_new=st.integers(1, 24),
    temperature=st.sampled_from((0.0, 0.0, 0.8, 1.5)),
    seed=st.integers(0, 2**31 - 1),
    vocab=st.booleans(),
)
def test_speculative_with_the_head_equals_sequential(
    models: dict[str, Path],
    trained: dict[str, object],
    fam: str,
    prompt: list[int],
    max_new: int,
    temperature: float,
    seed: int,
    vocab: bool,
) -> None:
    runner = _runner(models[fam])
    cfg = runner.client.config
    if fam == "llama":
        head = load_for_client(trained["path"], runner.client)  # type: ignore[arg-type]
    else:
        ids = torch.arange(3, cfg.vocab_size, 3) if vocab else None
        head = _random_head(runner, seed % 1000, ids)
    spec.use_draft_head(runner, head)
    try:
        runner.client.config = dataclasses.replace(cfg, eos_token_ids=())
        params = SamplingParams(
            max_new_tokens=max_new, temperature=temperature, top_k=20, seed=seed
        )
        ref = generate_sequential(runner, prompt, params)
        got = spec.generate_speculative(runner, prompt, params)
        assert got.token_ids == ref.token_ids
        assert got.text == ref.text
        assert got.stats.round_trips <= ref.stats.round_trips
        assert got.stats.draft_s >= 0.0
    finally:
        runner.client.config = cfg
        spec.use_draft_head(runner, "auto")


def test_the_trained_head_drafts_most_of_the_text(
    models: dict[str, Path], trained: dict[str, object]
) -> None:
    """On its own model's greedy text, the trained head's drafts are accepted, and far more often
    than an untrained head's. (The drafter's calibration counts, per source, the proposed nodes
    whose parent was accepted and how many were the target. Round trips are not compared with
    the context sources alone: this tiny model repeats itself, so the suffix source already
    drafts most of the text. Trees of a fixed size, so nothing depends on measured time.)"""
    runner = _runner(models["llama"])
    # loaded before the end-of-text ids are cleared below: the model's fingerprint covers them
    head = load_for_client(trained["path"], runner.client)  # type: ignore[arg-type]
    cfg = runner.client.config
    runner.client.config = dataclasses.replace(cfg, eos_token_ids=())
    prompt = [1, 40, 41, 42, 43, 2, 1, 50, 51]
    params = SamplingParams(max_new_tokens=40)
    opts = spec.SpecOptions(fixed_budget=16)

    def run(head: DraftHead) -> tuple[int, float]:
        spec.use_draft_head(runner, head)
        got = spec.generate_speculative(runner, prompt, params, options=opts)
        assert got.token_ids == ref
        stats = spec.runner_state(runner).drafter.calibrator.stats
        hits = sum(h for (name, _), (h, _) in stats.items() if name == "head")
        return got.stats.round_trips, hits

    try:
        ref = generate_sequential(runner, prompt, params).token_ids
        _, head_hits = run(head)
        _, random_hits = run(_random_head(runner, 7, None))
        assert head_hits >= random_hits + 4  # measured: 6 vs 0 of 22 drafted tokens
    finally:
        runner.client.config = cfg
        spec.use_draft_head(runner, "auto")


def test_sampling_with_the_head_keeps_the_exact_distribution(models: dict[str, Path]) -> None:
    runner = _runner(models["mistral"])
    spec.use_draft_head(runner, _random_head(runner, 11))
    try:
        prompt = [20, 21, 22, 23]
        params = SamplingParams(max_new_tokens=2, temperature=1.3, top_k=3)
        runner.reset()
        p1 = target_probs(runner.forward(prompt, range(4), last_only=True)[0], params, prompt)
        exact: dict[tuple[int, int], float] = {}
        for t1 in torch.nonzero(p1).flatten().tolist():
            runner.reset()
            ctx = [*prompt, t1]
            p2 = target_probs(runner.forward(ctx, range(5), last_only=True)[0], params, ctx)
            for t2 in torch.nonzero(p2).flatten().tolist():
                exact[(t1, t2)] = float(p1[t1] * p2[t2])
        counts: dict[tuple[int, int], int] = {}
        n = 500
        for seed in range(n):
            r = spec.generate_speculative(runner, prompt, dataclasses.replace(params, seed=seed))
            assert r.stats.round_trips == 2  # the second token went through a drafted tree
            key = (r.token_ids[0], r.token_ids[1])
            counts[key] = counts.get(key, 0) + 1
        stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())
        assert set(counts) <= set(exact)
        df = len(exact) - 1
        pval = float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))
        assert pval > 1e-3, (pval, counts)
    finally:
        spec.use_draft_head(runner, "auto")


# ---------------------------------------------------------------- command line


def test_generate_uses_a_head_file_and_reports_drafting(
    models: dict[str, Path], trained: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main

    base = ["generate", "--model", str(models["llama"]), "--local-layers", "1", "--prompt", "hi"]
    base += ["--max-new-tokens", "12", "--json"]
    assert main([*base, "--draft-head", str(trained["path"])]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft_head"] == str(trained["path"])
    assert out["draft_ms_per_round"] >= 0.0
    assert main([*base, "--decoder", "sequential"]) == 0
    seq = json.loads(capsys.readouterr().out)
    assert seq["token_ids"] == out["token_ids"] and seq["draft_head"] is None
    # a head for another model, a missing file: one line each, no traceback
    other = ["generate", "--model", str(models["qwen2"]), "--local-layers", "1", "--prompt", "hi"]
    for argv in (
        [*other, "--draft-head", str(trained["path"])],
        [*base, "--draft-head", str(Path(str(trained["path"])).with_name("missing.safetensors"))],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("veil: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--tokens", "0"], "--tokens must be at least 1"),
        (["--steps", "-1"], "--steps must be >= 0"),
        (["--text", "/nonexistent/folder"], "is not a folder"),
        (["--device", "tpu"], "unknown device"),
        (["--minutes", "-1"], "--minutes must be >= 0"),
        (["--minutes", "nan"], "--minutes must be >= 0"),
    ],
)
def test_train_draft_reports_bad_input_in_one_line(
    tmp_path: Path, args: list[str], msg: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main

    assert main(["train-draft", "--out", str(tmp_path / "h.safetensors"), *args]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err
