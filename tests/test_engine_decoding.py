"""Decoding: sampling, stop conditions, streaming detokenization, chat prompts, cancellation."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.chat import messages_for, prompt_ids
from engine.detok import StreamingDetokenizer
from engine.errors import GenerationError
from engine.generate import CancelToken, Output, generate
from engine.sampling import SamplingParams, greedy_token, pick, process_logits
from engine.split import SplitRunner, load_client, load_trunk
from tests.tiny import CORPUS, tiny_tokenizer


def _runner(folder: Path, k: int = 1) -> SplitRunner:
    client = load_client(str(folder), k)
    s, e = client.plan.trunk_range
    return SplitRunner(client, None if client.plan.fully_local else load_trunk(str(folder), s, e))


def test_streaming_detok_equals_one_shot_decode() -> None:
    tok = tiny_tokenizer()
    for text in [*CORPUS, "  leading spaces, ümlauts and 東京 🙂🙂 end"]:
        ids = tok(text)["input_ids"]
        d = StreamingDetokenizer(tok)
        pieces = [d.push(i) for i in ids] + [d.flush()]
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
        assert all("\ufffd" not in p for p in pieces)


def test_streaming_detok_holds_incomplete_utf8() -> None:
    tok = tiny_tokenizer()
    ids = tok("🙂")["input_ids"]
    assert len(ids) > 1  # byte-level pieces of one character
    d = StreamingDetokenizer(tok)
    assert [d.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1]) == "🙂"


def test_streaming_detok_on_default_tokenizer(default_model_folder: Path) -> None:
    from engine.loading import load_tokenizer

    tok = load_tokenizer(default_model_folder)
    text = " Hello  world — naïve café, 東京 🙂\n\tdef f(x):\n        return x"
    ids = tok(text)["input_ids"]
    d = StreamingDetokenizer(tok)
    assert "".join([d.push(i) for i in ids] + [d.flush()]) == tok.decode(ids)


def test_chat_prompt_ids_match_apply_chat_template() -> None:
    tok = tiny_tokenizer()
    msgs = messages_for("Hello there", system="Be brief.")
    ref = tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert prompt_ids(tok, msgs) == list(ref)
    with pytest.raises(GenerationError):
        prompt_ids(tok, [])


def test_processors_follow_transformers() -> None:
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(50, generator=g) * 3
    ctx = [1, 4, 4, 9, 30]
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3)
    ours = process_logits(logits, params, ctx)
    x = logits[None].clone()
    ids = torch.tensor([ctx])
    for proc in (
        RepetitionPenaltyLogitsProcessor(1.3),
        TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(20),
        TopPLogitsWarper(0.8),
    ):
        x = proc(ids, x)
    assert torch.equal(torch.isinf(ours), torch.isinf(x[0]))
    finite = ~torch.isinf(ours)
    assert torch.allclose(ours[finite], x[0][finite], atol=1e-6)


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny_llama: Path) -> None:
    runner = _runner(tiny_llama)
    prompt = [5, 6, 7, 8]
    a = generate(runner, prompt, SamplingParams(max_new_tokens=12, temperature=1.0, seed=11))
    b = generate(runner, prompt, SamplingParams(max_new_tokens=12, temperature=1.0, seed=11))
    c = generate(runner, prompt, SamplingParams(max_new_tokens=12, temperature=1.0, seed=12))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    greedy = generate(runner, prompt, SamplingParams(max_new_tokens=12))
    k1 = generate(
        runner, prompt, SamplingParams(max_new_tokens=12, temperature=0.9, top_k=1, seed=5)
    )
    assert greedy.token_ids == k1.token_ids


def test_pick_greedy_is_argmax_first_max() -> None:
    logits = torch.tensor([0.0, 2.0, 2.0, 1.0])
    assert pick(logits, SamplingParams(), [], None) == 1


@pytest.mark.parametrize(
    "row",
    [
        [0.0, 2.0, 2.0, 1.0],  # a tie: the first
        [float("-inf"), -3.0, -1.0, -1.0],
        [1.0, float("nan"), 5.0, float("nan")],  # a NaN counts as the largest
        [float("inf"), float("inf"), 0.0, 1.0],
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_greedy_token_is_torch_argmax(row: list[float], dtype: torch.dtype) -> None:
    logits = torch.tensor(row, dtype=dtype)
    want = int(torch.argmax(logits))
    assert greedy_token(logits) == want
    strided = torch.tensor([[v, 9.0] for v in row], dtype=dtype)[:, 0]  # every other value
    assert not strided.is_contiguous() and greedy_token(strided) == want
    params = SamplingParams(repetition_penalty=1.3)  # the processed row takes the same rule
    assert pick(logits, params, [], None) == want


def test_output_honours_eos_stop_strings_and_max_tokens() -> None:
    tok = tiny_tokenizer()
    ids = tok("The quick brown fox jumps over the lazy dog.")["input_ids"]
    seen: list[str] = []
    out = Output(tok, SamplingParams(max_new_tokens=100, stop=("fox",)), [], seen.append)
    n = 0
    for i in ids:
        n += 1
        if out.push(i):
            break
    assert out.finish_reason == "stop"
    assert out.text == "The quick brown "
    assert "".join(seen) == out.text
    assert n < len(ids)
    out = Output(tok, SamplingParams(max_new_tokens=3), [], None)
    assert [out.push(i) for i in ids[:3]] == [False, False, True]
    assert out.finish_reason == "length"
    eos = tok.eos_token_id
    out = Output(tok, SamplingParams(max_new_tokens=10), [eos], None)
    assert out.push(ids[0]) is False
    assert out.push(eos) is True
    assert out.finish_reason == "eos" and out.token_ids[-1] == eos


def test_stop_string_across_tokens_is_not_streamed(tiny_llama: Path) -> None:
    tok = tiny_tokenizer()
    ids = tok("lazy dog. The quick")["input_ids"]
    seen: list[str] = []
    out = Output(tok, SamplingParams(max_new_tokens=100, stop=("dog. The",)), [], seen.append)
    for i in ids:
        if out.push(i):
            break
    assert out.text == "lazy "
    assert "".join(seen) == "lazy "


def test_cancel_from_another_thread(tiny_llama: Path) -> None:
    runner = _runner(tiny_llama)
    cancel = CancelToken()
    chunks: list[str] = []

    def on_text(t: str) -> None:
        chunks.append(t)
        if len(chunks) == 3:
            threading.Thread(target=cancel.cancel).start()

    res = generate(
        runner, [5, 6, 7], SamplingParams(max_new_tokens=400), on_text=on_text, cancel=cancel
    )
    assert res.finish_reason == "cancelled"
    assert len(res.token_ids) < 400


def test_bad_sampling_params_are_clear_errors(tiny_llama: Path) -> None:
    runner = _runner(tiny_llama)
    for bad in (
        SamplingParams(max_new_tokens=0),
        SamplingParams(temperature=-1),
        SamplingParams(top_p=0),
        SamplingParams(top_k=-2),
    ):
        with pytest.raises(GenerationError):
            generate(runner, [1, 2], bad)
    with pytest.raises(GenerationError, match="unknown decoder"):
        generate(runner, [1, 2], SamplingParams(), decoder="nope")
    with pytest.raises(GenerationError, match="empty prompt"):
        generate(runner, [], SamplingParams())
