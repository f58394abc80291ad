"""Issue 30, third pass, pytest-qt, offscreen: a reply's HTML is shown as text (never loaded,
never laid out), Markdown formatting still works; a message too long for the model can be
summarised in parts."""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtGui import QGuiApplication, QTextDocument

from app.core.storage import Message
from tests.test_gui_app import WAIT_MS, send, tiny, wait_idle  # noqa: F401

pytestmark = pytest.mark.gui

EVIL = (
    'Here is the answer <img src="http://evil.example/x.png"> with **bold** words.\n\n'
    "<style>p { color: red }</style>\n\n<table><tr><td>cell</td></tr></table>\n\n"
    '<a href="http://evil.example/">click</a> and ![logo](http://evil.example/logo.png)\n\n'
    "- first item\n- second item\n\nUse `<b>` for bold."
)


def shown(html: str) -> QTextDocument:
    doc = QTextDocument()
    doc.setHtml(html)
    return doc


def images(doc: QTextDocument) -> list[str]:
    out = []
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fmt = it.fragment().charFormat()
            if fmt.isImageFormat():
                out.append(fmt.toImageFormat().name())
            it += 1
        block = block.next()
    return out


def test_reply_html_is_shown_as_text_and_nothing_is_loaded(qtbot: Any):
    from app.views.message_widget import MessageWidget

    asked: list[str] = []

    class Watch(QTextDocument):  # what a label's document would fetch, if anything
        def loadResource(self, kind: int, name: Any) -> Any:
            asked.append(name.toString())
            return super().loadResource(kind, name)

    m = MessageWidget(Message(1, 1, "assistant", EVIL, 0.0, "eos", {}))
    qtbot.addWidget(m)
    m.show()
    html = m.parts[0].text()
    doc = Watch()
    doc.setHtml(html)
    text = doc.toPlainText()
    for tag in ('<img src="http://evil.example/x.png">', "<style>", "<table>", "<a href="):
        assert tag in text, tag
    assert "logo" in text and images(doc) == [] and asked == []
    assert "<img" not in html.replace("&lt;img", "")  # no image tag reaches the label
    # Markdown still formats: bold, a list, code
    assert "<b>" in text and "first item" in text and "**" not in text
    assert "font-weight:700" in html and "<ul" in html and "monospace" in html
    # and the user's own words stay plain text
    u = MessageWidget(Message(2, 1, "user", "<b>not bold</b>", 0.0, "", {}))
    qtbot.addWidget(u)
    assert u.parts[0].text() == "<b>not bold</b>"


def test_copied_reply_carries_no_html_of_the_model(qtbot: Any):
    from app.core.documents.word import html as word_html
    from app.views.message_widget import MessageWidget

    m = MessageWidget(Message(1, 1, "assistant", EVIL, 0.0, "eos", {}))
    qtbot.addWidget(m)
    m.copy()
    cb = QGuiApplication.clipboard()
    pasted = cb.mimeData().html()
    cb.clear()  # the offscreen platform crashes at exit when it still holds rich data
    assert "&lt;img" in pasted and images(shown(pasted)) == [] and "<style>p" not in pasted
    word = word_html(EVIL)
    assert "&lt;img" in word and "<img" not in word and "<style>" not in word
    assert "<strong>bold</strong>" in word and images(shown(word)) == []
