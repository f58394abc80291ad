"""One chat message: a bubble with Markdown text and code blocks that have a Copy button."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
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

from app.core.markdown import Segment, segments
from app.core.storage import Message
from app.views.theme import icon

ROLE_NAMES = {"user": "You", "assistant": "Veil"}
FINISH_NOTES = {
    "cancelled": "Stopped.",
    "error": "Interrupted: the connection failed.",
    "length": "",
    "context": "Stopped: the conversation is as long as this model allows.",
}


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
        self.copy_button = QPushButton(icon("copy", "muted", 16), "Copy")
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
        cb = QGuiApplication.clipboard()
        if cb is not None:
            cb.setText(self.seg.body)
        self.copy_button.setText("Copied")
        QTimer.singleShot(1500, lambda: self.copy_button.setText("Copy"))


class MessageWidget(QFrame):
    """A message bubble; ``set_text`` re-renders it while the reply streams."""

    def __init__(self, msg: Message, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.msg_id = msg.id
        self.role = msg.role
        self.setObjectName("UserBubble" if msg.role == "user" else "AssistantBubble")
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
        self.lay = QVBoxLayout(self)
        self.lay.setContentsMargins(14, 10, 14, 12)
        self.lay.setSpacing(6)
        self.role_label = QLabel(ROLE_NAMES.get(msg.role, msg.role.title()))
        self.role_label.setObjectName("RoleLabel")
        self.lay.addWidget(self.role_label)
        self.parts: list[QWidget] = []
        self.note = QLabel()
        self.note.setObjectName("Small")
        self.note.hide()
        self.lay.addWidget(self.note)
        self._segs: list[Segment] = []
        self.set_message(msg)

    def set_message(self, msg: Message, streaming: bool = False) -> None:
        text = msg.content
        if not text and streaming:
            text = "…"
        self.set_text(text)
        note = FINISH_NOTES.get(msg.finish_reason, "")
        self.note.setText(note)
        self.note.setVisible(bool(note))
        self.setAccessibleName(f"{ROLE_NAMES.get(msg.role, msg.role)} said: {msg.content[:200]}")

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
            self.setMinimumWidth(min(widest + 34, 560))

    def plain_text(self) -> str:
        return "\n".join(s.body for s in self._segs)

    def _make_part(self, seg: Segment) -> QWidget:
        if seg.kind == "code":
            return CodeBlock(seg, self)
        label = QLabel(self)
        label.setWordWrap(True)
        label.setTextFormat(
            Qt.TextFormat.MarkdownText if self.role == "assistant" else Qt.TextFormat.PlainText
        )
        label.setTextInteractionFlags(
            Qt.TextInteractionFlag.TextSelectableByMouse
            | Qt.TextInteractionFlag.LinksAccessibleByMouse
        )
        label.setOpenExternalLinks(False)
        label.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
        label.setText(seg.body)
        return label

    def _update_part(self, w: QWidget, seg: Segment) -> None:
        if isinstance(w, CodeBlock):
            w.set_segment(seg)
        elif isinstance(w, QLabel):
            w.setText(seg.body)
