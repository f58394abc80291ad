"""First run: try Veil on this computer, or connect to the organization's server."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QShowEvent
from PySide6.QtWidgets import (
    QDialog,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.core.invite import advice, invite_problem
from app.views.demo_notice import DemoNotice
from app.views.theme import app_icon, set_icon

DEMO = "demo"
SERVER = "server"


class FirstRunDialog(QDialog):
    """``choice`` is DEMO or SERVER after exec() returns Accepted; ``invite`` holds the code."""

    def __init__(self, parent: QWidget | None = None, demo_model: bool = True) -> None:
        """``demo_model``: "Try it on this computer" uses the built-in demonstration model
        (``app.core.demo_model``), and the card says what it is good for."""
        super().__init__(parent)
        self.setWindowTitle("Welcome to Veil")
        self.setModal(True)
        self.choice = ""
        self.invite = ""
        self.resize(760, 520)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(32, 28, 32, 24)
        lay.setSpacing(14)
        head = QHBoxLayout()
        logo = QLabel()
        logo.setPixmap(app_icon().pixmap(48, 48))
        head.addWidget(logo)
        title = QLabel("Welcome to Veil")
        title.setObjectName("AppTitle")
        head.addWidget(title, 1)
        lay.addLayout(head)
        intro = QLabel(
            "Veil is an AI writing assistant that keeps the beginning and the end of the model on "
            "this computer and sends the server numbers instead of your text. Those numbers can "
            "still be turned back into most of your words, so use a server you trust, or keep "
            "everything on this computer with the privacy slider. How would you like to start?"
        )
        intro.setWordWrap(True)
        intro.setObjectName("Muted")
        lay.addWidget(intro)

        cards = QHBoxLayout()
        cards.setSpacing(16)
        demo, demo_lay = self._card(
            "computer",
            "Try it on this computer",
            "Runs a small demo server and model on this computer. Nothing leaves it and no "
            "account is needed.",
        )
        self.demo_button = QPushButton("Try it on this computer")
        set_icon(self.demo_button, "computer", "accent_text")
        self.demo_button.setObjectName("PrimaryButton")
        self.demo_button.setAccessibleName("Try it on this computer")
        self.demo_button.clicked.connect(self._demo)
        self.demo_notice = DemoNotice()
        self.demo_notice.set_demo(demo_model)
        demo_lay.addWidget(self.demo_notice)
        demo_lay.addStretch(1)
        demo_lay.addWidget(self.demo_button)
        cards.addWidget(demo, 1)

        server, server_lay = self._card(
            "server",
            "Connect to my organization's server",
            "Paste the invite code your IT department gave you. Faster, and the server's "
            "part of the model runs on your organization's hardware.",
        )
        self.invite_edit = QLineEdit()
        self.invite_edit.setPlaceholderText("Invite code (starts with veil1:)")
        self.invite_edit.setAccessibleName("Invite code")
        self.server_button = QPushButton("Connect")
        set_icon(self.server_button, "server")
        self.invite_error = QLabel()  # shown under the field when the code is damaged
        self.invite_error.setObjectName("FieldError")
        self.invite_error.setWordWrap(True)
        self.invite_error.setTextFormat(Qt.TextFormat.PlainText)
        self.invite_error.hide()
        self._typed = 0
        self.invite_edit.textChanged.connect(self._invite_changed)
        self.invite_edit.returnPressed.connect(self._server)
        server_lay.addStretch(1)
        server_lay.addWidget(self.invite_edit)
        server_lay.addWidget(self.invite_error)
        self.server_button.setAccessibleName("Connect to my organization's server")
        self.server_button.setEnabled(False)
        self.server_button.clicked.connect(self._server)
        server_lay.addWidget(self.server_button)
        cards.addWidget(server, 1)
        lay.addLayout(cards, 1)
        foot = QLabel("You can change this later in Settings.")
        foot.setObjectName("Small")
        foot.setAlignment(Qt.AlignmentFlag.AlignCenter)
        lay.addWidget(foot)
        self.demo_button.setFocus()

    def showEvent(self, e: QShowEvent) -> None:
        """Tall enough for every wrapped line at the text size in use (Qt does not grow a
        window for its labels' wrapped height by itself)."""
        lay = self.layout()
        if lay is not None and lay.hasHeightForWidth():
            need = lay.totalHeightForWidth(self.width())
            if need > self.height():
                self.resize(self.width(), need)
        super().showEvent(e)

    def _card(self, icon_name: str, title: str, text: str) -> tuple[QFrame, QVBoxLayout]:
        card = QFrame()
        card.setObjectName("Card")
        lay = QVBoxLayout(card)
        lay.setContentsMargins(18, 18, 18, 18)
        lay.setSpacing(10)
        ic = QLabel()
        set_icon(ic, icon_name, "accent", 32)
        lay.addWidget(ic)
        t = QLabel(title)
        t.setObjectName("CardTitle")
        t.setWordWrap(True)
        lay.addWidget(t)
        body = QLabel(text)
        body.setWordWrap(True)
        body.setObjectName("Muted")
        lay.addWidget(body)
        return card, lay

    def _demo(self) -> None:
        self.choice = DEMO
        self.accept()

    def _invite_changed(self, text: str) -> None:
        """Check a pasted code at once (and again while an error shows), not each keystroke."""
        self.server_button.setEnabled(bool(text.strip()))
        pasted = len(text) - self._typed > 4
        self._typed = len(text)
        if pasted or not self.invite_error.isHidden():
            self._show_problem(invite_problem(text) if text.strip() else None)

    def _show_problem(self, problem: str | None) -> None:
        self.invite_error.setText(
            f"{problem[:1].upper()}{problem[1:]}. {advice(problem)}" if problem else ""
        )
        self.invite_error.setVisible(bool(problem))

    def _server(self) -> None:
        code = self.invite_edit.text().strip()
        if not code:
            return
        problem = invite_problem(code)
        if problem:
            self._show_problem(problem)
            self.invite_edit.setFocus()
            return
        self.choice, self.invite = SERVER, code
        self.accept()
