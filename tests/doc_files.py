"""Test documents with known text on known pages: PDFs (reportlab), Word files (python-docx),
OpenDocument text (written as its zip of XML), and a matter of many files."""

from __future__ import annotations

import zipfile
from pathlib import Path

TOPICS = (
    "rent",
    "insurance",
    "parking",
    "maintenance",
    "subletting",
    "utilities",
    "noise",
    "pets",
    "repairs",
    "keys",
)


def make_pdf(path: Path, pages: list[list[str]]) -> Path:
    """A PDF with one page per list of paragraphs (a real text layer, as a word processor
    would write it)."""
    from reportlab.lib.pagesizes import A4
    from reportlab.lib.styles import getSampleStyleSheet
    from reportlab.platypus import PageBreak, Paragraph, SimpleDocTemplate

    styles = getSampleStyleSheet()
    story: list[object] = []
    for n, paras in enumerate(pages):
        for text in paras:
            story.append(Paragraph(text, styles["BodyText"]))
        if n < len(pages) - 1:
            story.append(PageBreak())
    SimpleDocTemplate(str(path), pagesize=A4, invariant=1).build(story)
    return path


def make_scanned_pdf(path: Path) -> Path:
    """A PDF whose pages are only pictures (no text layer), like a scan."""
    from reportlab.pdfgen import canvas

    c = canvas.Canvas(str(path), invariant=1)
    for _ in range(2):
        c.rect(60, 60, 300, 400, fill=1)
        c.showPage()
    c.save()
    return path


def make_docx(path: Path, pages: list[list[str]], page_breaks: bool = True) -> Path:
    """A Word file: the paragraphs of each page, with a page break between pages."""
    import docx

    d = docx.Document()
    for n, paras in enumerate(pages):
        for text in paras:
            d.add_paragraph(text)
        if page_breaks and n < len(pages) - 1:
            d.add_page_break()
    d.save(str(path))
    return path


def make_odt(path: Path, paragraphs: list[str]) -> Path:
    ns = (
        'xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" '
        'xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0"'
    )
    body = "".join(f"<text:p>{p}</text:p>" for p in paragraphs)
    xml = (
        f'<?xml version="1.0"?><office:document-content {ns}><office:body><office:text>'
        f"{body}</office:text></office:body></office:document-content>"
    )
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("mimetype", "application/vnd.oasis.opendocument.text")
        z.writestr("content.xml", xml)
    return path


def filler(topic: str, n: int) -> str:
    return (
        f"Paragraph {n} about {topic}. The parties agree that matters of {topic} follow the "
        f"general terms of this agreement and the schedule attached to it."
    )


CLAUSE = (
    "Force majeure: neither party is liable for a delay caused by flood, fire, strike or an act "
    "of government, provided it notifies the other party within fourteen days."
)
CLAUSE_FILE, CLAUSE_PAGE = "lease-07.docx", 3


def make_matter(folder: Path, n_files: int = 50) -> Path:
    """``n_files`` files (PDF, Word, text) of 3 pages each about everyday lease topics; the
    force-majeure clause is only in ``CLAUSE_FILE`` on page ``CLAUSE_PAGE``."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        topic = TOPICS[i % len(TOPICS)]
        pages = [[filler(topic, 3 * p + q) for q in range(3)] for p in range(3)]
        kind = ("pdf", "docx", "txt")[i % 3]
        name = f"lease-{i:02d}.{kind}"
        if name == CLAUSE_FILE:
            pages[CLAUSE_PAGE - 1].insert(1, CLAUSE)
        path = folder / name
        if kind == "pdf":
            make_pdf(path, pages)
        elif kind == "docx":
            make_docx(path, pages)
        else:
            path.write_text("\f".join("\n\n".join(p) for p in pages), encoding="utf-8")
    return folder
