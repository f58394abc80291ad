"""A message too long for the model, summarised in parts: the third choice when it does not fit
(after "send the first part" and "cancel").

The message is split into parts that each fit with the instruction and the summary's room; the
model summarises each part in turn; the user's request (their own words around the pasted
text, when there are any) is then sent with the joined summaries in place of the full text,
and the reply says that it rests on summaries.

Qt-free. Token counts come in as functions (``count``: a text's tokens, ``prompt_len``: a
whole chat prompt's tokens), the model as ``generate(messages, max_new_tokens) -> text``, so the
tests drive it with a fake model and the app with the real one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from app.core.long_message import prompt_room
from engine.errors import VeilError

SUMMARY_MAX = 200  # tokens a part's summary may take at most
SUMMARY_MIN = 24  # fewer than this per part says too little: the text is too long for this
PART_MARGIN = 16  # tokens kept spare in each part (a template may join words differently)
HEADER_TOKENS = 12  # "Part 2 of 5:" and the blank lines around it, generously
REQUEST_WORDS = 80  # a first or last paragraph this short is the user's request
PLAN_TRIES = 6

Messages = list[dict[str, str]]
Count = Callable[[str], int]
PromptLen = Callable[[Sequence[dict[str, str]]], int]

# paragraphs, then sentences (or lines), then words: a part is cut at the largest of these
_LEVELS = (
    re.compile(r"\S.*?(?:\n[ \t]*\n\s*|\Z)", re.S),
    re.compile(r"\S.*?(?:[.!?;:]+\s+|\n\s*|\Z)", re.S),
    re.compile(r"\S+\s*"),
)


@dataclass(frozen=True)
class Plan:
    request: str  # the user's own words, sent whole ("" when the message is all material)
    parts: list[str]  # the material, in order, each fitting one summary prompt
    summary_tokens: int  # the room of each part's summary

    @property
    def n(self) -> int:
        return len(self.parts)


def split_request(text: str) -> tuple[str, str]:
    """(the request, the material): a short first paragraph ("Summarise the key dates:") or,
    failing that, a short last one is the user's request; the rest is what they pasted."""
    paras = [p.strip() for p in re.split(r"\n[ \t]*\n", text.strip()) if p.strip()]
    if len(paras) >= 2:
        if len(paras[0].split()) <= REQUEST_WORDS:
            return paras[0], "\n\n".join(paras[1:])
        if len(paras[-1].split()) <= REQUEST_WORDS:
            return paras[-1], "\n\n".join(paras[:-1])
    return "", text.strip()


def _units(text: str, count: Count, limit: int, level: int = 0) -> list[str]:
    """``text`` in pieces of at most ``limit`` tokens each, cut at paragraphs where possible,
    else at sentences, else at words ("".join of the pieces is ``text``)."""
    if count(text) <= limit:
        return [text]
    if level == len(_LEVELS):  # one "word" longer than a part: cut it by characters
        step = max(1, len(text) * limit // max(count(text), 1))
        return [text[i : i + step] for i in range(0, len(text), step)]
    pieces = [m.group(0) for m in _LEVELS[level].finditer(text)]
    if len(pieces) <= 1:  # nothing to cut at this level: try a finer one
        return _units(text, count, limit, level + 1)
    out: list[str] = []
    for piece in pieces:
        out.extend(_units(piece, count, limit, level + 1))
    return out


def split_parts(text: str, count: Count, limit: int) -> list[str]:
    """``text`` in as few parts as it takes, each at most ``limit`` tokens, in order, each cut
    at a paragraph, sentence or word boundary where there is one."""
    if limit < 1:
        raise ValueError("a part must hold at least one token")
    parts: list[str] = []
    cur = ""
    for unit in _units(text.strip(), count, limit):
        if cur and count(cur + unit) > limit:
            parts.append(cur.strip())
            cur = unit
        else:
            cur += unit
    if cur.strip():
        parts.append(cur.strip())
    return parts


def summary_messages(part: str, i: int, n: int, request: str = "") -> Messages:
    """The prompt that asks for the summary of part ``i`` of ``n``."""
    ask = (
        f"Summarise part {i} of {n} of a long text. Keep names, numbers, dates and anything "
        "someone may ask about. Write only the summary."
    )
    if request:
        ask += f' The reader wants this: "{request}"'
    return [{"role": "user", "content": f"{ask}\n\n{part}"}]


def final_message(request: str, summaries: Sequence[str]) -> str:
    """What is sent in place of the full text: the request, then the summaries in order."""
    n = len(summaries)
    intro = (
        f"(The text I pasted was too long for this model to read at once, so it was summarised "
        f"in {n} parts. The summaries follow, in order.)"
    )
    body = "\n\n".join(f"Part {i} of {n}:\n{s.strip()}" for i, s in enumerate(summaries, 1))
    return "\n\n".join(x for x in (request.strip(), intro, body) if x)


def fit_final(
    request: str,
    summaries: Sequence[str],
    prompt_len: PromptLen,
    room: int,
    system: str = "",
) -> str:
    """:func:`final_message`, its summaries shortened alike (whole words, "…" marking a cut)
    until the prompt fits ``room``: a summary written in n tokens may read back as more."""
    head = [{"role": "system", "content": system}] if system.strip() else []
    words = [s.split() for s in summaries]
    keep = 1.0
    msg = final_message(request, summaries)
    for _ in range(PLAN_TRIES * 4):
        if prompt_len([*head, {"role": "user", "content": msg}]) <= room:
            break
        keep *= 0.85
        cut = [w[: max(1, int(len(w) * keep))] for w in words]
        msg = final_message(
            request,
            [
                " ".join(c) + ("…" if len(c) < len(w) else "")
                for c, w in zip(cut, words, strict=True)
            ],
        )
    return msg


def plan_parts(
    text: str,
    count: Count,
    prompt_len: PromptLen,
    context: int,
    max_new_tokens: int,
    system: str = "",
) -> Plan:
    """How to summarise ``text`` so that the request with all the summaries fits the model
    (``max_new_tokens``: the reply's room, as for any message; ``system``: the chat's
    assistant style, sent with the final message)."""
    request, material = split_request(text)
    room = prompt_room(context, max_new_tokens)
    head = [{"role": "system", "content": system}] if system.strip() else []
    summary = min(SUMMARY_MAX, max(SUMMARY_MIN, context // 4))
    ask = prompt_len(summary_messages("", 99, 99, request))
    for _ in range(PLAN_TRIES):
        part_tokens = context - summary - ask - PART_MARGIN
        if part_tokens < 1:
            break
        parts = split_parts(material, count, part_tokens)
        fixed = prompt_len([*head, {"role": "user", "content": final_message(request, [""])}])
        fits = (room - fixed - HEADER_TOKENS * len(parts)) // max(len(parts), 1)
        if summary <= fits:
            return Plan(request, parts, summary)
        if fits < SUMMARY_MIN:
            break
        summary = fits  # shorter summaries: longer parts, perhaps fewer of them
    raise VeilError(
        "this message is too long to summarise in parts for this model",
        hint="shorten it, or send it in pieces",
    )


def estimate_parts(tokens: int, context: int) -> int:
    """About how many parts a message of ``tokens`` tokens needs (for the question asked)."""
    per_part = max(context - min(SUMMARY_MAX, max(SUMMARY_MIN, context // 4)) - 64, 1)
    return max(2, math.ceil(tokens / per_part))


def summarise_parts(
    plan: Plan,
    generate: Callable[[Messages, int], str],
    progress: Callable[[int, int], None] | None = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> list[str] | None:
    """Each part's summary, in order (None when stopped; nothing is sent then)."""
    out: list[str] = []
    for i, part in enumerate(plan.parts, 1):
        if cancelled():
            return None
        if progress is not None:
            progress(i, plan.n)
        text = generate(summary_messages(part, i, plan.n, plan.request), plan.summary_tokens)
        if cancelled():
            return None
        out.append(text.strip() or "(no summary)")
    return out


def progress_text(i: int, n: int) -> str:
    """Like "Summarising part 2 of 5…"."""
    return f"Summarising part {i} of {n}…"


def summary_note(n: int) -> str:
    """Under a reply that rests on summaries."""
    return f"This answer is based on summaries of {n} parts of your message, not on its full text."


def parts_offer(tokens: int, context: int) -> str:
    """The third choice, in the question asked when a message does not fit."""
    n = estimate_parts(tokens, context)
    return (
        f"Or Veil can summarise it in parts (about {n}), one after the other, and then answer "
        "from the summaries. That takes longer, and details may be lost."
    )
