"""Passages cut into chunks for the index: about ``words`` words each, never across a page, so
every chunk cites one page (and the paragraph it starts in)."""

from __future__ import annotations

from dataclasses import dataclass

from app.core.documents.extract import Passage

CHUNK_WORDS = 120
OVERLAP_WORDS = 20


@dataclass(frozen=True)
class Chunk:
    text: str
    page: int | None
    para: int  # the paragraph the chunk starts in
    seq: int  # order in the file


def chunk_passages(
    passages: list[Passage], words: int = CHUNK_WORDS, overlap: int = OVERLAP_WORDS
) -> list[Chunk]:
    """Whole paragraphs are kept together while they fit; a longer paragraph is cut into
    overlapping windows. A chunk never spans two pages."""
    out: list[Chunk] = []
    buf: list[str] = []
    start: Passage | None = None

    def flush() -> None:
        nonlocal buf, start
        if buf and start is not None:
            out.append(Chunk(" ".join(buf), start.page, start.para, len(out)))
        buf, start = [], None

    for ps in passages:
        ws = ps.text.split()
        if start is not None and (ps.page != start.page or len(buf) + len(ws) > words):
            flush()
        if len(ws) > words:  # a long paragraph: windows of `words` with `overlap`
            step = max(1, words - overlap)
            for i in range(0, len(ws), step):
                piece = ws[i : i + words]
                out.append(Chunk(" ".join(piece), ps.page, ps.para, len(out)))
                if i + words >= len(ws):
                    break
            continue
        if start is None:
            start = ps
        buf += ws
    flush()
    return out
