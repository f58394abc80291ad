"""The line that says the built-in model is a demonstration model (``app.core.demo_model``):
one sentence on a warning-coloured strip, shown in the chat and the drafting pane while that
model is in use, and nowhere when another model is."""

from __future__ import annotations

from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QWidget

from app.core.demo_model import DEMO_LINE, DEMO_TOOLTIP
from app.views.theme import set_icon


class DemoNotice(QFrame):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("DemoNotice")
        self.setAccessibleName("About the demo model")
        self.setToolTip(DEMO_TOOLTIP)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(10, 6, 10, 6)
        lay.setSpacing(8)
        icon = QLabel()
        set_icon(icon, "warning", "warn", 18)
        lay.addWidget(icon)
        self.text = QLabel(DEMO_LINE)
        self.text.setWordWrap(True)
        self.text.setAccessibleName(DEMO_LINE)
        lay.addWidget(self.text, 1)
        self.hide()

    def set_demo(self, demo: bool) -> None:
        self.setVisible(demo)
