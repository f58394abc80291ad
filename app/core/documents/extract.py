"""Text out of the user's files, keeping where each passage came from (page, paragraph).

PDF: pypdf, page by page (a scanned page has no text layer and is reported; there is no OCR).
Word (.docx): python-docx, paragraphs and table rows in document order; pages follow the page
breaks Word stores (explicit ones and the ones Word records when it saves). OpenDocument text
(.odt): its ``content.xml`` read with the standard library. Plain text and Markdown: paragraphs
are separated by blank lines, pages by form feeds.

Everything runs on this computer.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

from engine.errors import VeilError

Progress = Callable[[str, float], None]

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".text")
SUFFIXES = (".pdf", ".docx", ".odt", *TEXT_SUFFIXES)
# what the file dialogs offer
FILE_FILTER = "Documents (*.pdf *.docx *.odt *.txt *.md *.markdown *.text)"
MAX_BYTES = 200 * 1024 * 1024  # larger files are refused (one clear line) rather than read


class DocumentError(VeilError):
    """A file could not be read; the message names the file and the reason."""


@dataclass(frozen=True)
class Passage:
    """One paragraph (or a PDF page's text) with where it is: ``page`` is 1-based (None when the
    format has no pages), ``para`` the paragraph number (1-based; on each page for PDFs, in the
    whole document otherwise)."""

    text: str
    page: int | None
    para: int


@dataclass
class Extracted:
    path: Path
    kind: str  # "PDF" | "Word" | "OpenDocument" | "Text"
    passages: list[Passage]
    pages: int = 0  # 0: the format has no pages
    notes: list[str] = field(default_factory=list)  # e.g. pages without a text layer

    @property
    def words(self) -> int:
        return sum(len(p.text.split()) for p in self.passages)

    def text(self) -> str:
        """All the text, paragraphs separated by blank lines (for the drafting pane)."""
        return "\n\n".join(p.text for p in self.passages)


def supported(path: Path) -> bool:
    return path.suffix.lower() in SUFFIXES


def extract(path: str | Path, progress: Progress | None = None) -> Extracted:
    """Read ``path``; raises :class:`DocumentError` (one line) for anything it cannot read."""
    p = Path(path)
    name = p.name
    suffix = p.suffix.lower()
    if suffix not in SUFFIXES:
        raise DocumentError(
            f"cannot read “{name}”: {suffix or 'files without an extension'} is not a "
            "supported kind of file",
            hint="use PDF, Word (.docx), OpenDocument (.odt), text (.txt) or Markdown (.md); "
            "save older Word (.doc) or .rtf files as .docx first",
        )
    try:
        size = p.stat().st_size
    except FileNotFoundError:
        raise DocumentError(f"cannot read “{name}”: the file is not there any more") from None
    except OSError as exc:
        raise DocumentError(f"cannot read “{name}”: {exc.strerror}") from None
    if p.is_dir():
        raise DocumentError(f"“{name}” is a folder", hint="choose files, or add it as a folder")
    if size > MAX_BYTES:
        raise DocumentError(
            f"cannot read “{name}”: it is {size // (1024 * 1024)} MB, more than Veil reads "
            f"({MAX_BYTES // (1024 * 1024)} MB)",
            hint="split it into smaller files",
        )
    try:
        if suffix == ".pdf":
            out = _pdf(p, progress)
        elif suffix == ".docx":
            out = _docx(p, progress)
        elif suffix == ".odt":
            out = _odt(p)
        else:
            out = _text(p)
    except DocumentError:
        raise
    except PermissionError:
        raise DocumentError(f"cannot read “{name}”: permission denied") from None
    except OSError as exc:
        raise DocumentError(f"cannot read “{name}”: {exc.strerror or exc}") from None
    except Exception as exc:  # a damaged file: the parser's own exception, in one line
        raise DocumentError(
            f"cannot read “{name}”: the file seems damaged ({type(exc).__name__}: {exc})",
            hint="open it in its program and save it again",
        ) from None
    if not any(ps.text.strip() for ps in out.passages):
        if out.kind == "PDF":
            raise DocumentError(
                f"“{name}” has no text Veil can read: it looks like a scanned PDF (pictures "
                "of pages)",
                hint="Veil does not read scanned pages; use a PDF with a text layer (run it "
                "through your scanner's text recognition first)",
            )
        raise DocumentError(f"“{name}” contains no text")
    return out


# --- PDF -------------------------------------------------------------------------------------

_HYPHEN = re.compile(r"(\w)-\n(\w)")


def _pdf_page_paragraphs(text: str) -> list[str]:
    """A page's text as paragraphs: blank lines split them; wrapped lines are joined (a word
    broken with a hyphen at the line end is joined too)."""
    text = _HYPHEN.sub(r"\1\2", text.replace("\r\n", "\n"))
    out = []
    for block in re.split(r"\n\s*\n", text):
        joined = " ".join(line.strip() for line in block.splitlines() if line.strip())
        if joined:
            out.append(joined)
    return out


def _pdf(p: Path, progress: Progress | None) -> Extracted:
    from pypdf import PdfReader
    from pypdf.errors import FileNotDecryptedError, PdfReadError

    try:
        reader = PdfReader(str(p))
        if reader.is_encrypted and not reader.decrypt(""):
            raise FileNotDecryptedError("password")
        pages = reader.pages
        n = len(pages)
    except FileNotDecryptedError:
        raise DocumentError(
            f"cannot read “{p.name}”: the PDF is protected with a password",
            hint="save a copy without the password first",
        ) from None
    except PdfReadError as exc:
        raise DocumentError(
            f"cannot read “{p.name}”: it is not a readable PDF ({exc})",
            hint="open it in a PDF reader and save or print it to a new PDF",
        ) from None
    passages: list[Passage] = []
    empty: list[int] = []
    for i, page in enumerate(pages, start=1):
        if progress:
            progress(f"reading {p.name}", (i - 1) / max(n, 1))
        paras = _pdf_page_paragraphs(page.extract_text() or "")
        if not paras:
            empty.append(i)
        passages += [Passage(t, i, j) for j, t in enumerate(paras, start=1)]
    notes = []
    if empty and len(empty) < n:
        notes.append(
            f"{_pages_text(empty)} ha{'s' if len(empty) == 1 else 've'} no text (scanned?)"
        )
    return Extracted(p, "PDF", passages, pages=n, notes=notes)


def _pages_text(pages: list[int]) -> str:
    shown = ", ".join(str(x) for x in pages[:8]) + (" …" if len(pages) > 8 else "")
    return f"page {shown}" if len(pages) == 1 else f"pages {shown}"


# --- Word ------------------------------------------------------------------------------------

_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"


def _page_breaks(element: Any) -> int:
    """Page breaks inside a paragraph's XML: explicit ones and the ones Word records on save."""
    n = 0
    for el in element.iter():
        explicit = el.tag == f"{_W}br" and el.get(f"{_W}type") == "page"
        if explicit or el.tag == f"{_W}lastRenderedPageBreak":
            n += 1
    return n


def _docx(p: Path, progress: Progress | None) -> Extracted:
    import docx
    from docx.opc.exceptions import PackageNotFoundError
    from docx.table import Table

    try:
        document = docx.Document(str(p))
    except (PackageNotFoundError, zipfile.BadZipFile, KeyError):
        raise DocumentError(
            f"cannot read “{p.name}”: it is not a Word (.docx) document",
            hint="an older .doc file must be saved as .docx in Word first",
        ) from None
    blocks = list(document.iter_inner_content())
    page, para = 1, 0
    passages: list[Passage] = []
    any_break = False
    for i, block in enumerate(blocks):
        if progress and i % 50 == 0:
            progress(f"reading {p.name}", i / max(len(blocks), 1))
        if isinstance(block, Table):
            texts = []
            for row in block.rows:
                cells: list[str] = []
                for cell in row.cells:
                    t = " ".join(cell.text.split())
                    if t and (not cells or cells[-1] != t):  # merged cells repeat their text
                        cells.append(t)
                if cells:
                    texts.append(" | ".join(cells))
            breaks = _page_breaks(block._element)
        else:
            texts = [" ".join(block.text.split())]
            breaks = _page_breaks(block._element)
        # a break inside a paragraph: the paragraph starts on the earlier page (close enough)
        for t in texts:
            if t:
                para += 1
                passages.append(Passage(t, page, para))
        if breaks:
            any_break = True
            page += breaks
    if not any_break:  # no page information stored: paragraphs only
        passages = [Passage(ps.text, None, ps.para) for ps in passages]
        return Extracted(p, "Word", passages)
    last = passages[-1].page if passages else 1
    return Extracted(p, "Word", passages, pages=last or 1)


# --- OpenDocument ------------------------------------------------------------------------------

_TEXT_NS = "urn:oasis:names:tc:opendocument:xmlns:text:1.0"


def _odt_text(el: ElementTree.Element) -> str:
    parts: list[str] = [el.text or ""]
    for child in el:
        tag = child.tag.split("}")[-1]
        if tag == "s":
            parts.append(" " * int(child.get(f"{{{_TEXT_NS}}}c", "1")))
        elif tag in ("tab", "line-break"):
            parts.append(" ")
        elif tag != "note":  # footnote bodies are paragraphs of their own
            parts.append(_odt_text(child))
        parts.append(child.tail or "")
    return "".join(parts)


def _odt(p: Path) -> Extracted:
    try:
        with zipfile.ZipFile(p) as z:
            root = ElementTree.fromstring(z.read("content.xml"))
    except (zipfile.BadZipFile, KeyError):
        raise DocumentError(f"cannot read “{p.name}”: it is not an OpenDocument text") from None
    passages: list[Passage] = []
    for el in root.iter():
        if el.tag in (f"{{{_TEXT_NS}}}p", f"{{{_TEXT_NS}}}h"):
            t = " ".join(_odt_text(el).split())
            if t:
                passages.append(Passage(t, None, len(passages) + 1))
    return Extracted(p, "OpenDocument", passages)


# --- plain text --------------------------------------------------------------------------------


def _decode(raw: bytes) -> str:
    for enc in ("utf-8-sig", "utf-16") if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else ("utf-8-sig",):
        try:
            return raw.decode(enc)
        except UnicodeDecodeError:
            continue
    return raw.decode("cp1252", errors="replace")  # older Windows text files


def _text(p: Path) -> Extracted:
    text = _decode(p.read_bytes()).replace("\r\n", "\n").replace("\r", "\n")
    pages = text.split("\f")
    paged = len(pages) > 1
    passages: list[Passage] = []
    for n, page in enumerate(pages, start=1):
        for block in _paragraphs(page):
            passages.append(Passage(block, n if paged else None, len(passages) + 1))
    return Extracted(p, "Text", passages, pages=len(pages) if paged else 0)


def _paragraphs(text: str) -> Iterator[str]:
    for block in re.split(r"\n\s*\n", text):
        b = block.strip()
        if b:
            yield b
