"""Issue 30, third pass, pytest-qt, offscreen: a reply's HTML is shown as text (never loaded,
never laid out), Markdown formatting still works; a message too long for the model can be
summarised in parts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtGui import QGuiApplication, QTextDocument
from PySide6.QtWidgets import QApplication

from app.core.storage import Message
from tests.gui_support import local_window
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


def test_summarise_in_parts_from_the_too_long_choice(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    from PySide6.QtCore import Qt

    from app.core.summarise import summary_note
    from app.views.chat_view import IN_PARTS

    w = local_window(qtbot, tiny, tmp_path, max_tokens=8)
    view, chat = w.chat_view, w.app.chat
    send(qtbot, w, "hi")  # the model is loaded: its tokenizer measures
    wait_idle(qtbot, w)
    text = "List the dates.\n\n" + " ".join(f"day{i} of March" for i in range(120))
    check = chat.length_check(text)
    assert check is not None and not check.fits
    # the question offers the three choices, Cancel by default
    box = view.cut_box(check, text)
    names = [b.text().replace("&", "") for b in box.buttons()]
    assert {"Send the first part", "Summarise in parts", "Cancel"} <= set(names)
    assert "summarise it in parts (about " in box.text()
    assert box.defaultButton() is box.button(box.StandardButton.Cancel)
    box.deleteLater()

    # chosen: each part is summarised in turn, shown in the waiting reply and the status bar
    view.ask_cut = lambda check, text: IN_PARTS  # type: ignore[method-assign]
    seen: list[tuple[str, str]] = []

    def look(i: int, n: int) -> None:
        QApplication.processEvents()
        bubble = view.widgets[max(view.widgets)]
        seen.append((bubble.plain_text(), w.status.text()))

    chat.summarising.connect(look)
    send(qtbot, w, text)
    assert view.composer.toPlainText() == ""
    wait_idle(qtbot, w)
    n = chat.messages()[-1].stats["summary_parts"]
    assert n >= 2 and [b for b, _ in seen] == [
        f"Summarising part {i} of {n}…" for i in range(1, n + 1)
    ]
    assert all(s == b for b, s in seen), seen
    user, reply = chat.messages()[-2:]
    assert user.content.startswith("List the dates.") and f"in {n} parts" in user.content
    bubble = view.widgets[reply.id]
    assert (
        reply.content and bubble.note.text().startswith(summary_note(n)) and bubble.note.isVisible()
    )

    # Esc while part 2 is summarised: nothing is sent and the text is back in the box
    before = len(chat.messages())
    chat.summarising.connect(lambda i, n: qtbot.keyClick(w, Qt.Key.Key_Escape) if i == 2 else None)
    send(qtbot, w, text)
    wait_idle(qtbot, w)
    assert len(chat.messages()) == before and view.composer.toPlainText() == text
    assert len(view.widgets) == before
    w.close()


def test_no_blank_stretch_under_the_last_message(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    """Scrolled to the end, the last message ends at the bottom of the conversation (the
    word-wrapped text's tall minimum once left a blank stretch of ~110 px under it)."""
    from tests.test_gui_day_one import QUESTION, REPLY, settle

    w = local_window(qtbot, tiny, tmp_path)
    store, view = w.app.store, w.chat_view
    conv = store.create_conversation("Retainer")
    for role, text in (("user", QUESTION), ("assistant", REPLY), ("user", "Thanks!")):
        store.add_message(conv, role, text)
    last = store.add_message(conv, "assistant", REPLY)
    w.app.chat.open(conv)
    for size in ((1000, 640), (1150, 720), (1280, 800)):
        w.resize(*size)
        settle()
        bottom = view.rows[last.id].geometry().bottom() + view.list.contentsMargins().bottom()
        inner, port = view.inner.height(), view.scroll_area.viewport().height()
        assert inner > port  # the conversation scrolls at these sizes
        assert inner - bottom <= 2, (size, inner, bottom)
    w.close()
