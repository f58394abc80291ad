"""Issue 30, Qt-free: long messages (size, cut, reading progress), Regenerate that writes a
different reply, empty chats reused or removed, the demo model's line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.core.chat import fit_history, regenerate_params
from app.core.controller import AppController
from app.core.demo_model import is_demo_model
from app.core.long_message import (
    LARGE_SHARE,
    READ_CHUNK,
    ReadingClock,
    check_length,
    cut_question,
    prompt_room,
    reading_text,
    size_note,
    split_message,
)
from app.core.settings import MODE_IN_PROCESS, Settings
from app.core.tasks import InlineExecutor
from engine.chat import prompt_ids
from engine.generate import CancelToken, generate
from engine.loading import DEFAULT_MODEL
from engine.sampling import SamplingParams
from engine.session import RunnerOptions, open_runner
from tests.tiny import make_model, tiny_tokenizer

WORDS = [
    "the",
    "witness",
    "said",
    "that",
    "the",
    "contract",
    "was",
    "signed",
    "on",
    "a",
    "rainy",
    "day",
    "in",
    "March",
]


def words(n: int) -> str:
    return " ".join(f"{WORDS[i % len(WORDS)]}{i}" for i in range(n))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny30") / "llama"
    make_model(folder, "llama", seed=3, n_layers=6)  # context: 512 tokens
    return folder


def make_app(tiny: Path, data: Path, max_tokens: int = 12) -> AppController:
    s = Settings(
        first_run_done=True,
        mode=MODE_IN_PROCESS,
        model=str(tiny),
        local_layers=1,
        max_tokens=max_tokens,
        system_prompt="",
        repetition_penalty=1.0,
    )
    app = AppController(InlineExecutor(), data, settings=s)
    app.save_settings()
    app.load_config()
    app.connect_now()  # the tokenizer is there before the first message, as in the window
    return app


# --- the size of a message -----------------------------------------------------------------


def test_length_check_short_long_and_too_long() -> None:
    tok = tiny_tokenizer()
    room = prompt_room(512, 12)
    assert room == 500
    short = check_length(tok, [], "hello there", 512, 12)
    assert short.fits and not short.large and short.dropped == 0 and size_note(short) == ""

    text = words(60)
    long = check_length(tok, [], text, 512, 12)
    assert long.fits and long.large and long.tokens >= LARGE_SHARE * room
    assert long.tokens == len(tok(text, add_special_tokens=False)["input_ids"])
    assert long.prompt == len(prompt_ids(tok, [{"role": "user", "content": text}]))
    assert size_note(long) == (
        f"Long message: about {long.tokens:,} tokens; with the chat so far {long.prompt:,} of "
        f"the {room:,} this model reads at once."
    )

    text = words(400)
    big = check_length(tok, [{"role": "system", "content": "Be brief."}], text, 512, 12)
    assert not big.fits and big.large
    assert size_note(big).startswith(f"Too long for this model: about {big.tokens:,} tokens")
    kept, rest = split_message(big, text)
    assert kept and rest and f"{kept} {rest}" == text  # cut between two words, nothing lost
    sent = prompt_ids(
        tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": kept}]
    )
    assert len(sent) <= room and big.prompt == len(sent)
    assert room - len(sent) < 30  # and nearly all of the room is used
    q = cut_question(big, text)
    last_kept, first_rest = kept.split()[-1], rest.split()[0]
    assert f"Veil can send the first {len(kept.split()):,} words, up to “…" in q
    assert (
        f"{last_kept}”, and leave out the last {len(rest.split()):,} words, from “{first_rest} "
        in q
    )
    assert "stays in the message box" in q and f"reads at most {room:,} tokens" in q


def test_length_check_counts_the_old_messages_left_out() -> None:
    tok = tiny_tokenizer()
    history = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        history += [
            {"role": "user", "content": words(20 + i)},
            {"role": "assistant", "content": words(18)},
        ]
    text = words(40)
    check = check_length(tok, history, text, 512, 12)
    msgs = [*history, {"role": "user", "content": text}]
    sent = fit_history(tok, msgs, check.room)  # what sending does
    assert check.fits and 0 < check.dropped < 12 and check.prompt == len(sent)
    kept = history[:1] + history[1 + check.dropped :]
    assert prompt_ids(tok, [*kept, {"role": "user", "content": text}]) == sent
    assert size_note(check).endswith(
        f"To make room, the oldest {check.dropped} messages of this chat are left out of this "
        "reply."
    )


def test_length_check_with_a_tokenizer_without_offsets() -> None:
    tok = tiny_tokenizer()

    class Slow:
        """A tokenizer that cannot give character offsets (as Python-only ones)."""

        chat_template = tok.chat_template

        def __call__(self, text: str, **kw: Any) -> Any:
            if kw.pop("return_offsets_mapping", False):
                raise NotImplementedError("return_offset_mapping is not available")
            return tok(text, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(tok, name)

    text = words(400)
    fast = check_length(tok, [], text, 512, 12)
    slow = check_length(Slow(), [], text, 512, 12)
    assert slow.keep_chars == fast.keep_chars and not slow.fits


def test_reading_clock_and_text() -> None:
    now = [100.0]
    clock = ReadingClock(lambda: now[0])
    assert clock.seconds_left(0, 1000) is None
    now[0] = 104.0  # 400 rows in 4 s: 600 more take about 6 s
    assert clock.seconds_left(400, 1000) == pytest.approx(6.0)
    assert clock.seconds_left(1000, 1000) == 0.0
    assert reading_text(400, 1000, 6.0) == "Reading your message… 40% (about 10 seconds left)"
    assert reading_text(0, 1000, None) == "Reading your message… 0%"


def test_long_prompt_reports_reading_progress_short_one_does_not(tiny: Path, tmp_path: Path):
    app = make_app(tiny, tmp_path)
    chat = app.chat
    chat.read_chunk = 32
    seen: list[tuple[int, int, float | None]] = []
    chat.reading.connect(lambda d, n, left: seen.append((d, n, left)))
    chat.send("hello")
    assert seen == []  # one block: nothing to show
    assert chat.length_check("hello") is not None
    text = words(60)
    check = chat.length_check(text)
    assert check is not None and check.large and check.fits
    chat.send(text)
    done = [d for d, _, _ in seen]
    total = seen[0][1]
    assert total > 3 * 32 and done[0] == 0 and done[-1] == total
    assert done == sorted(done) and len(done) == 2 + (total - 1) // 32  # 0%, then each block
    assert seen[0][2] is None and seen[-1][2] == 0.0
    assert all(left is not None and left >= 0 for _, _, left in seen[1:])
    assert chat.messages()[-1].content  # and the reply was written
    app.close()


# --- Regenerate --------------------------------------------------------------------------


def test_regenerate_writes_a_different_reply_each_time(tiny: Path, tmp_path: Path) -> None:
    app = make_app(tiny, tmp_path, max_tokens=16)
    chat = app.chat
    seeds = iter([11, 12])
    chat.new_seed = lambda: next(seeds)
    chat.send("Veil splits a language model")
    first = chat.messages()[-1].content
    assert chat.regenerate()
    second = chat.messages()[-1].content
    assert chat.regenerate()
    third = chat.messages()[-1].content
    assert len({first, second, third}) == 3, (first, second, third)
    # each is exactly the engine's sampled reply with Regenerate's settings and that seed
    runner = open_runner(RunnerOptions(model=str(tiny), local_layers=1))
    ids = prompt_ids(
        runner.client.tokenizer, [{"role": "user", "content": "Veil splits a language model"}]
    )
    base = app.settings.sampling()
    assert base.greedy  # the default creativity is 0: replies are repeatable
    want = generate(runner, ids, regenerate_params(base, 12)).text
    assert third == want
    app.close()


def test_regenerate_params() -> None:
    greedy = SamplingParams(max_new_tokens=9, repetition_penalty=1.1)
    p = regenerate_params(greedy, 5)
    assert (p.temperature, p.top_p, p.seed, p.max_new_tokens, p.repetition_penalty) == (
        0.7,
        0.9,
        5,
        9,
        1.1,
    )
    warm = SamplingParams(temperature=1.2, top_p=0.8)
    p = regenerate_params(warm, 6)
    assert (p.temperature, p.top_p, p.seed) == (1.2, 0.8, 6)


# --- empty chats ---------------------------------------------------------------------------


def test_new_chat_reuses_an_empty_chat_and_leaving_one_removes_it(tiny: Path, tmp_path: Path):
    app = make_app(tiny, tmp_path)
    chat = app.chat
    a = chat.new_conversation()
    assert chat.new_conversation() == a == chat.new_conversation()  # no pile of empty chats
    assert [c.id for c in app.store.conversations()] == [a]
    chat.send("invoice numbers")
    b = chat.new_conversation()
    assert b != a
    chat.open(a)  # b was left empty: it is gone
    assert [c.id for c in app.store.conversations()] == [a]
    c = chat.new_conversation()
    chat.save_draft("a message I have not sent")
    chat.open(a)  # a chat with unsent text stays
    d = chat.new_conversation()
    chat.rename(d, "Ideas")
    chat.open(a)  # so does one the user named
    assert {x.id for x in app.store.conversations()} == {a, c, d}
    app.close()

    # empty chats an older version left behind are removed at start (not the open one)
    again = AppController(InlineExecutor(), tmp_path, settings=app.settings)
    for _ in range(3):
        again.store.create_conversation()
    keep = again.store.create_conversation()
    again.store.set("last_conversation", keep)
    again.chat.restore_last()
    assert {x.id for x in again.store.conversations()} == {a, c, d, keep}
    again.close()


# --- the demo model ------------------------------------------------------------------------


def test_demo_model_is_recognised() -> None:
    assert is_demo_model(DEFAULT_MODEL) and is_demo_model(f"  {DEFAULT_MODEL.upper()} ")
    assert is_demo_model("/models/x.gguf", DEFAULT_MODEL)
    assert not is_demo_model("/models/llama-3-8b.gguf", "llama-3-8b")
    assert not is_demo_model("/models/llama-3-8b.gguf")


@pytest.mark.parametrize("decoder", ["sequential", "speculative"])
def test_replies_without_a_progress_bar_still_read_in_blocks_and_stop_between_them(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decoder: str
) -> None:
    """The drafting pane, summaries and the local API ask for a reply without a progress bar:
    the host still reads their prompt in READ_CHUNK blocks, so a Stop is heard after the first
    block (and through a server the blocks overlap the trunk's work)."""
    app = make_app(tiny, tmp_path)
    host = app.host
    runner = host.ensure_ready_blocking()
    cancel = CancelToken()
    started: list[int] = []
    real = type(runner).start

    def start(self: Any, ids: list[int], positions: Any, *a: Any) -> Any:
        if positions[0] == 0 and not a:  # the prompt's first block: Stop pressed meanwhile
            cancel.cancel()
        started.append(len(ids))
        return real(self, ids, positions, *a)

    monkeypatch.setattr(type(runner), "start", start)
    ids = [(7 * i + 3) % 50 + 4 for i in range(READ_CHUNK + 44)]  # two blocks
    params = SamplingParams(max_new_tokens=4)
    got = host.generate_blocking(
        ids, params, on_text=lambda _t: None, cancel=cancel, decoder=decoder
    )
    assert got.finish_reason == "cancelled" and got.token_ids == []
    assert started == [READ_CHUNK]  # the second block was never started
    started.clear()
    whole = host.generate_blocking(
        ids, params, on_text=lambda _t: None, cancel=CancelToken(), decoder=decoder
    )
    assert started[:2] == [READ_CHUNK, 44]
    assert whole.finish_reason != "cancelled" and whole.token_ids
