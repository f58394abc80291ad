"""An inline message above the message box: an error (what went wrong, what to do, an optional
action button) or a notice (something finished or is happening, e.g. "Saved — Open folder").

Each message may carry a *cause* (see :mod:`app.core.problems`); ``clear(cause)`` hides it when
that cause is resolved, so a banner never outlives its problem.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from app.core.plain_text import one_line
from app.views.theme import set_icon
from engine.errors import VeilError

ERROR = "error"
NOTICE = "notice"


class ErrorBanner(QFrame):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("ErrorBanner")
        self.setProperty("kind", ERROR)
        self.setAccessibleName("Error message")
        lay = QHBoxLayout(self)
        lay.setContentsMargins(12, 10, 10, 10)
        self.icon = QLabel()
        set_icon(self.icon, "warning", "bad", 20)
        lay.addWidget(self.icon)
        text = QVBoxLayout()
        text.setSpacing(2)
        # a server's words may reach these: plain text only, never rich text or links
        self.title = QLabel()
        self.title.setWordWrap(True)
        self.title.setTextFormat(Qt.TextFormat.PlainText)
        self.title.setStyleSheet("font-weight: 700;")
        self.hint = QLabel()
        self.hint.setWordWrap(True)
        self.hint.setTextFormat(Qt.TextFormat.PlainText)
        text.addWidget(self.title)
        text.addWidget(self.hint)
        lay.addLayout(text, 1)
        self.action = QPushButton()
        self.action.hide()
        lay.addWidget(self.action)
        self.close_button = QPushButton()
        set_icon(self.close_button, "close", "muted", 16)
        self.close_button.setObjectName("LinkButton")
        self.close_button.setAccessibleName("Dismiss the message")
        self.close_button.setToolTip("Dismiss")
        self.close_button.clicked.connect(self.hide)
        lay.addWidget(self.close_button)
        self._callback: Callable[[], None] | None = None
        self.cause = ""
        self.kind = ERROR
        self.action.clicked.connect(self._run)
        self.hide()

    def show_error(
        self,
        err: VeilError | str,
        action: str = "",
        callback: Callable[[], None] | None = None,
        cause: str = "",
    ) -> None:
        """Show an error; ``cause`` lets :meth:`clear` take it away when the problem is gone."""
        if isinstance(err, VeilError):
            msg, hint = err.message, err.hint or ""
        else:
            msg, hint = str(err), ""
        self._show(ERROR, msg, hint, action, callback, cause)

    def show_notice(
        self,
        text: str,
        detail: str = "",
        action: str = "",
        callback: Callable[[], None] | None = None,
        cause: str = "",
    ) -> None:
        """Show a non-error message (a confirmation, or something Veil is doing about a
        problem)."""
        self._show(NOTICE, text, detail, action, callback, cause)

    def clear(self, *causes: str) -> None:
        """Hide the message if its cause is one of ``causes`` (any message when none given)."""
        if not causes or (self.cause and self.cause in causes):
            self.hide()

    def hide(self) -> None:
        self.cause = ""
        super().hide()

    def _show(
        self,
        kind: str,
        msg: str,
        hint: str,
        action: str,
        callback: Callable[[], None] | None,
        cause: str,
    ) -> None:
        if kind != self.kind:
            self.kind = kind
            self.setProperty("kind", kind)
            set_icon(self.icon, "warning" if kind == ERROR else "info", _icon_color(kind), 20)
            self.setAccessibleName("Error message" if kind == ERROR else "Message")
            self.style().unpolish(self)
            self.style().polish(self)
            for label in (self.title, self.hint):
                label.style().unpolish(label)
                label.style().polish(label)
        msg, hint = one_line(msg), one_line(hint)
        self.title.setText(msg[:1].upper() + msg[1:])
        self.hint.setText(hint[:1].upper() + hint[1:] if hint else "")
        self.hint.setVisible(bool(hint))
        self._callback = callback
        self.action.setText(action)
        self.action.setVisible(bool(action and callback))
        self.show()
        self.cause = cause

    def text(self) -> str:
        return self.title.text() + (" " + self.hint.text() if not self.hint.isHidden() else "")

    def _run(self) -> None:
        callback = self._callback
        self.hide()
        if callback is not None:
            callback()


def _icon_color(kind: str) -> str:
    return "bad" if kind == ERROR else "accent"
