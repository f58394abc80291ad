"""A one-line label that shortens its text with "…" instead of pushing the layout wider."""

from __future__ import annotations

import html

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QPainter, QPaintEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget


def plain_tooltip(text: str) -> str:
    """A tooltip that shows ``text`` as it is: Qt draws any tooltip that looks like HTML as
    HTML, so the text goes escaped inside a paragraph of its own."""
    return f"<p>{html.escape(text)}</p>" if text else ""


class ElidedLabel(QLabel):
    """Plain text only (it is painted as text, never as HTML), also in its tooltip."""

    def __init__(self, text: str = "", parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)

    def setText(self, text: str) -> None:
        super().setText(text)
        self.setToolTip(plain_tooltip(text))
        self.setAccessibleName(text)

    def minimumSizeHint(self) -> QSize:
        return QSize(40, super().minimumSizeHint().height())

    def paintEvent(self, _e: QPaintEvent) -> None:
        p = QPainter(self)
        p.setPen(self.palette().color(self.foregroundRole()))
        r = self.contentsRect()
        text = self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, r.width())
        p.drawText(r, int(self.alignment() | Qt.AlignmentFlag.AlignVCenter), text)
