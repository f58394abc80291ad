"""A row of buttons that wraps onto more lines when its width is short, so a pane full of
buttons never asks for more width than its widest button (and never pushes the window's
layout past its edge)."""

from __future__ import annotations

from PySide6.QtCore import QSize
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import QHBoxLayout, QPushButton, QVBoxLayout, QWidget


def lines_for(widths: list[int], room: int, spacing: int) -> list[int]:
    """How many buttons go on each line (left to right, as many as fit, at least one)."""
    lines: list[int] = []
    used = 0
    for w in widths:
        if lines and used + spacing + w <= room:
            lines[-1] += 1
            used += spacing + w
        else:
            lines.append(1)
            used = w
    return lines


class FlowRow(QWidget):
    SPACING = 8

    def __init__(self, buttons: list[QPushButton], parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.buttons = buttons
        self.box = QVBoxLayout(self)
        self.box.setContentsMargins(0, 0, 0, 0)
        self.box.setSpacing(self.SPACING)
        self._lines: list[int] = []
        self._place([len(buttons)])

    def minimumSizeHint(self) -> QSize:
        hint = super().minimumSizeHint()
        widest = max((b.minimumSizeHint().width() for b in self.buttons), default=0)
        return QSize(widest, hint.height())

    def resizeEvent(self, e: QResizeEvent) -> None:
        super().resizeEvent(e)
        widths = [b.sizeHint().width() for b in self.buttons]
        lines = lines_for(widths, e.size().width(), self.SPACING)
        if lines != self._lines:
            self._place(lines)

    def _place(self, lines: list[int]) -> None:
        while self.box.count():
            item = self.box.takeAt(0)
            if item is not None and item.layout() is not None:
                row = item.layout()
                while row.count():
                    row.takeAt(0)
                row.deleteLater()
        it = iter(self.buttons)
        for n in lines:
            row = QHBoxLayout()
            row.setSpacing(self.SPACING)
            for _ in range(n):
                row.addWidget(next(it))
            row.addStretch(1)
            self.box.addLayout(row)
        self._lines = lines
