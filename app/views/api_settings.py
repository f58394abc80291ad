"""Settings → "Other programs": the switch for Veil's OpenAI-compatible API on this computer,
its port, and the token other programs must send (shown, copied, renewed here)."""

from __future__ import annotations

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.core.api_host import API_HOST
from app.core.settings import Settings
from app.views.number_field import NumberField, with_note
from app.views.theme import later, set_icon

NOTE = (
    "Programs that speak the OpenAI API (scripts, editors, Word add-ins) can then use Veil at "
    "the address below, with the token. Only programs on this computer can reach it. They get "
    "the same model, server and privacy setting as this window: as always, only activations "
    "leave the computer, never the text."
)


class ApiTab(QWidget):
    def __init__(self, s: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        from app.api.server import new_token

        self._new_token = new_token
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 16, 16, 16)
        lay.setSpacing(10)
        self.enabled = QCheckBox("Let other programs on this computer use Veil")
        self.enabled.setChecked(s.api_enabled)
        self.enabled.setAccessibleName("Let other programs use Veil (OpenAI-compatible API)")
        lay.addWidget(self.enabled)
        note = QLabel(NOTE)
        note.setObjectName("Small")
        note.setWordWrap(True)
        lay.addWidget(note)
        form = QFormLayout()
        self.port = NumberField()
        self.port.setRange(1024, 65535)
        self.port.setValue(max(1024, min(int(s.api_port), 65535)))
        self.port.setAccessibleName("API port")
        port_box, self.port_note = with_note(self.port)
        form.addRow("Port:", port_box)
        self.address = QLineEdit()
        self.address.setReadOnly(True)
        self.address.setAccessibleName("API address")
        form.addRow("Address:", self.address)
        token_row = QHBoxLayout()
        self.token = QLineEdit(s.api_token or new_token())
        self.token.setReadOnly(True)
        self.token.setAccessibleName("API token")
        self.copy_button = QPushButton("Copy")
        set_icon(self.copy_button, "copy")
        self.copy_button.setAccessibleName("Copy the API token")
        self.copy_button.clicked.connect(self._copy)
        renew = QPushButton("New token")
        renew.setAccessibleName("Make a new API token")
        renew.setToolTip("Programs using the old token stop working until they get the new one")
        renew.clicked.connect(lambda: self.token.setText(new_token()))
        token_row.addWidget(self.token, 1)
        token_row.addWidget(self.copy_button)
        token_row.addWidget(renew)
        form.addRow("Token:", token_row)
        lay.addLayout(form)
        example = QLabel(
            "For example, in Python: OpenAI(base_url=ADDRESS, api_key=TOKEN). "
            "For other computers, IT can run `veil api --host …` instead."
        )
        example.setObjectName("Small")
        example.setWordWrap(True)
        lay.addWidget(example)
        lay.addStretch(1)
        self.port.valueChanged.connect(lambda _v: self._sync())
        self.enabled.toggled.connect(lambda _on: self._sync())
        self._sync()

    def _sync(self) -> None:
        on = self.enabled.isChecked()
        self.address.setText(f"http://{API_HOST}:{self.port.value()}/v1")
        for w in (self.port, self.address, self.token, self.copy_button):
            w.setEnabled(on)

    def _copy(self) -> None:
        cb = QGuiApplication.clipboard()
        if cb is not None:
            cb.setText(self.token.text())
            self.copy_button.setText("Copied")
            later(1500, self.copy_button, lambda: self.copy_button.setText("Copy"))

    def apply(self, s: Settings) -> None:
        s.api_enabled = self.enabled.isChecked()
        s.api_port = self.port.value()
        s.api_token = self.token.text()
