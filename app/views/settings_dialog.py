"""Settings: server, model, reply settings, appearance."""

from __future__ import annotations

import copy

from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.core.settings import MODE_DEMO, MODE_SERVER, THEMES, Settings
from app.views.error_banner import ErrorBanner
from app.views.theme import icon
from engine.errors import VeilError
from engine.loading import DEFAULT_MODEL


def client_public_key() -> str:
    """This computer's public key (created on first use), or the keyring's one-line error."""
    try:
        from engine.keys import client_keypair

        return client_keypair(create=True)[0]
    except VeilError as exc:
        return f"unavailable: {exc}"
    except ImportError:
        return "unavailable: this installation has no server support"


class SettingsDialog(QDialog):
    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.resize(640, 520)
        self.original = settings
        s = copy.copy(settings)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(20, 18, 20, 16)
        title = QLabel("Settings")
        title.setObjectName("PaneTitle")
        lay.addWidget(title)
        self.tabs = QTabWidget()
        lay.addWidget(self.tabs, 1)

        # --- server
        server = QWidget()
        sl = QVBoxLayout(server)
        sl.setContentsMargins(16, 16, 16, 16)
        sl.setSpacing(10)
        self.demo_radio = QRadioButton("Demo server on this computer (nothing leaves it)")
        self.server_radio = QRadioButton("My organization's server")
        group = QButtonGroup(self)
        group.addButton(self.demo_radio)
        group.addButton(self.server_radio)
        self.demo_radio.setChecked(s.mode != MODE_SERVER)
        self.server_radio.setChecked(s.mode == MODE_SERVER)
        sl.addWidget(self.demo_radio)
        sl.addWidget(self.server_radio)
        form = QFormLayout()
        self.invite = QLineEdit(s.invite)
        self.invite.setPlaceholderText("veil1:…")
        self.invite.setAccessibleName("Invite code")
        form.addRow("Invite code:", self.invite)
        key_row = QHBoxLayout()
        self.key = QLineEdit()
        self.key.setReadOnly(True)
        self.key.setAccessibleName("This computer's public key")
        self.key.setPlaceholderText("Click Show to create or read this computer's key")
        show = QPushButton("Show")
        show.setAccessibleName("Show this computer's public key")
        show.clicked.connect(lambda: self.key.setText(client_public_key()))
        copy_key = QPushButton(icon("copy"), "")
        copy_key.setAccessibleName("Copy this computer's public key")
        copy_key.setToolTip("Copy")
        copy_key.clicked.connect(self._copy_key)
        key_row.addWidget(self.key, 1)
        key_row.addWidget(show)
        key_row.addWidget(copy_key)
        form.addRow("This computer's key:", key_row)
        sl.addLayout(form)
        note = QLabel(
            "Send this computer's key to your IT department so the server lets it in. Keys are "
            "kept in the system keyring, never in plain files."
        )
        note.setWordWrap(True)
        note.setObjectName("Small")
        sl.addWidget(note)
        sl.addStretch(1)
        self.server_radio.toggled.connect(self.invite.setEnabled)
        self.invite.setEnabled(self.server_radio.isChecked())
        self.tabs.addTab(server, "Server")

        # --- model and replies
        model = QWidget()
        ml = QFormLayout(model)
        ml.setContentsMargins(16, 16, 16, 16)
        ml.setVerticalSpacing(12)
        row = QHBoxLayout()
        self.model = QLineEdit(s.model)
        self.model.setAccessibleName("Model")
        self.model.setToolTip(f"{DEFAULT_MODEL} (built in), a model folder or a .gguf file")
        browse = QPushButton("Browse…")
        browse.setAccessibleName("Choose a model file")
        browse.clicked.connect(self._browse)
        reset = QPushButton("Built-in")
        reset.setAccessibleName("Use the built-in model")
        reset.clicked.connect(lambda: self.model.setText(DEFAULT_MODEL))
        row.addWidget(self.model, 1)
        row.addWidget(browse)
        row.addWidget(reset)
        ml.addRow("Model:", row)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setValue(s.temperature)
        self.temperature.setAccessibleName("Creativity (temperature)")
        self.temperature.setToolTip("0 = always the most likely words (repeatable)")
        ml.addRow("Creativity (temperature):", self.temperature)
        self.top_p = QDoubleSpinBox()
        self.top_p.setRange(0.05, 1.0)
        self.top_p.setSingleStep(0.05)
        self.top_p.setValue(s.top_p)
        self.top_p.setAccessibleName("Word choice range (top-p)")
        ml.addRow("Word choice range (top-p):", self.top_p)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(16, 4096)
        self.max_tokens.setSingleStep(64)
        self.max_tokens.setValue(s.max_tokens)
        self.max_tokens.setAccessibleName("Longest reply in tokens")
        ml.addRow("Longest reply (tokens):", self.max_tokens)
        self.tabs.addTab(model, "Model and replies")

        # --- appearance
        look = QWidget()
        ll = QFormLayout(look)
        ll.setContentsMargins(16, 16, 16, 16)
        ll.setVerticalSpacing(12)
        self.theme = QComboBox()
        for t in THEMES:
            self.theme.addItem({"system": "Same as the system"}.get(t, t.title()), t)
        self.theme.setCurrentIndex(max(self.theme.findData(s.theme), 0))
        self.theme.setAccessibleName("Theme")
        ll.addRow("Theme:", self.theme)
        self.font_size = QSpinBox()
        self.font_size.setRange(8, 20)
        self.font_size.setValue(s.font_size)
        self.font_size.setSuffix(" pt")
        self.font_size.setAccessibleName("Text size")
        ll.addRow("Text size:", self.font_size)
        self.tabs.addTab(look, "Appearance")

        self.error = ErrorBanner()
        lay.addWidget(self.error)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self._save)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)
        self.result_settings: Settings | None = None

    def values(self) -> Settings:
        s = copy.copy(self.original)
        s.mode = MODE_SERVER if self.server_radio.isChecked() else MODE_DEMO
        s.invite = self.invite.text().strip()
        s.model = self.model.text().strip() or DEFAULT_MODEL
        s.temperature = round(self.temperature.value(), 2)
        s.top_p = round(self.top_p.value(), 2)
        s.max_tokens = self.max_tokens.value()
        s.theme = str(self.theme.currentData())
        s.font_size = self.font_size.value()
        return s

    def _save(self) -> None:
        s = self.values()
        try:
            s.validate()
        except VeilError as exc:
            self.error.show_error(exc)
            return
        self.result_settings = s
        self.accept()

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a model", "", "GGUF model (*.gguf)")
        if path:
            self.model.setText(path)

    def _copy_key(self) -> None:
        cb = QGuiApplication.clipboard()
        if cb is not None and self.key.text() and not self.key.text().startswith("unavailable"):
            cb.setText(self.key.text())
