"""The document-drafting pane: an editor, writing actions, and a suggestion to accept or reject.

The editor is read-only while a suggestion is pending, so the span it replaces cannot move.
Accepting is one undoable edit (Ctrl+Z brings the old text back).
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QKeyEvent, QTextCursor
from PySide6.QtWidgets import (
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.core import problems
from app.core.documents.controller import DocumentsController
from app.core.drafting import (
    ACTIONS,
    DEFAULT_TITLE,
    DraftingController,
    Suggestion,
    suggestion_insert_text,
)
from app.core.storage import Document
from app.views import export
from app.views.demo_notice import DemoNotice
from app.views.error_banner import ErrorBanner
from app.views.flow_row import FlowRow
from app.views.theme import set_icon
from engine.errors import VeilError

BUTTONS = ("outline", "formal", "grammar", "summarize", "continue")
READ_ONLY_NOTE = "The suggestion cannot be changed here: Accept it, then edit it in your document."
LOCKED_NOTE = "Your document is locked while a suggestion waits: Accept or Reject it first."


def utf16_len(s: str) -> int:
    return len(s.encode("utf-16-le")) // 2


def py_index(text: str, qpos: int) -> int:
    """Qt cursor position (UTF-16 units) -> Python string index."""
    units = 0
    for i, ch in enumerate(text):
        if units >= qpos:
            return i
        units += 2 if ord(ch) > 0xFFFF else 1
    return len(text)


def q_pos(text: str, index: int) -> int:
    """Python string index -> Qt cursor position."""
    return utf16_len(text[:index])


def is_typing(e: QKeyEvent) -> bool:
    """A key that would type a character (not a shortcut, an arrow or a modifier)."""
    mods = e.modifiers() & ~Qt.KeyboardModifier.ShiftModifier
    return bool(e.text().strip()) and mods == Qt.KeyboardModifier.NoModifier


class DocEditor(QPlainTextEdit):
    """The document text. Tab moves to the next control like everywhere in the window;
    Ctrl+Tab types a tab character for the rare document that needs one. While a suggestion
    waits the text is locked, and typing says so (``typed_locked``)."""

    typed_locked = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTabChangesFocus(True)

    def keyPressEvent(self, e: QKeyEvent) -> None:
        if e.key() == Qt.Key.Key_Tab and e.modifiers() & Qt.KeyboardModifier.ControlModifier:
            if not self.isReadOnly():
                self.insertPlainText("\t")
            return
        if self.isReadOnly() and is_typing(e):
            self.typed_locked.emit()
        super().keyPressEvent(e)


class SuggestionText(QPlainTextEdit):
    """The suggestion: read-only, reached by a click (Tab skips it, so text typed after Tab
    never lands here). Typing into it says where the text can be changed."""

    typed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setReadOnly(True)
        self.setTabChangesFocus(True)
        self.setFocusPolicy(Qt.FocusPolicy.ClickFocus)

    def keyPressEvent(self, e: QKeyEvent) -> None:
        if is_typing(e):
            self.typed.emit()  # the text cannot go here: say so
        super().keyPressEvent(e)


class DraftingPane(QWidget):
    def __init__(
        self,
        drafting: DraftingController,
        parent: QWidget | None = None,
        documents: DocumentsController | None = None,
    ) -> None:
        super().__init__(parent)
        self.d = drafting
        self.documents = documents
        outer = QVBoxLayout(self)
        outer.setContentsMargins(24, 14, 24, 16)
        outer.setSpacing(10)

        bar = QHBoxLayout()
        self.title = QLineEdit()
        self.title.setObjectName("PaneTitle")
        self.title.setAccessibleName("Document name")
        self.title.setPlaceholderText(DEFAULT_TITLE)
        self.title.setToolTip("The document's name (shown in the list on the left)")
        self.title.editingFinished.connect(self._rename)
        self.title.returnPressed.connect(lambda: self.editor.setFocus())  # Enter: to the body
        bar.addWidget(self.title, 1)
        if documents is not None:
            self.open_button = QPushButton("Open file…")
            set_icon(self.open_button, "document")
            self.open_button.setAccessibleName("Open a file as a new document")
            self.open_button.setToolTip(
                "Open a PDF, Word or text file as a new document (read on this computer; you "
                "can also drop a file on the text)"
            )
            self.open_button.clicked.connect(lambda: self.open_file(None))
            bar.addWidget(self.open_button)
        self.export_button = QPushButton("Export")
        set_icon(self.export_button, "export")
        self.export_button.setAccessibleName("Export this document")
        self.export_button.setToolTip("Save as formatted text (.md) or plain text (.txt)")
        self.export_button.clicked.connect(self.export)
        bar.addWidget(self.export_button)
        outer.addLayout(bar)
        self.demo = DemoNotice()
        outer.addWidget(self.demo)

        actions = QGridLayout()
        actions.setHorizontalSpacing(8)
        actions.setVerticalSpacing(8)
        self.action_buttons: dict[str, QPushButton] = {}
        for key in BUTTONS:
            a = ACTIONS[key]
            b = QPushButton(a.short or a.label)
            set_icon(b, "sparkle", "accent")
            b.setAccessibleName(a.label)
            b.setToolTip(f"{a.label}: {a.instruction}")
            b.clicked.connect(lambda _=False, k=key: self.run_action(k))
            self.action_buttons[key] = b
        # as many on a line as fit: a narrow window wraps them instead of getting wider
        actions.addWidget(FlowRow(list(self.action_buttons.values())), 0, 0, 2, 2)
        self.instruction = QLineEdit()
        self.instruction.setAccessibleName("Your own instruction")
        self.instruction.setPlaceholderText(
            "Or type your own instruction, e.g. “make this shorter and friendlier”"
        )
        self.instruction.returnPressed.connect(lambda: self.run_action("custom"))
        actions.addWidget(self.instruction, 2, 0)
        self.apply_button = QPushButton("Apply")
        set_icon(self.apply_button, "sparkle", "accent_text")
        self.apply_button.setObjectName("PrimaryButton")
        self.apply_button.setAccessibleName("Apply my instruction")
        self.apply_button.clicked.connect(lambda: self.run_action("custom"))
        actions.addWidget(self.apply_button, 2, 1)
        outer.addLayout(actions)
        hint = QLabel(
            "Select part of the text first, or nothing to use the whole document. "
            "Nothing changes until you accept the suggestion."
        )
        hint.setObjectName("Small")
        hint.setWordWrap(True)
        outer.addWidget(hint)

        self.error = ErrorBanner()
        outer.addWidget(self.error)

        split = QSplitter(Qt.Orientation.Horizontal)
        split.setChildrenCollapsible(False)
        split.setHandleWidth(10)
        self.editor = DocEditor()
        self.editor.setObjectName("DocEditor")
        self.editor.setAccessibleName("Document text")
        self.editor.setPlaceholderText(
            "Write or paste your text here.\n\nTip: write a short outline, then choose "
            "“Draft from this outline”."
        )
        self.editor.textChanged.connect(self._changed)
        split.addWidget(self.editor)
        if documents is not None:
            from app.views.attach import FileDrop

            # the editor's viewport gets the drops; a file opens, dropped text is typed as usual
            self.file_drop = FileDrop(self.editor.viewport())
            self.file_drop.dropped.connect(lambda ps: self.open_file(ps[0]))

        self.panel = QFrame()
        self.panel.setObjectName("Suggestion")
        pl = QVBoxLayout(self.panel)
        pl.setContentsMargins(14, 12, 14, 12)
        pl.setSpacing(8)
        self.s_title = QLabel("Suggestion")
        self.s_title.setObjectName("CardTitle")
        self.s_title.setWordWrap(True)  # a long title must not push the editor narrower
        pl.addWidget(self.s_title)
        self.s_text = SuggestionText()
        self.s_text.setAccessibleName("Suggested text (read-only)")
        self.s_text.setPlaceholderText(
            "Choose an action above. The suggestion appears here, word by word."
        )
        pl.addWidget(self.s_text, 1)
        self.read_only_note = QLabel(READ_ONLY_NOTE)
        self.read_only_note.setObjectName("FieldNote")
        self.read_only_note.setWordWrap(True)
        self.read_only_note.hide()
        self.s_text.typed.connect(lambda: self._say(READ_ONLY_NOTE))
        self.editor.typed_locked.connect(lambda: self._say(LOCKED_NOTE))
        pl.addWidget(self.read_only_note)
        row = QHBoxLayout()
        self.accept_button = QPushButton("Accept")
        set_icon(self.accept_button, "check", "accent_text")
        self.accept_button.setObjectName("PrimaryButton")
        self.accept_button.setAccessibleName("Accept the suggestion")
        self.accept_button.clicked.connect(self.accept)
        self.reject_button = QPushButton("Reject")
        set_icon(self.reject_button, "close")
        self.reject_button.setAccessibleName("Reject the suggestion")
        self.reject_button.clicked.connect(self.reject)
        self.stop_button = QPushButton("Stop")
        set_icon(self.stop_button, "stop")
        self.stop_button.setAccessibleName("Stop writing the suggestion")
        self.stop_button.clicked.connect(self.d.stop)
        row.addWidget(self.accept_button)
        row.addWidget(self.reject_button)
        row.addStretch(1)
        row.addWidget(self.stop_button)
        pl.addLayout(row)
        split.addWidget(self.panel)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        outer.addWidget(split, 1)

        self._save_timer = QTimer(self, singleShot=True, interval=600)
        self._save_timer.timeout.connect(self.save_now)
        self._loading = False
        drafting.document_opened.connect(self.load)
        drafting.suggestion_started.connect(self._started)
        drafting.suggestion_updated.connect(self._updated)
        drafting.suggestion_finished.connect(self._finished)
        drafting.suggestion_cleared.connect(self._cleared)
        drafting.failed.connect(self._failed)
        drafting.busy_changed.connect(self._sync_buttons)
        self.load(None)

    # --- documents ---------------------------------------------------------------------------

    def load(self, doc: Document | None) -> None:
        self._loading = True
        has = doc is not None
        # the default name is only a placeholder, so typing a name replaces it
        self.title.setText(doc.title if doc and doc.title != DEFAULT_TITLE else "")
        self.editor.setPlainText(doc.body if doc else "")
        self.editor.document().clearUndoRedoStacks()
        self.title.setEnabled(has)
        self.editor.setEnabled(True)
        self.export_button.setEnabled(has)
        self._loading = False
        self.error.hide()
        self._sync_buttons()

    def _ensure_document(self) -> None:
        """Typing into the empty pane creates a document (keeping the text and the cursor)."""
        if self.d.current is None:
            body = self.editor.toPlainText()
            pos = self.editor.textCursor().position()
            self.d.new_document(body=body)  # load() shows the same text
            c = self.editor.textCursor()
            c.setPosition(min(pos, len(self.editor.toPlainText())))
            self.editor.setTextCursor(c)

    def _changed(self) -> None:
        if self._loading:
            return
        if self.d.current is None and self.editor.toPlainText().strip():
            self._ensure_document()
        self._save_timer.start()

    def save_now(self) -> None:
        self._save_timer.stop()
        if self.d.current is not None:
            self.d.save(self.editor.toPlainText())

    def _rename(self) -> None:
        if self.d.current is None:
            return
        doc = self.d.store.document(self.d.current)
        new = self.title.text().strip() or DEFAULT_TITLE
        if doc is not None and doc.title != new:
            self.d.rename(self.d.current, new)

    def export(self) -> None:
        if self.d.current is None:
            return
        self.save_now()
        path = export.ask_save_path(
            self,
            "Export document",
            self.d.store,
            self.title.text().strip() or DEFAULT_TITLE,
            [export.MARKDOWN, export.WORD, export.PLAIN],
        )
        if path is None:
            return
        try:
            if path.suffix.lower() == ".docx":
                from app.core.documents.word import document_docx

                doc = self.d.store.document(self.d.current)
                if doc is None:
                    raise VeilError("that document no longer exists")
                document_docx(doc.title, doc.body, path)
            else:
                self.d.export(self.d.current, path)
        except VeilError as exc:
            self.error.show_error(exc, cause=problems.EXPORT)
            return
        export.confirm_saved(self.error, path)

    def open_file(self, path: Path | None) -> None:
        """Read a PDF, Word or text file into a new document (asks for it when None)."""
        if self.documents is None:
            return
        if path is None:
            from app.views.attach import ask_files

            paths = ask_files(self, "Open a file as a new document", self.d.store)
            if not paths:
                return
            path = paths[0]
        self.save_now()
        self.error.hide()
        self.documents.open_file(
            path, lambda doc: self.d.new_document(doc.path.stem or DEFAULT_TITLE, doc.text())
        )

    def _failed(self, err: VeilError) -> None:
        state = self.d.host.state
        self.error.show_error(problems.explain(err, state), cause=problems.cause_of(err, state))

    # --- suggestions ---------------------------------------------------------------------------

    def selection(self) -> tuple[int, int, int]:
        """(start, end, cursor) as Python indexes into the editor's text."""
        c = self.editor.textCursor()
        text = self.editor.toPlainText()
        return (
            py_index(text, c.selectionStart()),
            py_index(text, c.selectionEnd()),
            py_index(text, c.position()),
        )

    def run_action(self, key: str) -> None:
        if self.d.busy:
            return
        self.error.hide()
        self.save_now()
        start, end, cursor = self.selection()
        try:
            s = self.d.request(
                key, self.editor.toPlainText(), start, end, cursor, self.instruction.text()
            )
        except VeilError as exc:
            self.error.show_error(exc)
            return
        if s is not None and key == "custom":
            self.instruction.clear()

    def _started(self, s: Suggestion) -> None:
        self.editor.setReadOnly(True)
        self.s_title.setText(f"Suggestion: {ACTIONS[s.action].label}")
        self.s_text.setPlainText("")
        self._highlight(s)
        self._sync_buttons()

    def _updated(self, s: Suggestion) -> None:
        self.s_text.setPlainText(s.text)
        self.s_text.moveCursor(QTextCursor.MoveOperation.End)

    def _finished(self, s: Suggestion) -> None:
        self.s_text.setPlainText(s.text)
        if s.error:
            self.s_title.setText("Suggestion (failed)")
        elif s.finish_reason == "cancelled":
            self.s_title.setText(self.s_title.text() + " (stopped)")
        elif s.finish_reason == "length":
            self.s_title.setText(self.s_title.text() + " (hit the length limit)")
        self._sync_buttons()

    def _say(self, note: str) -> None:
        """Typing went where it cannot: say why, beside the Accept and Reject buttons."""
        self.read_only_note.setText(note)
        self.read_only_note.show()

    def _cleared(self) -> None:
        self.read_only_note.hide()
        self.editor.setReadOnly(False)
        self.s_title.setText("Suggestion")
        self.s_text.setPlainText("")
        self._sync_buttons()

    def _highlight(self, s: Suggestion) -> None:
        text = self.editor.toPlainText()
        c = self.editor.textCursor()
        c.setPosition(q_pos(text, s.start))
        c.setPosition(q_pos(text, s.end), QTextCursor.MoveMode.KeepAnchor)
        self.editor.setTextCursor(c)

    def accept(self) -> None:
        s = self.d.suggestion
        if s is None:
            return
        text = self.editor.toPlainText()
        try:
            expected = self.d.accept(text)  # validates, and what the editor must now hold
        except VeilError as exc:
            self.error.show_error(exc)
            return
        insert = suggestion_insert_text(s, text)
        c = QTextCursor(self.editor.document())
        c.beginEditBlock()
        c.setPosition(q_pos(text, s.start))
        c.setPosition(q_pos(text, s.end), QTextCursor.MoveMode.KeepAnchor)
        c.insertText(insert)
        c.endEditBlock()
        self.editor.setTextCursor(c)
        assert self.editor.toPlainText() == expected
        self.save_now()
        self.editor.setFocus()  # so Ctrl+Z undoes the change at once

    def reject(self) -> None:
        self.d.reject()
        self.editor.setFocus()

    def _sync_buttons(self, *_: object) -> None:
        s = self.d.suggestion
        busy = self.d.busy
        for b in self.action_buttons.values():
            b.setEnabled(not busy and s is None)
        self.apply_button.setEnabled(not busy and s is None)
        self.instruction.setEnabled(not busy and s is None)
        ready = s is not None and s.done and not s.error and bool(s.text.strip())
        self.accept_button.setEnabled(ready and not busy)
        self.reject_button.setEnabled(s is not None)
        self.stop_button.setVisible(busy)
        if s is None:
            self.editor.setReadOnly(False)
