"""Settings: server, model, reply settings, appearance."""

from __future__ import annotations

import copy
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QMenu,
    QPushButton,
    QRadioButton,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.core import org_key
from app.core.api_host import api_available
from app.core.chat import REGENERATE_NOTE
from app.core.invite import advice, invite_address, invite_problem
from app.core.invite_check import ServerCheck
from app.core.paths import data_dir
from app.core.settings import FONT_SIZES, MODE_DEMO, MODE_SERVER, SERVER_MODEL, THEMES, Settings
from app.views.error_banner import ErrorBanner
from app.views.invite_checker import Check, InviteChecker
from app.views.number_field import DecimalField, NumberField, with_note
from app.views.theme import later, set_icon
from engine.errors import VeilError
from engine.keyed.transform import OrgKey
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


def key_storage_text() -> str:
    """Where this computer's keys really are, for the store in use (VEIL_KEYRING)."""
    try:
        from engine.keys import storage_description

        return storage_description()
    except ImportError:
        return ""


class SettingsDialog(QDialog):
    def __init__(
        self,
        settings: Settings,
        parent: QWidget | None = None,
        check: Check | None = None,
        key_folder: Path | None = None,
    ) -> None:
        super().__init__(parent)
        self.key_folder = key_folder if key_folder is not None else data_dir()
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
        invite_box = QWidget()
        ib = QVBoxLayout(invite_box)
        ib.setContentsMargins(0, 0, 0, 0)
        ib.setSpacing(2)
        ib.addWidget(self.invite)
        self.invite_status = QLabel()  # checked on paste and on Save, shown under the field
        self.invite_status.setWordWrap(True)
        self.invite_status.setTextFormat(Qt.TextFormat.PlainText)  # it quotes the invite
        self.invite_status.hide()
        ib.addWidget(self.invite_status)
        form.addRow("Invite code:", invite_box)
        self._invite_len = len(s.invite)
        self.invite.textChanged.connect(self._invite_changed)
        self.invite.editingFinished.connect(lambda: self.check_invite(show_error=True))
        key_row = QHBoxLayout()
        self.key = QLineEdit()
        self.key.setReadOnly(True)
        self.key.setAccessibleName("This computer's public key")
        self.key.setPlaceholderText("Click Show to create or read this computer's key")
        show = QPushButton("Show")
        show.setAccessibleName("Show this computer's public key")
        show.clicked.connect(lambda: self.key.setText(client_public_key()))
        self.copy_key = QPushButton("Copy")
        set_icon(self.copy_key, "copy")
        self.copy_key.setAccessibleName("Copy this computer's public key")
        self.copy_key.setToolTip("Copy the key, to paste it into a message to your IT department")
        self.copy_key.clicked.connect(self._copy_key)
        key_row.addWidget(self.key, 1)
        key_row.addWidget(show)
        key_row.addWidget(self.copy_key)
        form.addRow("This computer's key:", key_row)
        note = QLabel(
            "Send this computer's key to your IT department so the server lets it in. "
            + key_storage_text()
        )
        note.setWordWrap(True)
        note.setObjectName("Small")
        form.addRow(note)
        self._org_key_rows(form)
        sl.addLayout(form)
        sl.addStretch(1)
        self.server_radio.toggled.connect(self.invite.setEnabled)
        self.server_radio.toggled.connect(lambda _on: self.check_invite(show_error=False))
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
        self.model.setToolTip(
            f"{DEFAULT_MODEL} (built in), a model folder, a .gguf file, or {SERVER_MODEL}: "
            "your organization's model, downloaded from its server"
        )
        self.browse = QPushButton("Browse…")
        self.browse.setAccessibleName("Choose a model file or folder")
        browse_menu = QMenu(self.browse)
        browse_menu.addAction("A model file (.gguf)…", self._browse)
        browse_menu.addAction("A model folder…", self._browse_folder)
        self.browse.setMenu(browse_menu)
        reset = QPushButton("Built-in")
        reset.setAccessibleName("Use the built-in model")
        reset.clicked.connect(lambda: self.model.setText(DEFAULT_MODEL))
        self.server_model = QPushButton("Server's")
        self.server_model.setAccessibleName("Use your organization's model from its server")
        self.server_model.setToolTip(
            "Your organization's model: downloaded from its server on first connect"
        )
        self.server_model.clicked.connect(lambda: self.model.setText(SERVER_MODEL))
        self.server_model.setEnabled(self.server_radio.isChecked())
        self.server_radio.toggled.connect(self.server_model.setEnabled)
        # the built-in name fits whole at every text size; a path shows its file name
        self.model.ensurePolished()  # the theme's text size
        self.model.setMinimumWidth(self.model.fontMetrics().horizontalAdvance(DEFAULT_MODEL) + 40)
        self.model.textChanged.connect(self._show_model_name)
        self._show_model_name(s.model)
        row.addWidget(self.model, 1)
        row.addWidget(self.browse)
        row.addWidget(reset)
        row.addWidget(self.server_model)
        ml.addRow("Model:", row)
        self.notes: list[QLabel] = []
        self._adjusted = False
        self.temperature = DecimalField()
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setValue(s.temperature)
        self.temperature.setAccessibleName("Creativity (temperature)")
        self.temperature.setToolTip("0 = always the most likely words (repeatable)")
        ml.addRow("Creativity (temperature):", self._noted(self.temperature))
        self.regenerate_note = QLabel(REGENERATE_NOTE)
        self.regenerate_note.setObjectName("Small")
        self.regenerate_note.setWordWrap(True)
        ml.addRow("", self.regenerate_note)
        self.top_p = DecimalField()
        self.top_p.setRange(0.05, 1.0)
        self.top_p.setSingleStep(0.05)
        self.top_p.setValue(s.top_p)
        self.top_p.setAccessibleName("Word choice range (top-p)")
        ml.addRow("Word choice range (top-p):", self._noted(self.top_p))
        self.repetition = DecimalField()
        self.repetition.setRange(1.0, 2.0)
        self.repetition.setSingleStep(0.05)
        self.repetition.setValue(s.repetition_penalty)
        self.repetition.setAccessibleName("Avoid repeating (repetition penalty)")
        self.repetition.setToolTip(
            "1 = off. A little above 1 keeps small models from repeating themselves in chat."
        )
        ml.addRow("Avoid repeating (repetition penalty):", self._noted(self.repetition))
        self.max_tokens = NumberField()
        self.max_tokens.setRange(16, 4096)
        self.max_tokens.setSingleStep(64)
        self.max_tokens.setValue(s.max_tokens)
        self.max_tokens.setAccessibleName("Longest reply in tokens")
        self.max_tokens.setToolTip(
            "A reply that reaches this length stops with a Continue button (a token is about "
            "three quarters of a word)"
        )
        ml.addRow("Longest reply (tokens):", self._noted(self.max_tokens))
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
        self.font_size = NumberField()
        self.font_size.setRange(*FONT_SIZES)
        self.font_size.setValue(max(FONT_SIZES[0], min(s.font_size, FONT_SIZES[1])))
        self.font_size.setSuffix(" pt")
        self.font_size.setAccessibleName("Text size")
        ll.addRow("Text size:", self._noted(self.font_size))
        self.tabs.addTab(look, "Appearance")
        if api_available():
            from app.views.api_settings import ApiTab

            self.api_tab: ApiTab | None = ApiTab(s)
            self.api_tab.port.adjusted.connect(lambda _m: setattr(self, "_adjusted", True))
            self.tabs.addTab(self.api_tab, "Other programs")
        else:
            self.api_tab = None

        self.error = ErrorBanner()
        lay.addWidget(self.error)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self._save)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)
        self.save_button = buttons.button(QDialogButtonBox.StandardButton.Save)
        self.result_settings: Settings | None = None
        # a new invite is tried before it is saved: a wrong one never replaces a working server
        self.checker = InviteChecker(check, self)
        self.checker.finished.connect(self._checked)
        self._checking: Settings | None = None

    def values(self) -> Settings:
        s = copy.copy(self.original)
        s.mode = MODE_SERVER if self.server_radio.isChecked() else MODE_DEMO
        # an invite typed while trying the server option is not kept when the demo is chosen
        s.invite = self.invite.text().strip() if s.mode == MODE_SERVER else self.original.invite
        s.model = self.model.text().strip() or DEFAULT_MODEL
        if s.model == SERVER_MODEL and s.mode != MODE_SERVER:
            s.model = DEFAULT_MODEL  # the demo runs the built-in model
        s.temperature = round(self.temperature.value(), 2)
        s.top_p = round(self.top_p.value(), 2)
        s.repetition_penalty = round(self.repetition.value(), 2)
        s.max_tokens = self.max_tokens.value()
        s.theme = str(self.theme.currentData())
        s.font_size = self.font_size.value()
        if self.api_tab is not None:
            self.api_tab.apply(s)
        return s

    def _noted(self, field: NumberField | DecimalField) -> QWidget:
        box, note = with_note(field)
        self.notes.append(note)
        field.adjusted.connect(lambda _m: setattr(self, "_adjusted", True))
        return box

    def _invite_changed(self, text: str) -> None:
        pasted = len(text) - self._invite_len > 4  # a paste, not one typed character
        self._invite_len = len(text)
        self.check_invite(show_error=pasted)

    def check_invite(self, show_error: bool) -> bool:
        """Check the invite code; show the problem (or where it points) under the field.
        Errors show on paste, when leaving the field and on Save, not while typing."""
        label = self.invite_status
        code = self.invite.text().strip()
        if not self.server_radio.isChecked() or not code:
            label.hide()
            return not self.server_radio.isChecked()
        problem = invite_problem(code)
        if problem is None:
            label.setObjectName("FieldNote")
            label.setText(
                f"Invite code for the server at {invite_address(code)[6:]}. "
                "Save checks that the server answers."
            )
        elif show_error:
            label.setObjectName("FieldError")
            label.setText(f"{problem[:1].upper()}{problem[1:]}. {advice(problem)}")
        else:
            label.hide()
            return False
        label.style().unpolish(label)
        label.style().polish(label)
        label.show()
        return problem is None

    def _save(self) -> None:
        self._adjusted = False
        for f in (self.temperature, self.top_p, self.repetition, self.max_tokens, self.font_size):
            f.interpretText()  # a value typed but not confirmed is checked (and noted) now
        if self.api_tab is not None:
            self.api_tab.port.interpretText()
        if self._adjusted:  # show what was changed before saving it
            self.error.show_error(
                VeilError(
                    "some values were out of range and were changed",
                    hint="check the notes under the fields, then press Save again",
                )
            )
            return
        if self.server_radio.isChecked() and not self.check_invite(show_error=True):
            self.tabs.setCurrentIndex(0)
            self.invite.setFocus()
            if not self.invite.text().strip():
                self.invite_status.setObjectName("FieldError")
                self.invite_status.setText("Paste the invite code your IT department gave you.")
                self.invite_status.style().polish(self.invite_status)
                self.invite_status.show()
            return
        s = self.values()
        try:
            s.validate()
        except VeilError as exc:
            self.error.show_error(exc)
            return
        new_server = s.mode == MODE_SERVER and (
            self.original.mode != MODE_SERVER or s.invite != self.original.invite.strip()
        )
        if not new_server:
            self._finish(s)
        elif not self.checker.running:
            self._checking = s
            self._show_invite_status("FieldNote", "Checking the server…")
            self.save_button.setEnabled(False)
            self.checker.start(s.invite)

    def _checked(self, result: ServerCheck) -> None:
        """The new invite's server answered (save) or not (say why; keep the old server)."""
        s, self._checking = self._checking, None
        self.save_button.setEnabled(True)
        if s is None:
            return
        if result.ok:
            self._show_invite_status("FieldOk", "✓ " + result.message)
            self._finish(s)
            return
        keeps = "Nothing was changed: Veil keeps using the server it had."
        self._show_invite_status(
            "FieldError", " ".join(filter(None, (result.message, result.hint, keeps)))
        )
        self.tabs.setCurrentIndex(0)
        self.invite.setFocus()

    def _show_invite_status(self, kind: str, text: str) -> None:
        label = self.invite_status
        label.setObjectName(kind)
        label.setText(text)
        label.style().unpolish(label)
        label.style().polish(label)
        label.show()

    def _finish(self, s: Settings) -> None:
        self.result_settings = s
        self.accept()

    def _show_model_name(self, text: str) -> None:
        """The part of the model field that names it: the start of a name, the end (the file
        name) of a path."""
        if not self.model.hasFocus():
            self.model.setCursorPosition(len(text) if ("/" in text or "\\" in text) else 0)
        self.model.setToolTip(
            f"{text or DEFAULT_MODEL}\n\n{DEFAULT_MODEL} (built in), a model folder or a .gguf file"
        )

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a model", "", "GGUF model (*.gguf)")
        if path:
            self.model.setText(path)

    def _browse_folder(self) -> None:
        """A model folder (config.json and safetensors weights) for fully local use."""
        path = QFileDialog.getExistingDirectory(self, "Choose a model folder")
        if path:
            self.model.setText(path)

    def _org_key_rows(self, form: QFormLayout) -> None:
        """Organisation key: what is imported, Import key…, Remove, and what the key is for."""
        row = QHBoxLayout()
        self.org_key_status = QLabel()
        self.org_key_status.setWordWrap(True)
        self.org_key_status.setTextFormat(Qt.TextFormat.PlainText)
        self.org_key_status.setAccessibleName("Organisation key")
        self.org_key_import = QPushButton("Import key…")
        self.org_key_import.setAccessibleName("Import your organisation's key file")
        self.org_key_import.clicked.connect(self._browse_org_key)
        self.org_key_remove = QPushButton("Remove")
        self.org_key_remove.setAccessibleName("Remove the organisation key from this computer")
        self.org_key_remove.clicked.connect(self.remove_org_key)
        row.addWidget(self.org_key_status, 1)
        row.addWidget(self.org_key_import)
        row.addWidget(self.org_key_remove)
        form.addRow("Organisation key:", row)
        why = QLabel(org_key.EXPLANATION)
        why.setWordWrap(True)
        why.setObjectName("Small")
        form.addRow(why)
        self._show_org_key(org_key.installed(self.key_folder))

    def _show_org_key(self, key: OrgKey | None, error: str = "") -> None:
        label = self.org_key_status
        label.setObjectName("FieldError" if error else "")
        label.setText(error or org_key.status_text(key))
        label.style().polish(label)
        self.org_key_remove.setEnabled(key is not None)

    def _browse_org_key(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import your organisation's key", "")
        if path:
            self.import_org_key(Path(path))

    def import_org_key(self, path: Path) -> bool:
        """Keep a private copy of the key file at ``path``; a file that is not a key is named
        under the field (the key imported before, if any, stays)."""
        try:
            key = org_key.import_key(self.key_folder, path)
        except VeilError as exc:
            self._show_org_key(org_key.installed(self.key_folder), str(exc))
            return False
        self._show_org_key(key)
        return True

    def remove_org_key(self) -> None:
        org_key.forget(self.key_folder)
        self._show_org_key(None)

    def _copy_key(self) -> None:
        if not self.key.text():
            self.key.setText(client_public_key())
        text = self.key.text()
        cb = QGuiApplication.clipboard()
        if cb is None or not text or text.startswith("unavailable"):
            self.copy_key.setText("Nothing to copy")
        else:
            cb.setText(text)
            self.copy_key.setText("Copied")
        self.copy_key.setAccessibleDescription(self.copy_key.text())
        later(1500, self.copy_key, lambda: self.copy_key.setText("Copy"))
