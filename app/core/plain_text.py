"""Text from elsewhere (a server's error or busy message, anything read off the wire) as the
window shows it: one plain line, no hidden characters, not too long (issue 29: a server's
"message" once drew itself in the banner as large green HTML)."""

from __future__ import annotations

import unicodedata

BANNER_CHARS = 300  # a banner line longer than this is cut with "…"


def one_line(text: str, limit: int = BANNER_CHARS) -> str:
    """``text`` with control and invisible formatting characters (escape codes, direction
    overrides, zero-width marks) replaced by spaces, runs of white space made one space, and
    cut after ``limit`` characters with "…". Widgets show the result as plain text."""
    cleaned = "".join(
        " " if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") else ch for ch in text
    )
    line = " ".join(cleaned.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
