"""Reading a long prompt in blocks (engine.generate.Prefill): progress after each block, the
same reply as one block, and Stop between blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import GenerationError
from engine.generate import CancelToken, Prefill, generate
from engine.sampling import SamplingParams
from engine.split import SplitRunner, load_client, load_trunk

PROMPT = [3 + (i * 7) % 300 for i in range(100)]


def _runner(folder: Path, k: int = 1) -> SplitRunner:
    client = load_client(str(folder), k)
    s, e = client.plan.trunk_range
    return SplitRunner(client, None if client.plan.fully_local else load_trunk(str(folder), s, e))


@pytest.mark.parametrize("decoder", ["sequential", "speculative"])
def test_prefill_in_blocks_reports_progress_and_gives_the_same_reply(
    tiny_llama: Path, decoder: str
) -> None:
    runner = _runner(tiny_llama)
    params = SamplingParams(max_new_tokens=12)
    whole = generate(runner, PROMPT, params, decoder=decoder)
    seen: list[tuple[int, int]] = []
    blocks = generate(
        runner,
        PROMPT,
        params,
        decoder=decoder,
        prefill=Prefill(chunk=16, on_progress=lambda d, n: seen.append((d, n))),
    )
    assert seen == [(min(d, 100), 100) for d in range(16, 113, 16)]
    assert blocks.token_ids == whole.token_ids and blocks.text == whole.text
    if decoder == "sequential":  # (the speculative decoder's rounds depend on what it learned)
        assert blocks.stats.round_trips - whole.stats.round_trips == 6  # 7 blocks, not 1
    # sampled with a seed: the same draw too
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, seed=11)
    a = generate(runner, PROMPT, seeded, decoder=decoder)
    b = generate(runner, PROMPT, seeded, decoder=decoder, prefill=Prefill(chunk=30))
    assert a.token_ids == b.token_ids


def test_prefill_without_chunk_is_one_block_with_one_progress_call(tiny_llama: Path) -> None:
    runner = _runner(tiny_llama)
    seen: list[tuple[int, int]] = []
    generate(
        runner,
        PROMPT[:10],
        SamplingParams(max_new_tokens=2),
        prefill=Prefill(on_progress=lambda d, n: seen.append((d, n))),
    )
    assert seen == [(10, 10)]


@pytest.mark.parametrize("decoder", ["sequential", "speculative"])
def test_stop_between_prompt_blocks_ends_without_text(tiny_llama: Path, decoder: str) -> None:
    runner = _runner(tiny_llama)
    cancel = CancelToken()
    seen: list[int] = []

    def progress(done: int, _total: int) -> None:
        seen.append(done)
        cancel.cancel()  # the user pressed Stop while the first block was read

    res = generate(
        runner,
        PROMPT,
        SamplingParams(max_new_tokens=8),
        decoder=decoder,
        cancel=cancel,
        prefill=Prefill(chunk=25, on_progress=progress),
    )
    assert seen == [25]
    assert res.finish_reason == "cancelled" and res.token_ids == [] and res.text == ""


def test_bad_prefill_chunk_is_a_clear_error(tiny_llama: Path) -> None:
    runner = _runner(tiny_llama)
    with pytest.raises(GenerationError, match="at least 1"):
        generate(runner, PROMPT, SamplingParams(max_new_tokens=2), prefill=Prefill(chunk=0))
