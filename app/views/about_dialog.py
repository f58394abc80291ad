"""Help → About Veil: what Veil is, what the server can and cannot do (in the words of
docs/privacy.md), where the data and the log are, and a button that opens the log folder."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.views.theme import app_icon, set_icon

ABOUT_VEIL = (
    "Veil is a writing assistant that runs the start and the end of a language model on this "
    "computer and the middle on a server. Your text never leaves this computer as text: the "
    "server gets numbers (the model's activations) and sends numbers back."
)
ABOUT_SERVER = (
    "Someone who runs the server can turn those numbers back into your words and read Veil's "
    "replies: the privacy panel beside the chat shows how much, from Veil's privacy audit. Use "
    "a server you trust, or keep everything on this computer with the privacy slider.\n\n"
    "Veil also trusts the server to compute honestly. A server that returns wrong results on "
    "purpose can change what Veil writes, and Veil cannot notice it or warn you. Veil does not "
    "protect against a malicious server: use one your organization runs."
)
ABOUT_LOG = (
    "When something goes wrong, the details are written to Veil's log. The log never holds "
    "what you write, Veil's replies, invite codes or keys, so you can send it to your IT "
    "department."
)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("veil")
    except PackageNotFoundError:
        return "0.1.0"


def _section(lay: QVBoxLayout, title: str, text: str) -> QLabel:
    head = QLabel(title)
    head.setObjectName("CardTitle")
    lay.addWidget(head)
    body = QLabel(text)
    body.setWordWrap(True)
    body.setTextFormat(Qt.TextFormat.PlainText)
    body.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    lay.addWidget(body)
    return body


def open_folder(folder: Path) -> bool:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return bool(QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))))


class AboutDialog(QDialog):
    def __init__(
        self,
        data_folder: Path,
        log_file: Path | None,
        log_folder: Path,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("About Veil")
        self.resize(620, 560)
        self.log_folder = log_folder
        lay = QVBoxLayout(self)
        lay.setContentsMargins(24, 20, 24, 16)
        lay.setSpacing(8)
        head = QHBoxLayout()
        logo = QLabel()
        logo.setPixmap(app_icon().pixmap(40, 40))
        head.addWidget(logo)
        title = QLabel(f"Veil {version()}")
        title.setObjectName("AppTitle")
        head.addWidget(title, 1)
        lay.addLayout(head)
        _section(lay, "What Veil does", ABOUT_VEIL)
        self.server_text = _section(lay, "About the server", ABOUT_SERVER)
        where = (
            f"Log file: {log_file}" if log_file is not None else
            f"Veil could not write its log in {log_folder}; it logs to the terminal only."
        )  # fmt: skip
        paths = f"Chats and documents: {data_folder}\n{where}\n\n"
        self.log_text = _section(lay, "Your data and the log", paths + ABOUT_LOG)
        row = QHBoxLayout()
        self.open_log = QPushButton("Open log folder")
        set_icon(self.open_log, "folder")
        self.open_log.setAccessibleName("Open the folder that holds Veil's log")
        self.open_log.clicked.connect(lambda: open_folder(self.log_folder))
        row.addWidget(self.open_log)
        row.addStretch(1)
        lay.addLayout(row)
        lay.addStretch(1)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)
