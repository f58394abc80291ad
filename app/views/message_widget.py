"""One chat message: a bubble with Markdown text and code blocks. Replies have a Copy button
(the whole reply, line breaks and formatting kept) and, when they stopped at the length
limit, a notice with Continue."""

from __future__ import annotations

from PySide6.QtCore import QMimeData, Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from app.core.long_message import preview, show_all_text
from app.core.markdown import Segment, keep_line_breaks, segments
from app.core.storage import Message
from app.core.summarise import summary_note
from app.views.safe_markdown import markdown_html
from app.views.theme import later, set_icon

ROLE_NAMES = {"user": "You", "assistant": "Veil"}
FINISH_NOTES = {
    "cancelled": "Stopped.",
    "error": "Interrupted: the connection failed.",
    "length": "Reply hit the length limit.",
    "context": "Stopped: the conversation is as long as this model allows.",
}
COPIED_MS = 1500


def copy_text(text: str, markdown: bool) -> None:
    """Put ``text`` on the clipboard as plain text (line breaks kept) and, for Markdown, as
    formatted text too, so a mail program pastes headings, lists and bold as such."""
    cb = QGuiApplication.clipboard()
    if cb is None:
        return
    data = QMimeData()
    data.setText(text)
    if markdown:
        data.setHtml(markdown_html(keep_line_breaks(text)))  # never the model's own HTML
    cb.setMimeData(data)


def _flash(button: QPushButton, done: str = "Copied") -> None:
    """Show "Copied" on ``button`` for a moment (feedback that the copy happened)."""
    old = button.text()
    if old == done:
        return
    button.setText(done)
    button.setAccessibleDescription(done)
    later(COPIED_MS, button, lambda: button.setText(old))


class CodeBlock(QFrame):
    def __init__(self, seg: Segment, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("CodeBlock")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 6, 10, 10)
        lay.setSpacing(4)
        head = QHBoxLayout()
        self.lang = QLabel(seg.lang or "code")
        self.lang.setObjectName("Small")
        head.addWidget(self.lang)
        head.addStretch(1)
        self.copy_button = QPushButton("Copy")
        set_icon(self.copy_button, "copy", "muted", 16)
        self.copy_button.setObjectName("LinkButton")
        self.copy_button.setAccessibleName("Copy code")
        self.copy_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.copy_button.clicked.connect(self.copy)
        head.addWidget(self.copy_button)
        lay.addLayout(head)
        self.text = QLabel()
        self.text.setObjectName("CodeText")
        self.text.setTextFormat(Qt.TextFormat.PlainText)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.text.setWordWrap(True)
        lay.addWidget(self.text)
        self.set_segment(seg)

    def set_segment(self, seg: Segment) -> None:
        self.seg = seg
        self.lang.setText(seg.lang or "code")
        self.text.setText(seg.body)

    def copy(self) -> None:
        copy_text(self.seg.body, markdown=False)
        _flash(self.copy_button)


class MessageWidget(QFrame):
    """A message bubble; ``set_text`` re-renders it while the reply streams."""

    continue_requested = Signal()

    def __init__(self, msg: Message, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.msg_id = msg.id
        self.role = msg.role
        self.content = msg.content
        self.setObjectName("UserBubble" if msg.role == "user" else "AssistantBubble")
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
        self.lay = QVBoxLayout(self)
        self.lay.setContentsMargins(14, 10, 14, 12)
        self.lay.setSpacing(6)
        head = QHBoxLayout()
        head.setContentsMargins(0, 0, 0, 0)
        self.role_label = QLabel(ROLE_NAMES.get(msg.role, msg.role.title()))
        self.role_label.setObjectName("RoleLabel")
        head.addWidget(self.role_label)
        head.addStretch(1)
        self.copy_button = QPushButton("Copy", self)  # a parent: never a window of its own
        set_icon(self.copy_button, "copy", "muted", 16)
        self.copy_button.setObjectName("LinkButton")
        self.copy_button.setAccessibleName("Copy this reply")
        self.copy_button.setToolTip("Copy the whole reply (line breaks and formatting kept)")
        self.copy_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.copy_button.clicked.connect(self.copy)
        self.copy_button.setVisible(msg.role == "assistant")
        head.addWidget(self.copy_button)
        self.lay.addLayout(head)
        self.parts: list[QWidget] = []
        foot = QHBoxLayout()
        foot.setContentsMargins(0, 0, 0, 0)
        self.note = QLabel(self)
        self.note.setObjectName("Small")
        self.note.setWordWrap(True)
        self.note.hide()
        foot.addWidget(self.note, 1)
        self.continue_button = QPushButton("Continue", self)
        self.continue_button.setObjectName("LinkButton")
        self.continue_button.setAccessibleName("Continue this reply")
        self.continue_button.setToolTip("Let Veil go on writing this reply")
        self.continue_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.continue_button.clicked.connect(self.continue_requested)
        self.continue_button.hide()
        foot.addWidget(self.continue_button)
        self.more_button = QPushButton(self)  # a long message shows its start until clicked
        self.more_button.setObjectName("LinkButton")
        self.more_button.setCursor(Qt.CursorShape.PointingHandCursor)
        self.more_button.clicked.connect(self._toggle_more)
        self.more_button.hide()
        self.lay.addWidget(self.more_button, 0, Qt.AlignmentFlag.AlignLeft)
        self.lay.addLayout(foot)
        self._segs: list[Segment] = []
        self._can_continue = False
        self.expanded = False
        self._natural = 0  # the width a user's message would like (its longest line)
        self._room = 1 << 20  # the width the conversation has for it (fit_width)
        self.finish_reason = msg.finish_reason
        self.set_message(msg)

    def set_message(self, msg: Message, streaming: bool = False) -> None:
        text = msg.content
        self.content = msg.content
        self._msg = msg
        if not text and streaming:
            text = "…"
        short = preview(text) if self.role == "user" else None
        self.more_button.setVisible(short is not None)
        if short is not None:
            self.more_button.setText("Show less" if self.expanded else show_all_text(text))
            self.more_button.setAccessibleName(self.more_button.text())
        self.set_text(text if short is None or self.expanded else short)
        self.finish_reason = msg.finish_reason
        note = FINISH_NOTES.get(msg.finish_reason, "")
        parts = (msg.stats or {}).get("summary_parts") if self.role == "assistant" else None
        if parts:  # the answer rests on summaries of a message too long to read whole
            note = f"{summary_note(int(parts))} {note}".strip()
        self.note.setText(note)
        self.note.setVisible(bool(note))
        self.copy_button.setEnabled(bool(msg.content))
        self._sync_continue()
        self.setAccessibleName(f"{ROLE_NAMES.get(msg.role, msg.role)} said: {msg.content[:200]}")

    def set_can_continue(self, can: bool) -> None:
        """The chat offers Continue on its last reply only (and not while writing)."""
        self._can_continue = can
        self._sync_continue()

    def _sync_continue(self) -> None:
        self.continue_button.setVisible(self._can_continue and self.finish_reason == "length")

    def copy(self) -> None:
        copy_text(self.content, markdown=self.role == "assistant")
        _flash(self.copy_button)

    def _toggle_more(self) -> None:
        self.expanded = not self.expanded
        self.set_message(self._msg)

    def fit_width(self, room: int) -> None:
        """The conversation is ``room`` pixels wide: never ask for more (a long line wraps)."""
        self._room = max(room, 1)
        self.setMaximumWidth(min(640 if self.role == "user" else 900, self._room))
        if self.role == "user":
            self.setMinimumWidth(min(self._natural, self._room))

    def set_text(self, text: str) -> None:
        segs = segments(text) or [Segment("text", "")]
        if [s.kind for s in segs] == [s.kind for s in self._segs]:
            for w, s, old in zip(self.parts, segs, self._segs, strict=True):
                if s != old:
                    self._update_part(w, s)
        else:
            for w in self.parts:
                self.lay.removeWidget(w)
                w.deleteLater()
            self.parts = []
            for i, s in enumerate(segs):
                w = self._make_part(s)
                self.lay.insertWidget(1 + i, w)
                self.parts.append(w)
        self._segs = segs
        if self.role == "user" and self.parts:
            fm = self.parts[0].fontMetrics()
            widest = max((fm.horizontalAdvance(ln) for ln in text.split("\n")), default=0)
            self._natural = min(widest + 34, 560)
            self.setMinimumWidth(min(self._natural, self._room))

    def plain_text(self) -> str:
        return "\n".join(s.body for s in self._segs)

    def _body(self, seg: Segment) -> str:
        """What a text part's label is given: a reply as formatted text (its single line
        breaks real line breaks, as in an address or a signature), never the model's own HTML
        or images (``safe_markdown``); the user's words as plain text."""
        if self.role != "assistant":
            return seg.body
        return markdown_html(keep_line_breaks(seg.body))

    def _make_part(self, seg: Segment) -> QWidget:
        if seg.kind == "code":
            return CodeBlock(seg, self)
        label = QLabel(self)
        label.setWordWrap(True)
        label.setTextFormat(
            Qt.TextFormat.RichText if self.role == "assistant" else Qt.TextFormat.PlainText
        )
        label.setTextInteractionFlags(
            Qt.TextInteractionFlag.TextSelectableByMouse
            | Qt.TextInteractionFlag.LinksAccessibleByMouse
        )
        label.setOpenExternalLinks(False)
        label.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
        label.setText(self._body(seg))
        return label

    def _update_part(self, w: QWidget, seg: Segment) -> None:
        if isinstance(w, CodeBlock):
            w.set_segment(seg)
        elif isinstance(w, QLabel):
            w.setText(self._body(seg))
