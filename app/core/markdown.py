"""Split a reply into Markdown text and fenced code blocks (each code block gets a copy
button in the chat view). Works on partial text while it streams: an unclosed fence is a
code block that is still growing."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    kind: str  # "text" | "code"
    body: str
    lang: str = ""


def segments(text: str) -> list[Segment]:
    out: list[Segment] = []
    buf: list[str] = []
    code: list[str] | None = None
    lang = ""
    fence = ""
    for line in text.split("\n"):
        stripped = line.strip()
        if code is None and stripped.startswith(("```", "~~~")):
            if buf and "\n".join(buf).strip():
                out.append(Segment("text", "\n".join(buf).strip("\n")))
            buf = []
            fence = stripped[:3]
            lang = stripped[3:].strip().split(" ")[0] if len(stripped) > 3 else ""
            code = []
        elif code is not None and stripped.startswith(fence) and stripped.strip(fence[0]) == "":
            out.append(Segment("code", "\n".join(code), lang))
            code = None
        elif code is not None:
            code.append(line)
        else:
            buf.append(line)
    if code is not None:
        out.append(Segment("code", "\n".join(code), lang))
    elif buf and "\n".join(buf).strip():
        out.append(Segment("text", "\n".join(buf).strip("\n")))
    return out


def keep_line_breaks(text: str) -> str:
    """Markdown in which every line break of ``text`` stays a line break.

    In Markdown a single newline inside a paragraph is only a space, so "Kind regards,\\nSam"
    would show (and copy) as one line; a model means a new line. Each line that is followed by
    another non-blank line gets a hard break (a trailing backslash), except where the next line
    starts a list item, a heading, a quote or a table row, which break by themselves."""
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if (
            line.strip()
            and nxt.strip()
            and not line.rstrip().endswith("\\")
            and not _starts_block(nxt)
            and not line.lstrip().startswith(("|", "#"))
        ):
            line = line.rstrip() + "\\"
        out.append(line)
    return "\n".join(out)


def _starts_block(line: str) -> bool:
    s = line.lstrip()
    if s.startswith(("- ", "* ", "+ ", "> ", "#", "|")):
        return True
    head = s.split(" ", 1)[0]
    return len(head) > 1 and head[:-1].isdigit() and head[-1] in ".)"
