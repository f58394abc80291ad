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
