"""Issue 34 in the window (pytest-qt, offscreen, tiny model in this process): attaching files
(button and drag and drop) with progress, a reply's [file, page] links opening the passage,
matters from the sidebar, files opened in the drafting pane, Word export of a chat and a
document, "Copy as Word-friendly text", and the API switch in Settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytestqt")
pytestmark = pytest.mark.gui

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl  # noqa: E402
from PySide6.QtGui import QDragEnterEvent, QDropEvent, QGuiApplication  # noqa: E402
from PySide6.QtWidgets import QFileDialog, QInputDialog  # noqa: E402

from app.main_window import MainWindow  # noqa: E402
from app.views import attach, export  # noqa: E402
from app.views.attach import FileDrop  # noqa: E402
from app.views.sources import PassageDialog, SourcesBar, copy_word_friendly  # noqa: E402
from tests.doc_files import make_docx, make_pdf  # noqa: E402
from tests.gui_support import local_window  # noqa: E402
from tests.test_gui_app import WAIT_MS, send, tiny, wait_idle  # noqa: E402, F401

CLAUSE = "The security deposit equals three months of rent."


def files(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    pdf = make_pdf(
        folder / "lease.pdf", [["Parties: Alpha and Beta."], ["Rent is monthly."], [CLAUSE]]
    )
    docx = make_docx(folder / "rules.docx", [["Quiet hours start at ten."], ["No pets."]])
    return pdf, docx


def wait_read(qtbot: Any, w: MainWindow) -> None:
    qtbot.waitUntil(lambda: w.app.documents.busy == 0, timeout=WAIT_MS)


def sources_bar(w: MainWindow) -> SourcesBar | None:
    last = w.chat_view.widgets[max(w.chat_view.widgets)]
    return getattr(last, "sources_bar", None)


def test_attach_ask_and_open_the_cited_passage(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = local_window(qtbot, tiny, tmp_path / "data", max_tokens=4)
    pdf, docx = files(tmp_path / "files")
    monkeypatch.setattr(attach, "ask_files", lambda *a: [pdf, docx])
    stages: list[str] = []
    w.app.documents.progress.connect(lambda s, _f: stages.append(s))
    qtbot.mouseClick(w.chat_view.attach_button, Qt.MouseButton.LeftButton)
    wait_read(qtbot, w)
    assert any("reading lease.pdf" in s for s in stages)  # progress was reported
    bar = w.chat_view.attachments
    assert bar.isVisible()
    chips = [c.text() for c in bar.chips]
    assert chips[0].startswith("lease.pdf · 3 p.") and chips[1].startswith("rules.docx")
    send(qtbot, w, "How much is the security deposit?")
    wait_idle(qtbot, w)
    sb = sources_bar(w)
    assert sb is not None and sb.isVisible()
    assert sb.texts()[0] == "[1] lease.pdf, p. 3"  # the best match first
    assert "lease.pdf,&nbsp;p.&nbsp;3" in sb.links.text()
    assert sb.used.text().startswith("Used ")
    sb.links.linkActivated.emit("1")  # what clicking the link does
    dlg = sb.dialog
    assert isinstance(dlg, PassageDialog) and dlg.isVisible()
    assert dlg.windowTitle() == "lease.pdf — page 3"
    assert CLAUSE in dlg.text.toPlainText()
    assert "<b>security</b>" in dlg.text.toHtml() or "font-weight" in dlg.text.toHtml()
    assert dlg.open_button.isEnabled()
    dlg.reject()
    qtbot.waitUntil(lambda: sb.dialog is None, timeout=WAIT_MS)
    # the sources are shown again after a restart of the chat view
    conv = w.app.chat.current
    w.app.chat.new_conversation()
    w.app.chat.open(conv)
    sb = sources_bar(w)
    assert sb is not None and "[1] lease.pdf, p. 3" in sb.texts()
    # removing a file: its chip goes
    qtbot.mouseClick(bar.chips[1], Qt.MouseButton.LeftButton)
    wait_read(qtbot, w)
    assert [c.text().split(" ")[0] for c in bar.chips] == ["lease.pdf"]
    w.close()


def drop(target: FileDrop, paths: list[Path], text: str = "") -> tuple[bool, bool]:
    """A drag over ``target``'s widget and a drop there: (drag accepted, drop accepted). Qt
    delivers drop events only during a real drag, so they are given to the filter directly."""
    mime = QMimeData()
    if paths:
        mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    if text:
        mime.setText(text)
    args = (Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton)
    enter = QDragEnterEvent(QPoint(10, 10), *args, Qt.KeyboardModifier.NoModifier)
    dropped = QDropEvent(QPointF(10, 10), *args, Qt.KeyboardModifier.NoModifier)
    widget = target.parent()
    return target.eventFilter(widget, enter), target.eventFilter(widget, dropped)


def test_drop_files_on_the_chat_and_the_editor(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    w = local_window(qtbot, tiny, tmp_path / "data")
    pdf, docx = files(tmp_path / "files")
    assert drop(w.chat_view.file_drop, [], text="just text") == (False, False)
    assert drop(w.chat_view.file_drop, [docx]) == (True, True)
    wait_read(qtbot, w)
    assert [f.name for f in w.app.documents.chat_files(w.app.chat.current)] == ["rules.docx"]
    # a bad file: one line in the chat's banner, nothing attached
    (tmp_path / "old.doc").write_text("x")
    drop(w.chat_view.file_drop, [tmp_path / "old.doc"])
    assert "not a supported kind" in w.chat_view.error.text()
    # the drafting pane opens a dropped file as a new document
    w.show_pane("drafting")
    assert drop(w.drafting_pane.file_drop, [pdf]) == (True, True)
    wait_read(qtbot, w)
    qtbot.waitUntil(lambda: CLAUSE in w.drafting_pane.editor.toPlainText(), timeout=WAIT_MS)
    assert w.drafting_pane.title.text() == "lease"
    w.close()


def test_export_chat_and_document_as_word(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import docx

    w = local_window(qtbot, tiny, tmp_path / "data")
    send(qtbot, w, "hello")
    wait_idle(qtbot, w)
    out = tmp_path / "out"
    out.mkdir()
    asked: list[str] = []

    def fake_save(_p: Any, _t: str, start: str, filters: str) -> tuple[str, str]:
        asked.append(filters)
        return str(out / "my chat"), "Word document (*.docx)"

    monkeypatch.setattr(QFileDialog, "getSaveFileName", fake_save)
    monkeypatch.setattr(export, "open_folder", lambda p: True)
    qtbot.mouseClick(w.chat_view.export_button, Qt.MouseButton.LeftButton)
    assert "Word document (*.docx)" in asked[0]
    back = docx.Document(str(out / "my chat.docx"))
    assert back.paragraphs[0].text == "hello" and back.paragraphs[0].style.name == "Heading 1"
    assert "Saved “my chat.docx”" in w.chat_view.error.text()
    # a document with a list and bold text
    w.show_pane("drafting")
    w.app.drafting.new_document("Plan", "Steps:\n\n- **first** step\n- second step")
    qtbot.mouseClick(w.drafting_pane.export_button, Qt.MouseButton.LeftButton)
    back = docx.Document(str(out / "my chat.docx"))
    got = [(p.style.name, p.text) for p in back.paragraphs]
    assert got == [
        ("Heading 1", "Plan"),
        ("Normal", "Steps:"),
        ("List Bullet", "first step"),
        ("List Bullet", "second step"),
    ]
    assert back.paragraphs[2].runs[0].bold
    w.close()


def test_matter_from_the_sidebar_answers_with_its_files(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = local_window(qtbot, tiny, tmp_path / "data", max_tokens=4)
    folder = tmp_path / "Smith v Jones"
    files(folder)
    (folder / "notes.txt").write_text("Call the landlord on Monday.")
    w.sidebar.set_pane("matters")
    assert w.stack.currentWidget() is w.matters_pane
    assert w.sidebar.new_button.text() == "New matter"
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("Smith v Jones", True))
    qtbot.mouseClick(w.sidebar.new_button, Qt.MouseButton.LeftButton)
    pane = w.matters_pane
    assert pane.title.text() == "Smith v Jones" and w.sidebar.matter_list.count() == 1
    monkeypatch.setattr("app.views.matters_pane.ask_folder", lambda *a: folder)
    qtbot.mouseClick(pane.add_folder_button, Qt.MouseButton.LeftButton)
    wait_read(qtbot, w)
    assert pane.files.topLevelItemCount() == 3
    assert pane.summary.text().startswith("3 files, 5 pages")
    assert pane.status.text().startswith("Files: 3 read")
    qtbot.mouseClick(pane.ask_button, Qt.MouseButton.LeftButton)
    assert w.stack.currentWidget() is w.chat_view
    assert w.chat_view.attachments.chips[0].text() == "Matter: Smith v Jones · 3 files"
    send(qtbot, w, "How much is the security deposit?")
    wait_idle(qtbot, w)
    sb = sources_bar(w)
    assert sb is not None and sb.texts()[0] == "[1] lease.pdf, p. 3"
    w.close()


def test_copy_as_word_friendly_text(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    w = local_window(qtbot, tiny, tmp_path / "data")
    copy_word_friendly("## Plan\n\n- **one**\n- two")
    cb = QGuiApplication.clipboard()
    assert cb.text() == "Plan\n\n• one\n• two\n"
    assert "<strong>one</strong>" in cb.mimeData().html()
    cb.clear()
    send(qtbot, w, "hello")
    wait_idle(qtbot, w)
    reply = w.chat_view.widgets[max(w.chat_view.widgets)]
    assert reply.contextMenuPolicy() == Qt.ContextMenuPolicy.CustomContextMenu
    w.close()


def test_api_switch_in_settings(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    import socket

    from app.views.settings_dialog import SettingsDialog

    w = local_window(qtbot, tiny, tmp_path / "data")
    dlg = SettingsDialog(w.app.settings, w)
    tab = dlg.api_tab
    assert tab is not None and not tab.enabled.isChecked() and not tab.token.isEnabled()
    assert tab.token.text().startswith("veil-")  # shown, so it can be copied
    tab.enabled.setChecked(True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tab.port.setValue(port)
    assert tab.address.text() == f"http://127.0.0.1:{port}/v1"
    qtbot.mouseClick(tab.copy_button, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == tab.token.text()
    dlg._save()
    assert dlg.result_settings is not None
    w.apply_settings(dlg.result_settings)
    dlg.deleteLater()
    assert w.app.api.running and f"API on http://127.0.0.1:{port}/v1" in w.status.text()
    s = w.app.settings
    s.api_enabled = False
    w.apply_settings(s)
    assert not w.app.api.running
    w.close()
