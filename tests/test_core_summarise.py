"""Issue 30, Qt-free: a message too long for the model, summarised in parts (the split, the
plan that makes the request and all the summaries fit, the run with a fake model, Stop), and
the chat's flow with the tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.core.long_message import prompt_room
from app.core.summarise import (
    SUMMARY_MIN,
    Plan,
    estimate_parts,
    final_message,
    fit_final,
    parts_offer,
    plan_parts,
    progress_text,
    split_parts,
    split_request,
    summarise_parts,
    summary_messages,
    summary_note,
)
from engine.chat import prompt_ids
from engine.errors import VeilError
from tests.test_core_long_messages import make_app, tiny, words  # noqa: F401
from tests.tiny import tiny_tokenizer


def n_words(text: str) -> int:
    return len(text.split())


def words_prompt(msgs: Any) -> int:
    return sum(n_words(m["content"]) + 4 for m in msgs)


def paragraphs(n: int, size: int) -> str:
    return "\n\n".join(" ".join(f"p{p}w{i}" for i in range(size)) + "." for p in range(n))


def test_split_request_takes_a_short_first_or_last_paragraph() -> None:
    body = paragraphs(3, 100)
    assert split_request(f"Summarise the key dates:\n\n{body}") == (
        "Summarise the key dates:",
        body,
    )
    assert split_request(f"{body}\n\nWho signed it?") == ("Who signed it?", body)
    assert split_request(body) == ("", body)  # every paragraph is long: all of it is material
    assert split_request(words(300)) == ("", words(300))


def test_split_parts_fit_keep_the_order_and_cut_at_paragraphs() -> None:
    text = paragraphs(10, 30)  # 10 paragraphs of 30 words
    parts = split_parts(text, n_words, 100)
    assert [n_words(p) for p in parts] == [90, 90, 90, 30]  # three whole paragraphs each
    assert "\n\n".join(parts) == text
    # a paragraph longer than a part is cut at sentences, then at words
    long = " ".join(f"Sentence {i} has five words." for i in range(40))
    parts = split_parts(long, n_words, 12)
    assert all(n_words(p) <= 12 for p in parts) and " ".join(parts).split() == long.split()
    assert all(p.endswith(".") for p in parts)  # whole sentences
    one = " ".join(f"w{i}" for i in range(50))  # no sentence: cut between words
    parts = split_parts(one, n_words, 7)
    assert [n_words(p) for p in parts] == [7] * 7 + [1] and " ".join(parts) == one
    with pytest.raises(ValueError):
        split_parts(one, n_words, 0)


def test_split_parts_with_a_real_tokenizer() -> None:
    tok = tiny_tokenizer()

    def count(t: str) -> int:
        return len(tok(t, add_special_tokens=False)["input_ids"])

    text = words(900)
    parts = split_parts(text, count, 150)
    assert len(parts) >= count(text) // 150
    assert all(count(p) <= 150 for p in parts)
    assert " ".join(parts).split() == text.split()


def test_plan_makes_every_prompt_and_the_final_message_fit() -> None:
    context, max_new = 2048, 256
    text = "What did the witness say about the contract?\n\n" + paragraphs(60, 120)
    plan = plan_parts(text, n_words, words_prompt, context, max_new, system="Be brief.")
    assert plan.request == "What did the witness say about the contract?"
    assert plan.n == len(plan.parts) >= 4 and plan.summary_tokens >= SUMMARY_MIN
    for i, part in enumerate(plan.parts, 1):  # each summary prompt leaves the summary's room
        msgs = summary_messages(part, i, plan.n, plan.request)
        assert words_prompt(msgs) + plan.summary_tokens <= context
        assert plan.request in msgs[0]["content"] and part in msgs[0]["content"]
    # the request with summaries as long as allowed still fits what the model reads at once
    longest = [" ".join(["word"] * plan.summary_tokens)] * plan.n
    final = [{"role": "system", "content": "Be brief."}]
    final.append({"role": "user", "content": final_message(plan.request, longest)})
    assert words_prompt(final) <= prompt_room(context, max_new)
    # far too long for this model even in parts: one clear error
    with pytest.raises(VeilError, match="too long to summarise in parts"):
        plan_parts(paragraphs(2000, 120), n_words, words_prompt, context, max_new)


def test_fit_final_shortens_summaries_that_read_back_longer() -> None:
    summaries = [" ".join(f"s{j}w{i}" for i in range(100)) for j in range(3)]
    assert fit_final("Q?", summaries, words_prompt, 10_000) == final_message("Q?", summaries)
    msg = fit_final("Q?", summaries, words_prompt, 200, system="Be brief.")
    assert words_prompt([{"role": "system", "content": "Be brief."}, {"content": msg}]) <= 200
    assert msg.startswith("Q?") and msg.count("…") == 3 and "Part 3 of 3:\ns2w0 s2w1" in msg


def test_summarise_parts_reports_progress_and_stops() -> None:
    plan = Plan("Who signed?", ["part one", "part two", "part three"], 40)
    asked: list[tuple[str, int]] = []

    def fake(msgs: list[dict[str, str]], n_tokens: int) -> str:
        asked.append((msgs[0]["content"], n_tokens))
        return f"  summary {len(asked)}\n"

    seen: list[tuple[int, int]] = []
    out = summarise_parts(plan, fake, lambda i, n: seen.append((i, n)))
    assert out == ["summary 1", "summary 2", "summary 3"]
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert [n for _, n in asked] == [40, 40, 40]
    assert asked[1][0].startswith("Summarise part 2 of 3") and asked[1][0].endswith("part two")
    msg = final_message(plan.request, out)
    assert msg.startswith("Who signed?\n\n") and "summarised in 3 parts" in msg
    assert "Part 2 of 3:\nsummary 2" in msg
    # Stop during part 2: nothing more is asked, nothing is returned
    asked.clear()
    stop = {"now": False}

    def progress(i: int, n: int) -> None:
        stop["now"] = i == 2

    assert summarise_parts(plan, fake, progress, lambda: stop["now"]) is None
    assert len(asked) == 2  # part 2 was begun (a real model stops at once), part 3 never
    assert progress_text(2, 5) == "Summarising part 2 of 5…"
    assert summary_note(5).startswith("This answer is based on summaries of 5 parts")
    assert estimate_parts(5000, 2048) == 3 and "about 3" in parts_offer(5000, 2048)


def test_chat_summarises_in_parts_then_answers(tiny: Path, tmp_path: Path):  # noqa: F811
    app = make_app(tiny, tmp_path, max_tokens=8)
    chat = app.chat
    text = "List the dates.\n\n" + words(300)
    check = chat.length_check(text)
    assert check is not None and not check.fits
    seen: list[tuple[int, int]] = []
    chat.summarising.connect(lambda i, n: seen.append((i, n)))
    assert chat.send_in_parts(text)
    n = seen[-1][1]
    assert n >= 2 and seen == [(i, n) for i in range(1, n + 1)]
    user, reply = chat.messages()[-2:]
    assert user.role == "user" and user.content.startswith("List the dates.\n\n")
    assert f"summarised in {n} parts" in user.content and f"Part {n} of {n}:" in user.content
    assert reply.role == "assistant" and reply.content and reply.stats["summary_parts"] == n
    tok = app.host.tokenizer
    assert len(prompt_ids(tok, [{"role": "user", "content": user.content}])) <= check.room
    assert not chat.busy
    # Stop while part 2 is summarised: nothing is sent, the text comes back
    back: list[str] = []
    chat.restored.connect(back.append)
    chat.summarising.connect(lambda i, n: chat.stop() if i == 2 else None)
    before = len(chat.messages())
    assert chat.send_in_parts(text)
    assert len(chat.messages()) == before and back == [text] and chat.draft() == text
    assert not chat.busy
    app.close()
