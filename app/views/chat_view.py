"""The chat pane: title bar with the assistant style, messages, errors and the composer."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, Signal
from PySide6.QtGui import QKeyEvent, QResizeEvent
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from app.core import problems
from app.core.chat import ChatController
from app.core.documents.controller import DocumentsController
from app.core.long_message import (
    LengthCheck,
    cut_question,
    reading_text,
    size_note,
    split_message,
)
from app.core.settings import PRESETS
from app.core.storage import Message, write_private_file
from app.core.summarise import parts_offer, progress_text
from app.views import export
from app.views.demo_notice import DemoNotice
from app.views.elided_label import ElidedLabel
from app.views.error_banner import ErrorBanner
from app.views.message_widget import MessageWidget
from app.views.theme import set_icon
from engine.errors import VeilError

CUT, IN_PARTS = "cut", "parts"  # the choices for a message too long for the model

EXAMPLES = (
    "Write a polite reminder about Friday's team meeting",
    "Explain what an invoice number is for",
    "Suggest three subject lines for a newsletter",
)


class Composer(QPlainTextEdit):
    """Message box: Ctrl+Enter sends (Enter alone makes a new line); Tab moves to the next
    control, as everywhere else in the window."""

    submit = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTabChangesFocus(True)

    def keyPressEvent(self, e: QKeyEvent) -> None:
        enter = e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and e.modifiers() & Qt.KeyboardModifier.ControlModifier:
            self.submit.emit()
            return
        super().keyPressEvent(e)


class ChatView(QWidget):
    settings_requested = Signal()

    def __init__(
        self,
        chat: ChatController,
        parent: QWidget | None = None,
        documents: DocumentsController | None = None,
    ) -> None:
        super().__init__(parent)
        self.chat = chat
        self.documents = documents
        self.widgets: dict[int, MessageWidget] = {}
        self.rows: dict[int, QWidget] = {}
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.setSpacing(0)

        # title bar
        bar = QHBoxLayout()
        bar.setContentsMargins(24, 14, 24, 10)
        bar.setSpacing(8)  # (a nested layout takes its parent's spacing, 0 here, by default)
        self.title = ElidedLabel("New chat")
        self.title.setObjectName("PaneTitle")
        bar.addWidget(self.title, 1)
        style_label = QLabel("Assistant style:")
        style_label.setObjectName("Muted")
        self.style_label = style_label
        bar.addWidget(style_label)
        self.preset = QComboBox()
        self.preset.setAccessibleName("Assistant style")
        self.preset.setToolTip("How the assistant answers in this chat")
        for name, prompt in PRESETS.items():
            self.preset.addItem(name, prompt)
        self.preset.addItem("Custom…", None)
        style_label.setBuddy(self.preset)
        self.preset.currentIndexChanged.connect(self._preset_changed)
        bar.addWidget(self.preset)
        self.export_button = QPushButton("Export")
        set_icon(self.export_button, "export")
        self.export_button.setAccessibleName("Export this chat")
        self.export_button.setToolTip("Save this chat as a file (formatted text or data)")
        self.export_button.clicked.connect(self.export)
        bar.addWidget(self.export_button)
        outer.addLayout(bar)
        self.system_edit = QPlainTextEdit()
        self.system_edit.setTabChangesFocus(True)
        self.system_edit.setAccessibleName("Your own assistant style")
        self.system_edit.setPlaceholderText(
            "Describe how the assistant should answer, e.g. “answer in German, briefly”…"
        )
        self.system_edit.setMaximumHeight(70)
        self.system_edit.hide()
        self.system_edit.textChanged.connect(
            lambda: self.chat.set_system_prompt(self.system_edit.toPlainText())
        )
        sys_row = QHBoxLayout()
        sys_row.setContentsMargins(24, 0, 24, 8)
        sys_row.addWidget(self.system_edit)
        outer.addLayout(sys_row)
        demo_row = QHBoxLayout()
        demo_row.setContentsMargins(24, 0, 24, 8)
        self.demo = DemoNotice()
        demo_row.addWidget(self.demo)
        outer.addLayout(demo_row)

        # messages
        self.scroll_area = QScrollArea()
        self.scroll_area.setObjectName("MessageArea")
        self.scroll_area.setWidgetResizable(True)
        self.scroll_area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.inner = QWidget()
        self.inner.setObjectName("MessageArea")
        # its height is the messages' height for the width they get (the scroll area asks):
        # not the taller minimum of word-wrapped text at its narrowest, which left a blank
        # stretch under the last message once scrolled to the end
        self.inner.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Ignored)
        self.list = QVBoxLayout(self.inner)
        self.list.setContentsMargins(24, 8, 24, 16)
        self.list.setSpacing(12)
        self.empty = self._empty_state()
        self.list.addWidget(self.empty)
        self.list.addStretch(1)
        self.scroll_area.setWidget(self.inner)
        self.scroll_area.viewport().installEventFilter(self)  # bubbles follow its width
        outer.addWidget(self.scroll_area, 1)
        self.scroll_area.verticalScrollBar().rangeChanged.connect(self._autoscroll)

        # errors + composer
        bottom = QVBoxLayout()
        bottom.setContentsMargins(24, 8, 24, 16)
        bottom.setSpacing(8)
        self.error = ErrorBanner()
        bottom.addWidget(self.error)
        if documents is not None:  # the chat's files, above the message box
            from app.views.attach import AttachmentsBar, FileDrop

            self.attachments = AttachmentsBar(documents)
            bottom.addWidget(self.attachments)
            self.file_drop = FileDrop(self)
            self.file_drop.dropped.connect(self.attach)
        row = QHBoxLayout()
        row.setSpacing(8)
        self.composer = Composer()
        self.composer.setObjectName("Composer")
        self.composer.setAccessibleName("Message")
        self.composer.setPlaceholderText("Write a message…   (Ctrl+Enter to send)")
        self.composer.setFixedHeight(84)
        self.composer.submit.connect(self.send_or_stop)
        self.composer.textChanged.connect(self._draft_changed)
        row.addWidget(self.composer, 1)
        buttons = QVBoxLayout()
        buttons.setSpacing(6)
        self.send_button = QPushButton("Send")
        set_icon(self.send_button, "send", "accent_text")
        self.send_button.setObjectName("PrimaryButton")
        self.send_button.setAccessibleName("Send message")
        self.send_button.setToolTip("Send (Ctrl+Enter). While a reply is written: Stop (Esc)")
        self.send_button.clicked.connect(self.send_or_stop)
        self.send_button.setMinimumWidth(120)
        buttons.addWidget(self.send_button)
        small = QHBoxLayout()
        small.setSpacing(6)
        self.regen_button = QPushButton()
        set_icon(self.regen_button, "regenerate")
        self.regen_button.setAccessibleName("Regenerate the last reply")
        self.regen_button.setToolTip("Write the last reply again")
        self.regen_button.clicked.connect(self.chat.regenerate)
        self.edit_button = QPushButton()
        set_icon(self.edit_button, "edit")
        self.edit_button.setAccessibleName("Edit the last message")
        self.edit_button.setToolTip("Edit your last message and send it again")
        self.edit_button.clicked.connect(self.edit_last)
        small.addWidget(self.regen_button)
        small.addWidget(self.edit_button)
        if documents is not None:
            self.attach_button = QPushButton()
            set_icon(self.attach_button, "attach")
            self.attach_button.setAccessibleName("Attach files")
            self.attach_button.setToolTip(
                "Attach PDF, Word or text files: answers then quote them (you can also drop "
                "files here). They are read on this computer."
            )
            self.attach_button.clicked.connect(lambda: self.attach(None))
            small.addWidget(self.attach_button)
        buttons.addLayout(small)
        row.addLayout(buttons)
        bottom.addLayout(row)
        self.length_note = QLabel()  # a long message's size against the model's reading
        self.length_note.setObjectName("Small")
        self.length_note.setWordWrap(True)
        self.length_note.hide()
        bottom.addWidget(self.length_note)
        self.editing = False
        outer.addLayout(bottom)

        self._draft_timer = QTimer(self, singleShot=True, interval=400)
        self._draft_timer.timeout.connect(self.save_draft_now)
        self._length_timer = QTimer(self, singleShot=True, interval=300)
        self._length_timer.timeout.connect(self.update_length_note)

        chat.conversation_opened.connect(self.load)
        chat.message_added.connect(self.add_message)
        chat.message_updated.connect(self.update_message)
        chat.message_removed.connect(self.remove_message)
        chat.busy_changed.connect(self.set_busy)
        chat.failed.connect(self.show_failure)
        chat.conversations_changed.connect(self._refresh_title)
        chat.before_switch.connect(self.save_draft_now)
        chat.reading.connect(self.show_reading)
        chat.summarising.connect(self.show_summarising)
        chat.restored.connect(self.put_back)
        self.set_busy(False)

    def resizeEvent(self, e: QResizeEvent) -> None:
        """With large text in a narrow window the chat's title keeps room: the words
        "Assistant style:" give way first (the box keeps its accessible name)."""
        super().resizeEvent(e)
        need = (
            220
            + self.style_label.sizeHint().width()
            + self.preset.sizeHint().width()
            + self.export_button.sizeHint().width()
        )
        self.style_label.setVisible(self.width() >= need)

    def eventFilter(self, obj: QObject, e: QEvent) -> bool:
        if obj is self.scroll_area.viewport() and e.type() == QEvent.Type.Resize:
            self._fit_widths()
        return super().eventFilter(obj, e)

    def _room(self) -> int:
        """The width a message may take: the visible conversation, less its margins."""
        m = self.list.contentsMargins()
        return self.scroll_area.viewport().width() - m.left() - m.right()

    def _fit_widths(self) -> None:
        room = self._room()
        for w in self.widgets.values():
            w.fit_width(room)

    # --- building ---------------------------------------------------------------------------

    def _empty_state(self) -> QWidget:
        w = QWidget()
        lay = QVBoxLayout(w)
        lay.setContentsMargins(40, 60, 40, 0)
        lay.setSpacing(10)
        head = QLabel("What can I help you with?")
        head.setObjectName("AppTitle")
        head.setAlignment(Qt.AlignmentFlag.AlignCenter)
        sub = QLabel("Use the slider on the right to choose how much of the model runs here.")
        sub.setObjectName("Muted")
        sub.setAlignment(Qt.AlignmentFlag.AlignCenter)
        lay.addWidget(head)
        lay.addWidget(sub)
        sub.setWordWrap(True)
        self.welcome = sub
        lay.addSpacing(8)
        for text in EXAMPLES:
            b = QPushButton(text)
            b.setObjectName("ChipButton")
            b.setAccessibleName(f"Example: {text}")
            b.clicked.connect(lambda _=False, t=text: self.composer.setPlainText(t))
            lay.addWidget(b, 0, Qt.AlignmentFlag.AlignHCenter)
        return w

    def load(self, conv_id: int | None) -> None:
        for row in self.rows.values():
            self.list.removeWidget(row)
            row.deleteLater()
        self.widgets.clear()
        self.rows.clear()
        self.error.hide()
        for m in self.chat.messages():
            self.add_message(m)
        self._refresh_title()
        self.composer.blockSignals(True)
        self.composer.setPlainText(self.chat.draft())
        self.composer.blockSignals(False)
        self.update_length_note()
        self._sync_preset()
        self._update_empty()
        if self.documents is not None:
            self.attachments.show_chat(conv_id)

    def attach(self, paths: list[Path] | None) -> None:
        """Attach files to this chat (asks for them when ``paths`` is None)."""
        if self.documents is None:
            return
        if paths is None:
            from app.views.attach import ask_files

            paths = ask_files(self, "Attach files to this chat", self.chat.store)
        if not paths:
            return
        try:
            self.documents.attach(paths, self.chat.current)
        except VeilError as exc:
            self.error.show_error(exc, cause=problems.DOCUMENTS)

    def _refresh_title(self) -> None:
        conv = self.chat.store.conversation(self.chat.current) if self.chat.current else None
        self.title.setText(conv.title if conv else "New chat")
        self.export_button.setEnabled(conv is not None)

    def _sync_preset(self) -> None:
        prompt = self.chat.system_prompt()
        idx = self.preset.findData(prompt)
        self.preset.blockSignals(True)
        self.preset.setCurrentIndex(idx if idx >= 0 else self.preset.count() - 1)
        self.preset.blockSignals(False)
        self.system_edit.blockSignals(True)
        self.system_edit.setPlainText(prompt)
        self.system_edit.blockSignals(False)
        self.system_edit.setVisible(idx < 0)

    def _preset_changed(self, idx: int) -> None:
        prompt = self.preset.itemData(idx)
        custom = prompt is None
        self.system_edit.setVisible(custom)
        if custom:
            self.system_edit.setFocus()
        else:
            self.chat.set_system_prompt(str(prompt))
            self.system_edit.blockSignals(True)
            self.system_edit.setPlainText(str(prompt))
            self.system_edit.blockSignals(False)

    def _update_empty(self) -> None:
        self.empty.setVisible(not self.widgets)

    # --- messages ----------------------------------------------------------------------------

    def add_message(self, msg: Message) -> None:
        if msg.conversation_id != self.chat.current or msg.id in self.widgets:
            return
        w = MessageWidget(msg)
        w.fit_width(self._room())
        row = QWidget()
        rl = QHBoxLayout(row)
        rl.setContentsMargins(0, 0, 0, 0)
        if msg.role == "user":
            rl.addStretch(1)
            rl.addWidget(w, 0)
        else:
            rl.addWidget(w, 1)
        self.list.insertWidget(self.list.count() - 1, row)
        self.rows[msg.id] = row
        self.widgets[msg.id] = w
        if msg.role == "assistant" and not msg.content:
            w.set_message(msg, streaming=True)
        if msg.role == "assistant":
            w.continue_requested.connect(self.chat.continue_reply)
            self._sync_sources(msg, w)
        self._update_empty()
        self._sync_continue()

    def update_message(self, msg: Message) -> None:
        w = self.widgets.get(msg.id)
        if w is not None:
            w.set_message(msg, streaming=self.chat.busy)
            self._sync_continue()
            self._sync_sources(msg, w)

    def _sync_sources(self, msg: Message, w: MessageWidget) -> None:
        """A reply that used the chat's files lists them under its text, as links; any reply
        can be copied as Word-friendly text (right-click)."""
        from app.core.documents.controller import sources_of
        from app.views.sources import SourcesBar, reply_menu

        if not getattr(w, "word_menu", False):
            reply_menu(w, w.plain_text)
            w.word_menu = True  # type: ignore[attr-defined]
        sources = sources_of(msg.stats)
        old = getattr(w, "sources_bar", None)
        if old is not None and [s.to_dict() for s in old.sources] == [s.to_dict() for s in sources]:
            return
        if old is not None:
            w.lay.removeWidget(old)
            old.deleteLater()
            w.sources_bar = None  # type: ignore[attr-defined]
        if sources:
            users = [m for m in self.chat.messages() if m.role == "user" and m.id < msg.id]
            question = users[-1].content if users else ""
            matter = self.documents.matter_of_chat(msg.conversation_id) if self.documents else None
            files = len(self.documents.files(matter.id)) if self.documents and matter else None
            bar = SourcesBar(sources, question, files)
            w.lay.addWidget(bar)
            bar.show()
            w.sources_bar = bar  # type: ignore[attr-defined]

    def _sync_continue(self) -> None:
        """Continue is offered on the last reply only, when it hit the length limit."""
        can = self.chat.can_continue()
        last = max(self.widgets) if self.widgets else None
        for msg_id, w in self.widgets.items():
            w.set_can_continue(can and msg_id == last)

    def show_reading(self, done: int, total: int, seconds_left: float | None) -> None:
        """How far the model has read a long message, in the reply it is about to write."""
        msgs = [w for w in self.widgets.values() if w.role == "assistant"]
        if self.chat.busy and msgs and not msgs[-1].content:
            msgs[-1].set_text(reading_text(done, total, seconds_left))

    def show_summarising(self, part: int, parts: int) -> None:
        """Which part of a too-long message the model is summarising, in the waiting reply."""
        msgs = [w for w in self.widgets.values() if w.role == "assistant"]
        if self.chat.busy and msgs and not msgs[-1].content:
            msgs[-1].set_text(progress_text(part, parts))

    def put_back(self, text: str) -> None:
        """A message that was not sent (summarising it was stopped) returns to the box."""
        if not self.composer.toPlainText().strip():
            self.composer.setPlainText(text)
        self.composer.setFocus()

    def set_welcome(self, text: str) -> None:
        """The empty chat's privacy sentence (the same words as the privacy panel)."""
        self.welcome.setText(text)

    def remove_message(self, msg_id: int) -> None:
        self.widgets.pop(msg_id, None)
        row = self.rows.pop(msg_id, None)
        if row is not None:
            self.list.removeWidget(row)
            row.deleteLater()
        self._update_empty()

    def _autoscroll(self, _lo: int, hi: int) -> None:
        self.scroll_area.verticalScrollBar().setValue(hi)

    # --- actions -----------------------------------------------------------------------------

    def send_or_stop(self) -> None:
        if self.chat.busy:
            self.chat.stop()
            return
        text = self.composer.toPlainText()
        if not text.strip():
            self.composer.setFocus()
            return
        self.error.hide()
        rest = ""
        in_parts = False
        check = self.chat.length_check(text)
        if check is not None and not check.fits:  # too long: say what would be cut, ask
            choice = self.ask_cut(check, text)
            if choice not in (CUT, IN_PARTS):
                self.composer.setFocus()
                return
            in_parts = choice == IN_PARTS
            if not in_parts:
                text, rest = split_message(check, text)
        if self.editing:
            self.editing = False
            ok = self.chat.edit_last(text, in_parts=in_parts)
        elif in_parts:
            ok = self.chat.send_in_parts(text)
        else:
            ok = self.chat.send(text)
        if ok:
            self.composer.setPlainText(rest)  # the part left out waits to be sent next

    def cut_box(self, check: LengthCheck, text: str) -> QMessageBox:
        """The question asked when a message does not fit: send the first part, summarise it
        in parts, or cancel (the default)."""
        box = QMessageBox(
            QMessageBox.Icon.Question,
            "This message is too long for the model",
            cut_question(check, text) + "\n\n" + parts_offer(check.tokens, check.context),
            parent=self,
        )
        box.setTextFormat(Qt.TextFormat.PlainText)
        if split_message(check, text)[0]:
            first = box.addButton("Send the first part", QMessageBox.ButtonRole.AcceptRole)
            first.setProperty("choice", CUT)
        parts = box.addButton("Summarise in parts", QMessageBox.ButtonRole.ActionRole)
        parts.setProperty("choice", IN_PARTS)
        parts.setToolTip(
            "The model summarises each part in turn, then answers from the summaries "
            "(Stop or Esc ends it; nothing is sent then)"
        )
        cancel = box.addButton(QMessageBox.StandardButton.Cancel)
        box.setDefaultButton(cancel)
        return box

    def ask_cut(self, check: LengthCheck, text: str) -> str:
        """What to do with a too-long message: CUT, IN_PARTS or "" (tests replace this)."""
        box = self.cut_box(check, text)
        try:
            box.exec()
            clicked = box.clickedButton()
            return str(clicked.property("choice") or "") if clicked is not None else ""
        finally:
            box.deleteLater()

    def update_length_note(self) -> None:
        """The message's size against what the model reads at once, when it is worth saying."""
        self._length_timer.stop()
        check = self.chat.length_check(self.composer.toPlainText())
        note = size_note(check) if check is not None else ""
        self.length_note.setText(note)
        name = "Small" if check is None or check.fits else "FieldNote"
        if self.length_note.objectName() != name:  # the object name picks the colour
            self.length_note.setObjectName(name)
            self.length_note.style().unpolish(self.length_note)
            self.length_note.style().polish(self.length_note)
        self.length_note.setVisible(bool(note))

    def edit_last(self) -> None:
        text = self.chat.last_user_text()
        if not text or self.chat.busy:
            return
        self.editing = True
        self.composer.setPlainText(text)
        self.composer.setFocus()
        self.send_button.setText("Resend")

    def set_busy(self, busy: bool) -> None:
        if busy:
            self.send_button.setText("Stop")
            set_icon(self.send_button, "stop", "accent_text")
            self.send_button.setAccessibleName("Stop writing the reply")
        else:
            self.send_button.setText("Resend" if self.editing else "Send")
            set_icon(self.send_button, "send", "accent_text")
            self.send_button.setAccessibleName("Send message")
            for w in self.widgets.values():  # drop the placeholder ("…", "Reading…")
                if w.role == "assistant" and not w.content:
                    w.set_text("")
        has = bool(self.widgets)
        self.regen_button.setEnabled(not busy and has)
        self.edit_button.setEnabled(not busy and has)
        self._sync_continue()

    def show_failure(self, err: VeilError, put_back: str) -> None:
        if put_back and not self.composer.toPlainText().strip():
            self.composer.setPlainText(put_back)
        state = self.chat.host.state
        cause = problems.cause_of(err, state)
        shown = problems.explain(err, state)
        if cause == problems.INVITE:  # trying again cannot help: Settings can
            self.error.show_error(shown, "Open Settings", self.settings_requested.emit, cause)
        elif put_back:
            self.error.show_error(shown, "Try again", self.send_or_stop, cause)
        else:  # a partial reply was kept (marked "Interrupted")
            self.error.show_error(shown, "Write the reply again", self.chat.regenerate, cause)

    def save_draft_now(self) -> None:
        self._draft_timer.stop()
        self.chat.save_draft(self.composer.toPlainText())

    def _draft_changed(self) -> None:
        self._draft_timer.start()
        self._length_timer.start()

    def export(self) -> None:
        conv_id = self.chat.current
        if conv_id is None:
            return
        conv = self.chat.store.conversation(conv_id)
        path = export.ask_save_path(
            self,
            "Export chat",
            self.chat.store,
            conv.title if conv else "Chat",
            [export.MARKDOWN, export.WORD, export.JSON],
        )
        if path is None:
            return
        if path.suffix.lower() == ".docx":
            from app.core.documents.word import chat_docx

            try:
                chat_docx(self.chat.store, conv_id, path)
            except VeilError as exc:
                self.error.show_error(exc, cause=problems.EXPORT)
                return
            export.confirm_saved(self.error, path)
            return
        try:
            body = (
                self.chat.export_json(conv_id)
                if path.suffix.lower() == ".json"
                else self.chat.export_markdown(conv_id)
            )
            write_private_file(path, body)  # 0600, as every export
        except OSError as exc:
            self.error.show_error(
                VeilError(f"cannot save {path}: {exc.strerror}", hint="choose another folder"),
                cause=problems.EXPORT,
            )
            return
        export.confirm_saved(self.error, path)
