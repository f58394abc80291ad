"""Files out: Markdown (a reply, a chat, a document) as a Word document (.docx) with its
headings, lists, bold and italics kept, and as "Word-friendly" plain text (no Markdown marks).

Markdown is parsed with markdown-it-py (CommonMark, plus tables); the document is written with
python-docx. Numbered lists restart at 1 each time, as written.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.storage import PRIVATE_FILE
from engine.errors import VeilError

MONO = "Consolas"
# characters Word's XML cannot hold (control characters a model or a PDF may produce)
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_safe(text: str) -> str:
    return _NOT_XML.sub("", text)


MAX_LIST_DEPTH = 3  # Word's built-in list styles: "List Bullet", "List Bullet 2", "... 3"


def _parser() -> Any:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table")


@dataclass
class _List:
    ordered: bool
    num_id: int | None = None  # Word numbering instance (ordered lists restart at 1)


class _Writer:
    """Walks markdown-it's token stream and writes paragraphs and runs."""

    def __init__(self, doc: Any) -> None:
        self.doc = doc
        self.lists: list[_List] = []
        self.quote = 0
        self.item_first = False  # the next paragraph is the first of a list item
        self.table: list[list[list[Any]]] | None = None  # rows of cells of inline tokens
        self.row: list[list[Any]] | None = None

    # --- blocks -----------------------------------------------------------------------------

    def write(self, tokens: list[Any]) -> None:
        i = 0
        while i < len(tokens):
            t = tokens[i]
            kind = t.type
            if kind == "heading_open":
                level = int(t.tag[1])
                p = self.doc.add_heading("", level=min(level, 9))
                self.inline(p, tokens[i + 1])
                i += 3
                continue
            if kind == "paragraph_open":
                p = self._paragraph()
                self.inline(p, tokens[i + 1])
                i += 3
                continue
            if kind in ("bullet_list_open", "ordered_list_open"):
                self.lists.append(_List(kind == "ordered_list_open"))
            elif kind in ("bullet_list_close", "ordered_list_close"):
                self.lists.pop()
            elif kind == "list_item_open":
                self.item_first = True
            elif kind == "blockquote_open":
                self.quote += 1
            elif kind == "blockquote_close":
                self.quote -= 1
            elif kind in ("fence", "code_block"):
                self.code(t.content)
            elif kind == "hr":
                self.doc.add_paragraph("")
            elif kind == "table_open":
                self.table = []
            elif kind == "tr_open":
                self.row = []
            elif kind in ("th_open", "td_open") and self.row is not None:
                self.row.append([tokens[i + 1], kind == "th_open"])
            elif kind == "tr_close" and self.table is not None and self.row is not None:
                self.table.append(self.row)
                self.row = None
            elif kind == "table_close" and self.table is not None:
                self._table(self.table)
                self.table = None
            elif kind == "html_block":
                self.doc.add_paragraph(xml_safe(t.content.strip()))
            i += 1

    def _paragraph(self) -> Any:
        if self.lists and self.item_first:
            self.item_first = False
            lst = self.lists[-1]
            depth = min(len(self.lists), MAX_LIST_DEPTH)
            base = "List Number" if lst.ordered else "List Bullet"
            style = base if depth == 1 else f"{base} {depth}"
            p = self.doc.add_paragraph(style=style)
            if lst.ordered:
                self._number(p, lst, style)
            return p
        if self.lists:  # a later paragraph of a list item: indented, no bullet
            style = (
                "List Continue"
                if len(self.lists) == 1
                else f"List Continue {min(len(self.lists), MAX_LIST_DEPTH)}"
            )
            return self.doc.add_paragraph(style=style)
        if self.quote:
            return self.doc.add_paragraph(style="Quote")
        return self.doc.add_paragraph()

    def _number(self, p: Any, lst: _List, style: str) -> None:
        """Start each numbered list at 1: its own numbering instance over the style's list."""
        numbering = self.doc.part.numbering_part.numbering_definitions._numbering
        if lst.num_id is None:
            base = self.doc.styles[style].element.pPr.numPr.numId.val
            abstract = numbering.num_having_numId(base).abstractNumId.val
            num = numbering.add_num(abstract)
            num.add_lvlOverride(ilvl=0).add_startOverride(1)
            lst.num_id = int(num.numId)
        num_pr = p._p.get_or_add_pPr().get_or_add_numPr()
        num_pr.get_or_add_ilvl().val = 0
        num_pr.get_or_add_numId().val = lst.num_id

    def code(self, text: str) -> None:
        p = self.doc.add_paragraph()
        lines = text.rstrip("\n").split("\n")
        for n, line in enumerate(lines):
            run = p.add_run(xml_safe(line))
            run.font.name = MONO
            if n < len(lines) - 1:
                run.add_break()

    def _table(self, rows: list[list[list[Any]]]) -> None:
        width = max(len(r) for r in rows)
        table = self.doc.add_table(rows=len(rows), cols=width)
        with contextlib.suppress(KeyError):
            table.style = "Table Grid"
        for r, row in enumerate(rows):
            for c, (inline, header) in enumerate(row):
                cell = table.cell(r, c)
                p = cell.paragraphs[0]
                self.inline(p, inline, bold=header)

    # --- inline -----------------------------------------------------------------------------

    def inline(self, p: Any, token: Any, bold: bool = False) -> None:
        strong, em = int(bold), 0
        link: str | None = None
        for c in token.children or []:
            kind = c.type
            if kind == "strong_open":
                strong += 1
            elif kind == "strong_close":
                strong -= 1
            elif kind == "em_open":
                em += 1
            elif kind == "em_close":
                em -= 1
            elif kind == "link_open":
                link = str(c.attrs.get("href", ""))
            elif kind == "link_close":
                if link and not link.startswith("#"):
                    p.add_run(xml_safe(f" ({link})"))
                link = None
            elif kind in ("text", "code_inline", "html_inline") and c.content:
                run = p.add_run(xml_safe(c.content))
                run.bold = strong > 0 or None
                run.italic = em > 0 or None
                if kind == "code_inline":
                    run.font.name = MONO
            elif kind in ("softbreak", "hardbreak"):
                p.add_run().add_break()  # the writer's own line breaks are kept
            elif kind == "image":
                p.add_run(xml_safe(c.content) or "[image]")


def markdown_to_docx(doc: Any, markdown: str) -> None:
    """Append ``markdown`` to the python-docx document ``doc``."""
    _Writer(doc).write(_parser().parse(markdown))


def new_document(title: str = "") -> Any:
    import docx

    doc = docx.Document()
    if title:
        doc.core_properties.title = xml_safe(title)
    return doc


def save_docx(doc: Any, path: Path) -> None:
    """Save through a 0600 temporary file in the same folder (an existing file keeps its
    mode), so no half-written or world-readable copy is left behind."""
    mode = path.stat().st_mode & 0o777 if path.exists() else PRIVATE_FILE
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise VeilError(
            f"cannot write {path}: {exc.strerror}", hint="choose another folder"
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            doc.save(f)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise VeilError(
            f"cannot write {path}: {exc.strerror}", hint="choose another folder"
        ) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def document_docx(title: str, body: str, path: Path) -> None:
    """A drafting document as .docx: its name as the title heading, the text as Markdown."""
    doc = new_document(title)
    if title and not body.lstrip().startswith("#"):
        doc.add_heading(xml_safe(title), level=1)
    markdown_to_docx(doc, body)
    save_docx(doc, path)


# --- Word-friendly plain text -------------------------------------------------------------------


def word_friendly(markdown: str) -> str:
    """Plain text that pastes well anywhere: no Markdown marks (** # `), bullets as "•",
    numbered items numbered, headings on their own line, line breaks kept."""
    out: list[tuple[str, int]] = []  # (block, its list or table: consecutive lines; 0: none)
    group = 0
    lists: list[list[int]] = []  # per open list: [ordered, next number]
    item_first = False
    quote = 0
    tokens = _parser().parse(markdown)
    i = 0
    while i < len(tokens):
        t = tokens[i]
        kind = t.type
        if kind in ("heading_open", "paragraph_open"):
            text = _plain_inline(tokens[i + 1])
            indent = "    " * max(len(lists) - 1, 0)
            if lists and item_first:
                item_first = False
                lst = lists[-1]
                mark = f"{lst[1]}." if lst[0] else "•"
                lst[1] += 1
                text = f"{indent}{mark} " + text.replace("\n", "\n" + indent + "   ")
            elif lists:
                text = indent + "   " + text
            if quote:
                text = "\n".join("    " + line for line in text.split("\n"))
            out.append((text, group if lists else 0))
            i += 3
            continue
        if kind in ("bullet_list_open", "ordered_list_open", "table_open") and not lists:
            group += 1
        if kind == "bullet_list_open":
            lists.append([0, 1])
        elif kind == "ordered_list_open":
            lists.append([1, int(t.attrs.get("start", 1) or 1)])
        elif kind in ("bullet_list_close", "ordered_list_close"):
            lists.pop()
        elif kind == "list_item_open":
            item_first = True
        elif kind == "blockquote_open":
            quote += 1
        elif kind == "blockquote_close":
            quote -= 1
        elif kind in ("fence", "code_block"):
            out.append((t.content.rstrip("\n"), group if lists else 0))
        elif kind == "tr_open":
            cells = []
            j = i + 1
            while tokens[j].type != "tr_close":
                if tokens[j].type == "inline":
                    cells.append(_plain_inline(tokens[j]))
                j += 1
            out.append(("\t".join(cells), group))
            i = j
        i += 1
    # list items sit on consecutive lines; other blocks are separated by a blank line
    text = ""
    for n, (block, grp) in enumerate(out):
        if n:
            text += "\n" if grp and grp == out[n - 1][1] else "\n\n"
        text += block
    return text + "\n" if text else ""


def _plain_inline(token: Any) -> str:
    parts: list[str] = []
    link: str | None = None
    for c in token.children or []:
        if c.type in ("text", "code_inline", "html_inline"):
            parts.append(c.content)
        elif c.type in ("softbreak", "hardbreak"):
            parts.append("\n")
        elif c.type == "link_open":
            link = str(c.attrs.get("href", ""))
        elif c.type == "link_close":
            if link and not link.startswith("#"):
                parts.append(f" ({link})")
            link = None
        elif c.type == "image":
            parts.append(c.content)
    return "".join(parts)


def html(markdown: str) -> str:
    """The same Markdown as HTML (what a word processor pastes with its formatting). HTML
    written in the Markdown (a model's ``<img src="http://…">``) stays text, and an image
    becomes a link: nothing pasted from a reply ever loads a picture from an address."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable("table").disable("image")
    return str(md.render(markdown))


def chat_docx(store: Any, conv_id: int, path: Path) -> None:
    """A chat as .docx: its title, the assistant style, then each message under "You" or
    "Veil" in bold, a reply's sources listed after it."""
    conv = store.conversation(conv_id)
    if conv is None:
        raise VeilError("that chat no longer exists")
    doc = new_document(xml_safe(conv.title))
    doc.add_heading(xml_safe(conv.title), level=1)
    if conv.system_prompt:
        p = doc.add_paragraph()
        p.add_run(xml_safe(f"Assistant style: {conv.system_prompt}")).italic = True
    names = {"user": "You", "assistant": "Veil"}
    for m in store.messages(conv_id):
        doc.add_paragraph().add_run(names.get(m.role, m.role.title())).bold = True
        markdown_to_docx(doc, m.content)
        sources = (m.stats or {}).get("sources") or []
        if sources:
            p = doc.add_paragraph()
            p.add_run("Sources: ").italic = True
            used = "; ".join(f"[{s.get('n')}] {_label(s)}" for s in sources)
            p.add_run(xml_safe(used)).italic = True
    save_docx(doc, path)


def _label(s: dict[str, Any]) -> str:
    from app.core.documents.context import Source

    return Source.from_dict(s).label()
