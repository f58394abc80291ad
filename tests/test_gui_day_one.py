"""Issue 30 (the app on day one, second pass), pytest-qt, offscreen, tiny model: typing goes
where it should (real key events), messages are never under the side panel or clipped, long
messages say their size, are cut only when the user agrees, show reading progress and are
shown collapsed, Regenerate writes a different reply, and the demo model says what it is."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QEvent, QPoint, QRect, Qt
from PySide6.QtWidgets import QApplication, QLabel, QWidget

from app.core.demo_model import DEMO_LINE
from app.core.long_message import LengthCheck
from app.main_window import MainWindow
from app.views.chat_view import CUT
from app.views.drafting_pane import LOCKED_NOTE, READ_ONLY_NOTE
from engine.loading import DEFAULT_MODEL
from tests.gui_support import local_window, theme_reset
from tests.test_gui_app import WAIT_MS, send, tiny, wait_idle  # noqa: F401
from tests.test_gui_first_day import _clipped

pytestmark = pytest.mark.gui

WORDS = "the witness said that the contract was signed on a rainy day in March".split()  # noqa: SIM905
REPLY = (
    "A retainer agreement is a contract between a client and a law firm that sets out the "
    "scope of the services, the fees and how they are billed. The description of services "
    "should say exactly which matters are covered.\n\n- Scope of work\n- Fees and billing\n"
    "- Termination\n\n```python\ndef add(a, b):\n    return a + b\n```"
)
QUESTION = (
    "What is a retainer agreement and what should the description of services include for a "
    "small law firm that bills by the hour?"
)


def words(n: int) -> str:
    return " ".join(f"{WORDS[i % len(WORDS)]}{i}" for i in range(n))


def settle() -> None:
    for _ in range(3):
        QApplication.sendPostedEvents(None, QEvent.Type.LayoutRequest)
        QApplication.processEvents()


def typed(qtbot: Any, text: str) -> QWidget:
    """Type ``text`` with real key events into whatever has the keyboard focus."""
    target = QApplication.focusWidget()
    assert target is not None, "nothing has the keyboard focus"
    qtbot.keyClicks(target, text)
    return target


# --- focus ---------------------------------------------------------------------------------


def test_new_chat_puts_the_focus_in_the_message_box(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    w = local_window(qtbot, tiny, tmp_path)
    store, chat, box = w.app.store, w.app.chat, w.chat_view.composer
    qtbot.mouseClick(w.sidebar.new_button, Qt.MouseButton.LeftButton)
    assert typed(qtbot, "Please draft a short letter") is box
    assert box.toPlainText() == "Please draft a short letter"
    assert len(store.conversations()) == 1  # the spaces did not press "New chat" again
    # pressing it again on the empty chat does not pile up another one (the typed text counts)
    box.clear()
    qtbot.mouseClick(w.sidebar.new_button, Qt.MouseButton.LeftButton)
    qtbot.mouseClick(w.sidebar.new_button, Qt.MouseButton.LeftButton)
    assert len(store.conversations()) == 1 and QApplication.focusWidget() is box
    typed(qtbot, "hello")
    send(qtbot, w, "hello")
    wait_idle(qtbot, w)
    first = chat.current
    qtbot.keyClick(w, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert chat.current != first and QApplication.focusWidget() is box
    assert typed(qtbot, "second chat") is box
    # leaving a chat with unsent text keeps it (and the text); leaving an empty one removes it
    second = chat.current
    chat.open(first)
    assert len(store.conversations()) == 2
    qtbot.keyClick(w, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    chat.open(second)
    assert len(store.conversations()) == 2 and box.toPlainText() == "second chat"
    w.close()


def test_documents_focus_title_then_body_and_no_silent_read_only_box(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
):
    w = local_window(qtbot, tiny, tmp_path)
    w.show_pane("drafting")
    pane, d = w.drafting_pane, w.app.drafting
    qtbot.mouseClick(w.sidebar.new_button, Qt.MouseButton.LeftButton)
    assert typed(qtbot, "Budget memo") is pane.title
    qtbot.keyClick(pane.title, Qt.Key.Key_Return)
    assert typed(qtbot, "Dear team, the budget is final.") is pane.editor
    assert pane.editor.toPlainText() == "Dear team, the budget is final."
    doc = w.app.store.document(d.current or -1)
    assert doc is not None and doc.title == "Budget memo"
    # Ctrl+N in Documents: a new document, the cursor in its title
    qtbot.keyClick(w, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert d.current != doc.id
    assert typed(qtbot, "Second") is pane.title and pane.editor.toPlainText() == ""
    # Tab from the body skips the read-only suggestion box
    qtbot.keyClick(pane.title, Qt.Key.Key_Return)
    typed(qtbot, "Some text")
    qtbot.keyClick(pane.editor, Qt.Key.Key_Tab)
    assert QApplication.focusWidget() is not pane.s_text
    # clicked into and typed at, it says so instead of swallowing the keys
    assert pane.read_only_note.isHidden()
    qtbot.mouseClick(pane.s_text.viewport(), Qt.MouseButton.LeftButton)
    assert typed(qtbot, "x") is pane.s_text
    assert not pane.read_only_note.isHidden() and pane.read_only_note.text() == READ_ONLY_NOTE
    # the document is locked while a suggestion waits: typing there says so too
    qtbot.mouseClick(pane.action_buttons["formal"], Qt.MouseButton.LeftButton)
    wait_idle(qtbot, w)
    pane.editor.setFocus()
    qtbot.keyClicks(pane.editor, "y")
    assert pane.editor.toPlainText() == "Some text" and pane.read_only_note.text() == LOCKED_NOTE
    qtbot.mouseClick(pane.reject_button, Qt.MouseButton.LeftButton)
    assert pane.read_only_note.isHidden()
    w.close()


# --- window sizes --------------------------------------------------------------------------


def _inside(rect: QRect, room: QRect) -> bool:
    return rect.left() >= room.left() and rect.right() <= room.right()


def layout_problems(w: MainWindow) -> list[str]:
    """What a user would see cut off: the conversation under the side panel, a message wider
    than the visible conversation, text that needs more width than it has, a hidden Copy."""
    bad: list[str] = []
    stack = w.stack.geometry()
    for other in (w.side_scroll, w.rail):
        if other.isVisible() and other.geometry().left() < stack.right() + 1:
            bad.append(f"{type(other).__name__} starts at {other.geometry().left()} inside {stack}")
    if w.sidebar.isVisible() and w.sidebar.geometry().right() >= stack.left():
        bad.append("the chat list overlaps the conversation")
    view = w.chat_view
    port = view.scroll_area.viewport()
    room = QRect(0, 0, port.width(), port.height())
    for msg_id, bubble in view.widgets.items():
        at = QRect(bubble.mapTo(port, QPoint(0, 0)), bubble.size())
        if not _inside(at, room):
            bad.append(f"message {msg_id} spans x {at.left()}..{at.right()} of {room.width()}")
        for label in bubble.findChildren(QLabel):
            if not label.isVisibleTo(bubble) or not label.text():
                continue
            if label.wordWrap():
                need = label.minimumSizeHint().width()
                if need > label.width() or label.heightForWidth(label.width()) > label.height() + 1:
                    bad.append(f"message {msg_id}: {label.text()[:30]!r} cut in {label.size()}")
            elif label.sizeHint().width() > label.width() + 1:
                bad.append(f"message {msg_id}: {label.text()[:30]!r} cut in {label.size()}")
            if not _inside(QRect(label.mapTo(port, QPoint(0, 0)), label.size()), room):
                bad.append(f"message {msg_id}: {label.text()[:30]!r} sticks out")
        if bubble.role == "assistant":
            copy = bubble.copy_button
            spot = QRect(copy.mapTo(port, QPoint(0, 0)), copy.size())
            if not copy.isVisibleTo(w) or not _inside(spot, room):
                bad.append(f"message {msg_id}: Copy not visible (x {spot.left()}..{spot.right()})")
            elif copy.sizeHint().width() > copy.width() + 1:
                bad.append(f"message {msg_id}: Copy squeezed to {copy.width()}")
    return bad


SIZES = [(1000, 640), (1150, 720), (1280, 800), (1600, 1000)]


@pytest.mark.parametrize("pt", [8, 10, 13, 20])
def test_no_message_is_under_the_side_panel_or_cut(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    pt: int,
):
    w = local_window(qtbot, tiny, tmp_path)
    store = w.app.store
    conv = store.create_conversation("Retainer")
    for role, text in (("user", QUESTION), ("assistant", REPLY), ("user", "Thanks!")):
        store.add_message(conv, role, text)
    store.add_message(conv, "assistant", REPLY.split("\n\n")[0])
    w.app.chat.open(conv)
    s = w.app.settings
    w.apply_settings(type(s)(**{**vars(s), "font_size": pt}))
    for size in SIZES:
        w.resize(*size)
        settle()
        assert w.size().width() == size[0]
        assert layout_problems(w) == [], (pt, size)
        shown = w.side_scroll.isVisible()
        # the rail shows the panel (the chat list gives way where all three do not fit)
        qtbot.mouseClick(w.rail.button, Qt.MouseButton.LeftButton)
        settle()
        assert w.side_scroll.isVisible() != shown
        assert layout_problems(w) == [], (pt, size, "toggled")
        qtbot.mouseClick(w.rail.button, Qt.MouseButton.LeftButton)
        w.panels.wanted = None
    # at the minimum size with 10 pt the panel folds away; at 1280x800 it is there
    if pt == 10:
        w.resize(1000, 640)
        settle()
        assert not w.side_scroll.isVisible() and w.sidebar.isVisible()
        w.resize(1280, 800)
        settle()
        assert w.side_scroll.isVisible() and w.sidebar.isVisible()
    w.close()
    theme_reset()


# --- long messages -------------------------------------------------------------------------


def test_long_message_size_cut_progress_and_show_all(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    w = local_window(qtbot, tiny, tmp_path, max_tokens=4)
    view, chat = w.chat_view, w.app.chat
    send(qtbot, w, "hi")  # the model is loaded: its tokenizer measures
    wait_idle(qtbot, w)
    note = view.length_note
    view.composer.setPlainText("A short question about the contract")
    qtbot.waitUntil(lambda: not view._length_timer.isActive(), timeout=WAIT_MS)
    assert note.isHidden() and note.text() == ""
    view.composer.setPlainText(words(60))
    qtbot.waitUntil(lambda: not note.isHidden(), timeout=WAIT_MS)
    assert (
        note.text().startswith("Long message: about ") and "this model reads at once" in note.text()
    )

    # progress while it is read: several steps reach the reply and the status bar
    chat.read_chunk = 32
    seen: list[tuple[str, str]] = []

    def look(*_: Any) -> None:
        bubble = view.widgets[max(view.widgets)]
        seen.append((bubble.plain_text(), w.status.text()))

    chat.reading.connect(look)
    qtbot.mouseClick(view.send_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, w)
    steps = {b for b, s in seen if b.startswith("Reading your message… ") and s == b}
    assert len(steps) >= 4, seen
    assert seen[0][0] == "Reading your message… 0%" and "100%" in seen[-1][0]
    assert chat.messages()[-1].role == "assistant" and chat.messages()[-1].content
    assert not view.widgets[max(view.widgets)].plain_text().startswith("Reading")

    # too long: the user sees exactly what is cut, and the rest stays in the message box
    asked: list[str] = []

    def agree(check: LengthCheck, text: str) -> str:
        from app.core.long_message import cut_question

        asked.append(cut_question(check, text))
        return CUT

    view.ask_cut = agree  # type: ignore[method-assign]
    text = words(400)
    view.composer.setPlainText(text)
    qtbot.waitUntil(lambda: note.text().startswith("Too long for this model"), timeout=WAIT_MS)
    qtbot.mouseClick(view.send_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, w)
    sent = chat.messages()[-2].content
    rest = view.composer.toPlainText()
    assert asked and f"{sent} {rest}" == text and sent and rest
    assert f"leave out the last {len(rest.split()):,} words" in asked[0]
    # saying no sends nothing and keeps the text
    view.ask_cut = lambda check, text: ""  # type: ignore[method-assign]
    n = len(chat.messages())
    view.composer.setPlainText(text)
    qtbot.mouseClick(view.send_button, Qt.MouseButton.LeftButton)
    assert len(chat.messages()) == n and view.composer.toPlainText() == text
    assert view.composer.hasFocus()

    # a long message (pasted into a model that reads more) is shown collapsed, with "Show all"
    conv = w.app.store.create_conversation("Transcript")
    long = words(400)
    msg = w.app.store.add_message(conv, "user", long)
    chat.open(conv)
    bubble = view.widgets[msg.id]
    assert not bubble.more_button.isHidden()
    assert bubble.more_button.text() == "Show all (400 words)"
    assert len(bubble.plain_text()) < len(long) // 4 and long.startswith(bubble.plain_text()[:-2])
    qtbot.mouseClick(bubble.more_button, Qt.MouseButton.LeftButton)
    assert bubble.plain_text() == long and bubble.more_button.text() == "Show less"
    qtbot.mouseClick(bubble.more_button, Qt.MouseButton.LeftButton)
    assert bubble.more_button.text() == "Show all (400 words)"
    w.close()


# --- Regenerate and the demo model ---------------------------------------------------------


def test_regenerate_twice_gives_two_different_replies(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    from app.views.settings_dialog import SettingsDialog

    w = local_window(qtbot, tiny, tmp_path, max_tokens=12)
    chat = w.app.chat
    seeds = iter([3, 4])
    chat.new_seed = lambda: next(seeds)
    send(qtbot, w, "Write a polite reminder about Friday's meeting")
    wait_idle(qtbot, w)
    replies = [chat.messages()[-1].content]
    for _ in range(2):
        qtbot.mouseClick(w.chat_view.regen_button, Qt.MouseButton.LeftButton)
        wait_idle(qtbot, w)
        replies.append(chat.messages()[-1].content)
    assert len(chat.messages()) == 2 and len(set(replies)) == 3, replies
    dlg = SettingsDialog(w.app.settings, w)
    qtbot.addWidget(dlg)
    assert "Regenerate always writes a different" in dlg.regenerate_note.text()
    w.close()


def test_the_demo_model_says_what_it_is(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    from app.views.first_run_dialog import FirstRunDialog

    w = local_window(qtbot, tiny, tmp_path)
    notices = (w.chat_view.demo, w.drafting_pane.demo)
    assert all(n.isHidden() for n in notices)  # another model: nothing
    w.app.settings.model = DEFAULT_MODEL
    w._sync_demo()
    for pane in ("chat", "drafting"):
        w.show_pane(pane)
        settle()
        shown = [n for n in notices if n.isVisible()]
        assert len(shown) == 1 and shown[0].text.text() == DEMO_LINE
        assert "not for real work" in DEMO_LINE and "invite code" in DEMO_LINE
    for pt in (10, 13):  # the first-start card shows it whole, with every line of its text
        s = w.app.settings
        w.apply_settings(type(s)(**{**vars(s), "font_size": pt}))
        first = FirstRunDialog(w, demo_model=True)
        qtbot.addWidget(first)
        first.show()
        settle()
        assert not first.demo_notice.isHidden() and _clipped(first) == [], pt
        first.close()
    assert FirstRunDialog(w, demo_model=False).demo_notice.isHidden()
    w.close()
    theme_reset()
