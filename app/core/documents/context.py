"""Which passages go into the prompt, and how: the best chunks of a matter that fit the room
the model's context leaves, numbered so the answer can cite them ([1], [2] ...).

A matter small enough to fit goes in whole (the best matches first, then the rest in reading
order); otherwise the chunks that match the question best (BM25), best first, as many as fit.
The sources actually used are returned with the reply, so the app can list them as
[file, page] links that open the passage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.core.documents.index import DocIndex, Hit

INTRO = (
    "Answer the question using the numbered sources below. After each fact, give the number of "
    "its source in square brackets, like [1]. If the sources do not answer the question, say "
    "so."
)
MIN_SOURCE_TOKENS = 48  # less room than this: no passages (the chat says so)
SEARCH_LIMIT = 12  # chunks fetched per question before fitting them in


@dataclass
class Source:
    n: int  # the number the answer cites
    path: str
    page: int | None
    para: int
    text: str
    chunk_id: int = 0

    @property
    def name(self) -> str:
        return Path(self.path).name

    def where(self) -> str:
        return f"page {self.page}" if self.page is not None else f"paragraph {self.para}"

    def label(self) -> str:
        """How a citation reads: "lease.pdf, p. 3" / "notes.txt, ¶ 4"."""
        short = f"p. {self.page}" if self.page is not None else f"¶ {self.para}"
        return f"{self.name}, {short}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Source:
        return cls(
            n=int(d.get("n", 0)),
            path=str(d.get("path", "")),
            page=None if d.get("page") is None else int(d["page"]),
            para=int(d.get("para", 0)),
            text=str(d.get("text", "")),
            chunk_id=int(d.get("chunk_id", 0)),
        )


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def block(s: Source) -> str:
    return f"[{s.n}] {s.name}, {s.where()}:\n{s.text}"


def prompt_with_sources(question: str, sources: list[Source]) -> str:
    """The user message the model sees: the instructions, the sources, then the question."""
    if not sources:
        return question
    body = "\n\n".join(block(s) for s in sources)
    return f"{INTRO}\n\n{body}\n\nQuestion: {question}"


def _truncate(tokenizer: Any, text: str, tokens: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)[: max(tokens, 0)]
    cut = str(tokenizer.decode(ids, skip_special_tokens=True)).strip()
    return cut + " …" if len(ids) < count_tokens(tokenizer, text) else cut


def fit_sources(hits: list[Hit], tokenizer: Any, budget: int) -> list[Source]:
    """Hits in order, numbered, as many as fit in ``budget`` tokens (the first is shortened to
    fit when even it alone is too long)."""
    out: list[Source] = []
    used = 0
    for h in hits:
        s = Source(len(out) + 1, h.path, h.page, h.para, h.text, h.chunk_id)
        cost = count_tokens(tokenizer, block(s)) + 2
        if used + cost > budget:
            if not out and budget - used >= MIN_SOURCE_TOKENS:
                header = count_tokens(tokenizer, block(Source(1, h.path, h.page, h.para, "")))
                s.text = _truncate(tokenizer, h.text, budget - used - header - 4)
                out.append(s)
            break
        out.append(s)
        used += cost
    return out


def select_sources(
    index: DocIndex, matter_id: int, question: str, tokenizer: Any, budget: int
) -> list[Source]:
    """The passages for ``question`` that fit in ``budget`` tokens."""
    if budget < MIN_SOURCE_TOKENS:
        return []
    whole = index.in_order(matter_id)
    hits = index.search(matter_id, question, SEARCH_LIMIT)
    words = sum(len(h.text.split()) for h in whole)
    if whole and words <= budget:  # tokens >= words for these tokenizers: it may fit whole
        # all of it, the best matches first (so [1] is the passage that matters most)
        best = {h.chunk_id for h in hits}
        ordered = hits + [h for h in whole if h.chunk_id not in best]
        fitted = fit_sources(ordered, tokenizer, budget)
        if len(fitted) == len(ordered) and fitted[-1].text == ordered[-1].text:
            return fitted
    if not hits:  # nothing to search for ("summarize this"): from the start
        hits = whole
    return fit_sources(hits, tokenizer, budget)


def sources_budget(tokenizer: Any, room: int, question: str) -> int:
    """Tokens left for passages when ``room`` tokens are free for the last message, after the
    instructions and the question (at most three quarters of the room, so a reply's own
    history keeps some space)."""
    fixed = count_tokens(tokenizer, prompt_with_sources(question, [Source(1, "x", 1, 1, "")]))
    return max(0, min(room - fixed, room * 3 // 4))


def used_text(sources: list[dict[str, Any]], files_in_matter: int | None = None) -> str:
    """What the app says under a reply: "Used 3 passages from 2 files" (of N)."""
    if not sources:
        return ""
    files = {str(s.get("path")) for s in sources}
    n, f = len(sources), len(files)
    text = f"Used {n} passage{'s' if n != 1 else ''} from {f} file{'s' if f != 1 else ''}"
    if files_in_matter and files_in_matter > f:
        text += f" (of {files_in_matter})"
    return text


def with_sources(
    index: DocIndex,
    matter_id: int,
    messages: list[dict[str, str]],
    tokenizer: Any,
    limit: int,
) -> tuple[list[dict[str, str]], list[Source]]:
    """``messages`` with the passages for the last user message put into it, fitted to a
    prompt of at most ``limit`` tokens (older turns are the caller's to drop; the system
    prompt and this message always fit)."""
    from engine.chat import prompt_ids

    if not messages or messages[-1]["role"] != "user":
        return messages, []
    question = messages[-1]["content"]
    keep = [m for m in messages[:1] if m["role"] == "system"] + [messages[-1]]
    room = limit - len(prompt_ids(tokenizer, keep)) + count_tokens(tokenizer, question)
    budget = sources_budget(tokenizer, room, question)
    sources = select_sources(index, matter_id, question, tokenizer, budget)
    if not sources:
        return messages, []
    last = {"role": "user", "content": prompt_with_sources(question, sources)}
    return [*messages[:-1], last], sources
