"""Long messages: their size against what the model reads at once, what is cut when they do not
fit, and how far the model has read a long prompt.

Qt-free. The chat asks :func:`check_length` while the user types (the note under the message
box) and before sending (the choice when it does not fit); the worker reports
:class:`ReadingClock` values while the prompt is read in blocks (``engine.generate.Prefill``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from app.core.audit_info import human_duration
from engine.chat import prompt_ids

REPLY_ROOM_MAX = 1024  # tokens kept free for the reply at most (the rest of the context reads)
LARGE_SHARE = 0.25  # a message is "long" from this share of what the model reads at once
CUT_MARGIN = 8  # tokens kept spare at a cut: the template may join the last word differently
READ_CHUNK = 256  # prompt rows per block while a prompt is read (the server's 256-row pieces)
QUOTE_WORDS = 6  # words quoted on either side of a cut
COLLAPSE_CHARS, COLLAPSE_LINES = 1500, 20  # a message longer than this is shown collapsed
PREVIEW_CHARS, PREVIEW_LINES = 600, 8  # how much of it shows then


def prompt_room(context: int, max_new_tokens: int, started: int = 0) -> int:
    """The most prompt tokens a reply may start from: the model's context less the reply's room
    (``started``: tokens of a reply being continued)."""
    return max(context - min(max_new_tokens, REPLY_ROOM_MAX) - started, 16)


@dataclass(frozen=True)
class LengthCheck:
    """A message measured against the model (all counts in tokens unless named)."""

    tokens: int  # the message alone
    words: int
    chars: int
    prompt: int  # the whole prompt that would be sent (after leaving out old messages)
    room: int  # the most the model reads at once with the reply's room kept
    context: int  # the model's context length
    reply_room: int
    dropped: int  # earlier messages of the chat left out so that this one fits
    keep_chars: int  # characters of the message that fit (== chars when it fits)

    @property
    def fits(self) -> bool:
        return self.keep_chars >= self.chars

    @property
    def large(self) -> bool:
        return self.tokens >= LARGE_SHARE * self.room


def _with(history: Sequence[dict[str, str]], text: str) -> list[dict[str, str]]:
    return [*history, {"role": "user", "content": text}]


def _dropped_to_fit(tok: Any, history: list[dict[str, str]], text: str, room: int) -> int:
    """How many of the oldest turns must go (as ``fit_history`` drops them) for the prompt to
    fit; all of them when even the message alone does not."""
    first = 1 if history and history[0]["role"] == "system" else 0
    lo, hi = 0, len(history) - first  # lo may not fit; hi always "fits" (or nothing does)
    if len(prompt_ids(tok, _with(history, text))) <= room:
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        kept = history[:first] + history[first + mid :]
        if len(prompt_ids(tok, _with(kept, text))) <= room:
            hi = mid
        else:
            lo = mid
    return hi


def _char_cut(tok: Any, text: str, n_tokens: int) -> int:
    """Characters of ``text`` covered by its first ``n_tokens`` tokens."""
    if n_tokens <= 0:
        return 0
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        return int(offsets[min(n_tokens, len(offsets)) - 1][1]) if offsets else 0
    except (NotImplementedError, KeyError, TypeError, ValueError):  # a slow tokenizer
        ids = tok(text, add_special_tokens=False)["input_ids"][:n_tokens]
        decoded = str(tok.decode(ids))
        return next(
            (i for i, (a, b) in enumerate(zip(text, decoded, strict=False)) if a != b),
            min(len(text), len(decoded)),
        )


def _word_start(text: str, at: int) -> int:
    """``at`` moved back to the start of the word it falls in (never to 0 if avoidable)."""
    if at >= len(text) or text[at].isspace():
        return at
    back = max(text.rfind(" ", 0, at), text.rfind("\n", 0, at))
    return back + 1 if back > 0 else at


def check_length(
    tokenizer: Any,
    history: Sequence[dict[str, str]],
    text: str,
    context: int,
    max_new_tokens: int,
) -> LengthCheck:
    """Measure ``text`` as the next message after ``history`` (system prompt first, if any)."""
    hist = list(history)
    reply_room = min(max_new_tokens, REPLY_ROOM_MAX)
    room = prompt_room(context, max_new_tokens)
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    dropped = _dropped_to_fit(tokenizer, hist, text, room)
    first = 1 if hist and hist[0]["role"] == "system" else 0
    kept_hist = hist[:first] + hist[first + dropped :]
    prompt = len(prompt_ids(tokenizer, _with(kept_hist, text)))
    keep = len(text)
    if prompt > room:  # even alone the message does not fit: where to cut it
        overhead = len(prompt_ids(tokenizer, _with(kept_hist, "")))
        budget = room - overhead - CUT_MARGIN
        keep = _word_start(text, _char_cut(tokenizer, text, budget))
        while (
            keep > 0 and len(prompt_ids(tokenizer, _with(kept_hist, text[:keep].rstrip()))) > room
        ):
            budget -= max(CUT_MARGIN, budget // 20)  # rare: the template joined differently
            keep = _word_start(text, _char_cut(tokenizer, text, budget))
        prompt = len(prompt_ids(tokenizer, _with(kept_hist, text[:keep].rstrip())))
    return LengthCheck(
        tokens=tokens,
        words=len(text.split()),
        chars=len(text),
        prompt=prompt,
        room=room,
        context=context,
        reply_room=reply_room,
        dropped=dropped,
        keep_chars=keep,
    )


def split_message(check: LengthCheck, text: str) -> tuple[str, str]:
    """(the part sent, the part left out) of a message that does not fit."""
    return text[: check.keep_chars].rstrip(), text[check.keep_chars :].strip()


def _plural(n: int, one: str) -> str:
    return f"{n:,} {one if n == 1 else one + 's'}"


def _dropped_text(n: int) -> str:
    what = "message" if n == 1 else f"{n:,} messages"
    return f"the oldest {what} of this chat {'is' if n == 1 else 'are'} left out of this reply"


def size_note(check: LengthCheck) -> str:
    """The line under the message box ("" when there is nothing worth saying)."""
    if not check.fits:
        return (
            f"Too long for this model: about {check.tokens:,} tokens, and it reads at most "
            f"{check.room:,} at once. When you send it, Veil asks: send the first part, or "
            "summarise it in parts."
        )
    parts = []
    if check.large:
        parts.append(
            f"Long message: about {check.tokens:,} tokens; with the chat so far "
            f"{check.prompt:,} of the {check.room:,} this model reads at once."
        )
    if check.dropped:
        parts.append(f"To make room, {_dropped_text(check.dropped)}.")
    return " ".join(parts)


def _quote_end(text: str) -> str:
    words = text.split()
    return ("…" if len(words) > QUOTE_WORDS else "") + " ".join(words[-QUOTE_WORDS:])


def _quote_start(text: str) -> str:
    words = text.split()
    return " ".join(words[:QUOTE_WORDS]) + ("…" if len(words) > QUOTE_WORDS else "")


def cut_question(check: LengthCheck, text: str) -> str:
    """What the choice says when a message does not fit: exactly what is sent and left out."""
    kept, rest = split_message(check, text)
    head = (
        f"This message is about {check.tokens:,} tokens ({_plural(check.words, 'word')}), but "
        f"this model reads at most {check.room:,} tokens at once ({check.context:,}, less "
        f"{check.reply_room:,} kept for the reply)."
    )
    if not kept:
        return head + "\n\nNothing of it fits with this chat's instructions; shorten it first."
    body = (
        f"Veil can send the first {_plural(len(kept.split()), 'word')}, up to “"
        f"{_quote_end(kept)}”, and leave out the last {_plural(len(rest.split()), 'word')}, "
        f"from “{_quote_start(rest)}”. The part left out stays in the message box, so you can "
        "send it next."
    )
    if check.dropped:
        body += " Earlier messages of this chat are left out of this reply."
    return f"{head}\n\n{body}"


class ReadingClock:
    """How far the model has read a prompt, and about how long the rest takes (from the rate
    so far: later rows cost a little more, as each attends to more before it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.t0 = clock()

    def seconds_left(self, done: int, total: int) -> float | None:
        if done <= 0 or total <= done:
            return None if done <= 0 else 0.0
        spent = self.clock() - self.t0
        return spent / done * (total - done)


def shows_reading(total: int, chunk: int = READ_CHUNK) -> bool:
    """Progress is shown for a prompt read in more than one block."""
    return total > chunk


def reading_text(done: int, total: int, seconds_left: float | None) -> str:
    """Like "Reading your message… 40% (about 20 seconds left)"."""
    pct = int(100 * done / total) if total else 0
    tail = f" ({human_duration(seconds_left)} left)" if seconds_left else ""
    return f"Reading your message… {pct}%{tail}"


def preview(text: str) -> str | None:
    """The start of a long message, shown until "Show all" (None: short enough to show)."""
    lines = text.split("\n")
    if len(text) <= COLLAPSE_CHARS and len(lines) <= COLLAPSE_LINES:
        return None
    head = "\n".join(lines[:PREVIEW_LINES])
    if len(head) > PREVIEW_CHARS:
        space = head.rfind(" ", 0, PREVIEW_CHARS)
        head = head[: space if space > PREVIEW_CHARS // 2 else PREVIEW_CHARS]
    return head.rstrip() + " …"


def show_all_text(text: str) -> str:
    return f"Show all ({_plural(len(text.split()), 'word')})"
