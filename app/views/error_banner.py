"""An inline error message: what went wrong, what to do, and an optional action button."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app.views.theme import icon
from engine.errors import VeilError


class ErrorBanner(QFrame):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("ErrorBanner")
        self.setAccessibleName("Error message")
        lay = QHBoxLayout(self)
        lay.setContentsMargins(12, 10, 10, 10)
        self.icon = QLabel()
        self.icon.setPixmap(icon("warning", "bad", 20).pixmap(20, 20))
        lay.addWidget(self.icon)
        text = QVBoxLayout()
        text.setSpacing(2)
        self.title = QLabel()
        self.title.setWordWrap(True)
        self.title.setStyleSheet("font-weight: 700;")
        self.hint = QLabel()
        self.hint.setWordWrap(True)
        text.addWidget(self.title)
        text.addWidget(self.hint)
        lay.addLayout(text, 1)
        self.action = QPushButton()
        self.action.hide()
        lay.addWidget(self.action)
        self.close_button = QPushButton(icon("close", "muted", 16), "")
        self.close_button.setObjectName("LinkButton")
        self.close_button.setAccessibleName("Dismiss the error")
        self.close_button.setToolTip("Dismiss")
        self.close_button.clicked.connect(self.hide)
        lay.addWidget(self.close_button)
        self._callback: Callable[[], None] | None = None
        self.action.clicked.connect(self._run)
        self.hide()

    def show_error(
        self,
        err: VeilError | str,
        action: str = "",
        callback: Callable[[], None] | None = None,
    ) -> None:
        if isinstance(err, VeilError):
            msg, hint = err.message, err.hint or ""
        else:
            msg, hint = str(err), ""
        self.title.setText(msg[:1].upper() + msg[1:])
        self.hint.setText(hint[:1].upper() + hint[1:] if hint else "")
        self.hint.setVisible(bool(hint))
        self._callback = callback
        self.action.setText(action)
        self.action.setVisible(bool(action and callback))
        self.show()

    def text(self) -> str:
        return self.title.text() + (" " + self.hint.text() if self.hint.isVisible() else "")

    def _run(self) -> None:
        self.hide()
        if self._callback is not None:
            self._callback()
