"""The app as a new, non-technical user meets it (issue 18), part 2, pytest-qt, offscreen,
tiny model: Tab moves focus, the length-limit notice with Continue, the side panel at large
text in the dark theme, icons on a theme change, Copy, Export, the document title and focus,
and the smaller items."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QEvent, QPoint, Qt
from PySide6.QtGui import QColor, QGuiApplication, QTextDocument
from PySide6.QtWidgets import (
    QAbstractButton,
    QApplication,
    QFileDialog,
    QLabel,
    QWidget,
)

from app.core.settings import FONT_SIZES
from tests.gui_support import local_window, theme_reset
from tests.test_gui_app import WAIT_MS, send, tiny, wait_idle  # noqa: F401

pytestmark = pytest.mark.gui


def test_tab_moves_focus_in_message_box_and_editor(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    w = local_window(qtbot, tiny, tmp_path)
    box = w.chat_view.composer
    box.setFocus()
    qtbot.waitUntil(lambda: box.hasFocus(), timeout=WAIT_MS)
    qtbot.keyClicks(box, "hello")
    qtbot.keyClick(box, Qt.Key.Key_Tab)
    assert box.toPlainText() == "hello" and not box.hasFocus()
    assert QApplication.focusWidget() is w.chat_view.send_button

    w.show_pane("drafting")
    ed = w.drafting_pane.editor
    qtbot.waitUntil(lambda: ed.hasFocus(), timeout=WAIT_MS)
    qtbot.keyClicks(ed, "Dear team")
    qtbot.keyClick(ed, Qt.Key.Key_Tab)
    assert "\t" not in ed.toPlainText() and not ed.hasFocus()
    ed.setFocus()
    qtbot.waitUntil(lambda: ed.hasFocus(), timeout=WAIT_MS)
    qtbot.keyClick(ed, Qt.Key.Key_Backtab, Qt.KeyboardModifier.ShiftModifier)
    assert not ed.hasFocus()
    ed.setFocus()
    qtbot.keyClick(ed, Qt.Key.Key_Tab, Qt.KeyboardModifier.ControlModifier)  # types a tab
    assert ed.toPlainText().endswith("\t") and ed.hasFocus()
    w.close()


def test_length_limit_notice_and_continue(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    w = local_window(qtbot, tiny, tmp_path, max_tokens=6)
    chat = w.app.chat
    send(qtbot, w, "The quick brown fox")
    wait_idle(qtbot, w)
    first = chat.messages()[-1]
    assert first.finish_reason == "length"  # a random tiny model does not stop by itself
    bubble = w.chat_view.widgets[first.id]
    assert bubble.note.text() == "Reply hit the length limit." and not bubble.note.isHidden()
    assert not bubble.continue_button.isHidden()
    before = first.content
    qtbot.mouseClick(bubble.continue_button, Qt.MouseButton.LeftButton)
    assert bubble.continue_button.isHidden()  # not while it writes
    wait_idle(qtbot, w)
    msgs = chat.messages()
    assert len(msgs) == 2  # the same reply grew; no new message
    assert msgs[-1].content.startswith(before) and len(msgs[-1].content) > len(before)
    assert bubble.plain_text().strip() == msgs[-1].content.strip()
    send(qtbot, w, "again")  # Continue is offered on the last reply only
    wait_idle(qtbot, w)
    assert bubble.continue_button.isHidden()
    assert not w.chat_view.widgets[chat.messages()[-1].id].continue_button.isHidden()
    w.close()


def _clipped(root: QWidget) -> list[str]:
    """Visible labels and buttons of ``root`` whose text does not fit their box, or that stick
    out of ``root`` on the right."""
    bad = []
    for wd in root.findChildren(QWidget):
        if not wd.isVisibleTo(root) or not isinstance(wd, QLabel | QAbstractButton):
            continue
        if isinstance(wd, QLabel) and not wd.text():
            continue
        name = f"{type(wd).__name__}({getattr(wd, 'text', lambda: '')()[:40]!r})"
        if isinstance(wd, QLabel) and wd.wordWrap():
            need_h = wd.heightForWidth(wd.width())
            if need_h > wd.height() + 1 or wd.minimumSizeHint().width() > wd.width():
                bad.append(f"{name} wraps to {need_h}px in {wd.width()}x{wd.height()}")
        else:
            hint = wd.sizeHint()
            if hint.width() > wd.width() + 1 or hint.height() > wd.height() + 1:
                bad.append(f"{name} needs {hint.width()}x{hint.height()} in {wd.size()}")
        right = wd.mapTo(root, QPoint(wd.width(), 0)).x()
        if right > root.width() + 1:
            bad.append(f"{name} ends at x={right} beyond {root.width()}")
    return bad


@pytest.mark.parametrize("pt", [13, FONT_SIZES[1]])
def test_side_panel_is_not_clipped_at_large_text_in_dark(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    pt: int,
):
    w = local_window(qtbot, tiny, tmp_path)
    s = w.app.settings
    w.apply_settings(type(s)(**{**vars(s), "theme": "dark", "font_size": pt}))
    w.resize(1280, 800)
    w.panels.wanted = True  # (at 20 pt the panel folds away at this width: the rail shows it)
    w.panels.apply()
    send(qtbot, w, "hello")  # fill the gauges
    wait_idle(qtbot, w)
    panel, scroll = w.side_panel, w.side_scroll
    for k in range(1, w.privacy.slider.maximum() + 1):
        w.privacy.slider.setValue(k)
        w.gauges.refresh()
        QApplication.processEvents()
        QApplication.sendPostedEvents(None, QEvent.Type.LayoutRequest)
        assert panel.width() <= scroll.viewport().width(), (k, panel.width())
        assert _clipped(panel) == [], (pt, k)
    w.close()
    theme_reset()


def test_icons_recolour_when_the_theme_changes(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    from app.views.theme import colors

    w = local_window(qtbot, tiny, tmp_path)

    def tint(button: QAbstractButton) -> QColor:
        img = button.icon().pixmap(20, 20).toImage()
        inked = [QColor.fromRgba(img.pixel(x, y)) for x in range(20) for y in range(20)]
        return max(inked, key=lambda c: c.alpha())

    assert tint(w.chat_view.regen_button).name() == colors("light")["text"]
    s = w.app.settings
    w.apply_settings(type(s)(**{**vars(s), "theme": "dark"}))
    dark = colors("dark")["text"]
    for b in (w.chat_view.regen_button, w.chat_view.edit_button, w.sidebar.nav_chat):
        assert tint(b).name() == dark, b.accessibleName()
    assert tint(w.chat_view.export_button).name() == dark
    w.close()
    theme_reset()


def test_copy_reply_keeps_line_breaks(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    from app.core.storage import Message
    from app.views.message_widget import MessageWidget

    w = local_window(qtbot, tiny, tmp_path)
    text = "Thanks for the call.\n\nKind regards,\nSam Patel\nOffice Manager"
    m = MessageWidget(Message(1, 1, "assistant", text, 0.0, "eos", {}))
    qtbot.addWidget(m)
    m.show()
    shown = QTextDocument()
    shown.setHtml(m.parts[0].text())  # shown with real line breaks too
    assert "Kind regards,\nSam Patel\nOffice Manager" in shown.toPlainText()
    qtbot.mouseClick(m.copy_button, Qt.MouseButton.LeftButton)
    cb = QGuiApplication.clipboard()
    assert cb.text() == text
    assert cb.mimeData().hasHtml() and "Sam Patel" in cb.mimeData().html()
    assert m.copy_button.text() == "Copied"
    cb.clear()  # the offscreen platform crashes at exit when it still holds rich data
    w.close()


def test_export_starts_in_documents_and_confirms(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    from PySide6.QtCore import QStandardPaths

    from app.views import export

    w = local_window(qtbot, tiny, tmp_path)
    send(qtbot, w, "hello")
    wait_idle(qtbot, w)
    asked: list[tuple[str, str]] = []
    out = tmp_path / "out"
    out.mkdir()

    def fake_save(_parent: Any, _title: str, start: str, filters: str) -> tuple[str, str]:
        asked.append((start, filters))
        return str(out / "my chat"), "Formatted text (*.md)"

    monkeypatch.setattr(QFileDialog, "getSaveFileName", fake_save)
    opened: list[str] = []
    monkeypatch.setattr(export, "open_folder", lambda p: opened.append(str(p.parent)) or True)
    qtbot.mouseClick(w.chat_view.export_button, Qt.MouseButton.LeftButton)
    docs = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    want_start = docs if docs and Path(docs).is_dir() else str(Path.home())
    assert asked[0][0].startswith(want_start) and asked[0][0].endswith("hello.md")
    assert "Formatted text (*.md)" in asked[0][1] and "Markdown" not in asked[0][1]
    saved = out / "my chat.md"
    assert saved.read_text().startswith("# hello")
    banner = w.chat_view.error
    assert banner.kind == "notice" and "Saved “my chat.md”" in banner.text()
    assert banner.action.text() == "Open folder"
    qtbot.mouseClick(banner.action, Qt.MouseButton.LeftButton)
    assert opened == [str(out)]
    qtbot.mouseClick(w.chat_view.export_button, Qt.MouseButton.LeftButton)
    assert asked[1][0].startswith(str(out))  # the next export starts where the last went
    w.close()


def test_document_title_placeholder_and_focus_after_accept(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
):
    w = local_window(qtbot, tiny, tmp_path)
    w.show_pane("drafting")
    pane = w.drafting_pane
    w.app.drafting.new_document(body="Dear team, the fox is quick.")
    assert pane.title.text() == "" and pane.title.placeholderText() == "Untitled document"
    pane.title.setFocus()
    qtbot.keyClicks(pane.title, "Budget memo")
    qtbot.keyClick(pane.title, Qt.Key.Key_Return)
    doc = w.app.store.document(w.app.drafting.current)
    assert doc is not None and doc.title == "Budget memo"
    c = pane.editor.textCursor()
    c.setPosition(11)
    c.setPosition(28, c.MoveMode.KeepAnchor)
    pane.editor.setTextCursor(c)
    qtbot.mouseClick(pane.action_buttons["formal"], Qt.MouseButton.LeftButton)
    wait_idle(qtbot, w)
    qtbot.mouseClick(pane.accept_button, Qt.MouseButton.LeftButton)
    assert pane.editor.hasFocus()  # Ctrl+Z works at once
    qtbot.keyClick(pane.editor, Qt.Key.Key_Z, Qt.KeyboardModifier.ControlModifier)
    assert pane.editor.toPlainText() == "Dear team, the fox is quick."
    qtbot.mouseClick(pane.action_buttons["grammar"], Qt.MouseButton.LeftButton)
    wait_idle(qtbot, w)
    qtbot.mouseClick(pane.reject_button, Qt.MouseButton.LeftButton)
    assert pane.editor.hasFocus()
    w.close()


def test_small_things(qtbot: Any, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    from app.views import settings_dialog
    from app.views.settings_dialog import SettingsDialog

    w = local_window(qtbot, tiny, tmp_path)
    send(qtbot, w, "hello")
    wait_idle(qtbot, w)
    # "New setting" goes away once a message used it
    w.privacy.slider.setValue(2)
    assert w.privacy.note.text().startswith("New setting")
    send(qtbot, w, "hi")
    wait_idle(qtbot, w)
    assert w.privacy.note.isHidden()
    # "No chats match." right under the search box
    sb = w.sidebar
    sb.search.setText("nothing like this")
    hint = sb.empty_hint
    assert hint.text() == "No chats match." and not hint.isHidden()
    gap = hint.mapTo(sb, QPoint(0, 0)).y() - sb.search.mapTo(sb, QPoint(0, sb.search.height())).y()
    assert 0 <= gap <= 20
    # no jargon in the assistant styles
    names = [w.chat_view.preset.itemText(i) for i in range(w.chat_view.preset.count())]
    assert not any("prompt" in n.lower() for n in names)
    # copying the computer's key says "Copied"
    monkeypatch.setattr(settings_dialog, "client_public_key", lambda: "K" * 40)
    dlg = SettingsDialog(w.app.settings, w)
    qtbot.addWidget(dlg)
    qtbot.mouseClick(dlg.copy_key, Qt.MouseButton.LeftButton)
    assert dlg.copy_key.text() == "Copied" and QGuiApplication.clipboard().text() == "K" * 40
    # the speed chart draws one line per reply, not across the idle time between them
    g = w.app.gauge_state
    assert len(g.last_minute_runs()) == len({r for _t, _v, r in g.history}) >= 1
    w.close()
