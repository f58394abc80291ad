"""Model text as formatted text, safely: Markdown only, never HTML, never an image.

A reply is the model's words, and a model can be steered (by a pasted page, a document) into
writing HTML: ``<img src="http://…">`` would make the window fetch an address, a ``<style>`` or
``<table>`` could dress a reply up as something else. Qt's own Markdown reader is asked to keep
any HTML as plain text (``MarkdownNoHTML``), and every image (``![alt](address)``) becomes its
alt text, so no resource, remote or local, is ever loaded. Bold, italics, lists, headings,
tables, code and links keep working (links are shown, never opened by a click).
"""

from __future__ import annotations

import re

from PySide6.QtGui import QTextCursor, QTextDocument, QTextFormat

FEATURES = QTextDocument.MarkdownFeature(
    QTextDocument.MarkdownFeature.MarkdownDialectGitHub.value
    | QTextDocument.MarkdownFeature.MarkdownNoHTML.value
)
_BODY_STYLE = re.compile(r"<body\b[^>]*>")  # the font Qt writes there would beat the theme's


def markdown_document(text: str) -> QTextDocument:
    """``text`` read as Markdown (HTML in it stays text; images become their alt text)."""
    doc = QTextDocument()
    doc.setMarkdown(text, FEATURES)
    images: list[tuple[int, int, str]] = []
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            fmt = frag.charFormat()
            if fmt.isImageFormat():
                alt = fmt.property(QTextFormat.Property.ImageAltText)
                images.append((frag.position(), frag.length(), str(alt or "")))
            it += 1
        block = block.next()
    for pos, length, alt in reversed(images):
        cur = QTextCursor(doc)
        cur.setPosition(pos)
        cur.setPosition(pos + length, QTextCursor.MoveMode.KeepAnchor)
        plain = cur.charFormat()
        plain.clearProperty(QTextFormat.Property.ObjectType)
        plain.clearProperty(QTextFormat.Property.ImageName)
        cur.insertText(alt, plain)
    return doc


def has_image(doc: QTextDocument) -> bool:
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            if it.fragment().charFormat().isImageFormat():
                return True
            it += 1
        block = block.next()
    return False


def markdown_html(text: str) -> str:
    """``text`` (Markdown) as the HTML a label shows or the clipboard carries: only what Qt
    wrote for the Markdown's own formatting; the label's font and colours still apply."""
    return _BODY_STYLE.sub("<body>", markdown_document(text).toHtml(), count=1)
