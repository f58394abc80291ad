"""The privacy slider: how much of the model runs on this computer, what it costs in memory,
and, in one word and one sentence, what a server could read at that setting (from the latest
privacy audit; nothing at all when the model runs fully on this computer)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSlider,
    QVBoxLayout,
    QWidget,
)

from app.core.controller import AppController
from app.core.privacy import PrivacyView
from app.views.theme import Theme, set_icon

MEMORY_NOTE = (
    "The model's weights kept on this computer at this setting (Veil's whole memory use, in "
    "Live performance below, also counts its working memory and the app)."
)


def _small(text: str = "") -> QLabel:
    label = QLabel(text)
    label.setObjectName("Small")
    label.setWordWrap(True)
    return label


class PrivacyPanel(QFrame):
    details_requested = Signal()
    audit_requested = Signal()
    view_changed = Signal(object)  # PrivacyView: the welcome text follows the panel

    def __init__(self, app: AppController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.app = app
        self.view: PrivacyView | None = None
        self.setObjectName("Card")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 14, 16, 14)
        lay.setSpacing(8)
        head = QHBoxLayout()
        ic = QLabel()
        set_icon(ic, "shield", "accent", 20)
        head.addWidget(ic)
        title = QLabel("Privacy")
        title.setObjectName("CardTitle")
        head.addWidget(title, 1)
        lay.addLayout(head)
        q = QLabel("How much of the model runs on this computer")
        q.setWordWrap(True)
        lay.addWidget(q)

        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setAccessibleName("How much of the model runs on this computer")
        self.slider.setAccessibleDescription(
            "Move right to keep more of the model on this computer: the server sees less, "
            "this computer works harder."
        )
        self.slider.setPageStep(1)
        self.slider.setEnabled(False)
        self.slider.valueChanged.connect(self._moved)
        q.setBuddy(self.slider)
        lay.addWidget(self.slider)
        ends = QHBoxLayout()
        less = _small("Less here\n(faster)")
        more = _small("All here\n(no server)")
        less.setWordWrap(False)
        more.setWordWrap(False)
        more.setAlignment(Qt.AlignmentFlag.AlignRight)
        ends.addWidget(less)
        ends.addStretch(1)
        ends.addWidget(more)
        lay.addLayout(ends)

        self.summary = QLabel("Loading the model…")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)

        # the privacy level: one word, one sentence, and where the figure comes from
        self.level_name = _small("Privacy risk")
        lay.addWidget(self.level_name)
        self.level = QLabel("-")
        self.level.setObjectName("GaugeValue")
        self.level.setWordWrap(True)
        lay.addWidget(self.level)
        self.sentence = QLabel()
        self.sentence.setWordWrap(True)
        lay.addWidget(self.sentence)
        self.reply = QLabel()  # what the server reads of the replies, as plainly as the above
        self.reply.setWordWrap(True)
        lay.addWidget(self.reply)
        self.audit = _small()  # where the level comes from: the audit's figure, or why none
        self.audit.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay.addWidget(self.audit)

        self.memory_name = _small("Model memory needed here")
        lay.addWidget(self.memory_name)
        self.memory = QLabel("-")
        self.memory.setObjectName("GaugeValue")
        self.memory.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.memory.setToolTip(MEMORY_NOTE)
        lay.addWidget(self.memory)

        # one under the other: they fit the panel at every text size (changing a layout's
        # direction while Qt lays it out crashed Qt, so there is no switching)
        self.buttons = QVBoxLayout()
        self.buttons.setSpacing(6)
        self.details_button = QPushButton("Audit details…")
        self.details_button.setAccessibleName("Show the privacy audit details")
        self.details_button.clicked.connect(self.details_requested)
        self.run_button = QPushButton("Run privacy audit…")
        self.run_button.setAccessibleName("Run a privacy audit of this model")
        self.run_button.clicked.connect(self.audit_requested)
        self.buttons.addWidget(self.details_button)
        self.buttons.addWidget(self.run_button)
        lay.addLayout(self.buttons)
        self._server_model = False  # the run button is off for the server's model
        self.audit_status = _small()
        self.audit_status.setAccessibleName("Privacy audit status")
        self.audit_status.hide()
        lay.addWidget(self.audit_status)
        self.note = _small()
        self.note.hide()
        lay.addWidget(self.note)

        app.config_loaded.connect(self.setup)
        app.load_failed.connect(lambda _err: self._after_failure())
        app.split_changed.connect(lambda k: self.refresh())
        self._sent_k: int | None = None  # the setting the reply being written uses
        app.chat.busy_changed.connect(self._busy_changed)
        app.drafting.busy_changed.connect(self._busy_changed)

    def _busy_changed(self, busy: bool) -> None:
        self._sent_k = self.slider.value() if busy else None
        self.refresh()

    def setup(self) -> None:
        top = self.app.max_k
        if top is None:
            return
        self.slider.blockSignals(True)
        self.slider.setRange(1, top)
        self.slider.setValue(max(1, min(self.app.settings.local_layers, top)))
        self.slider.blockSignals(False)
        self.slider.setEnabled(True)
        self.refresh()

    def _after_failure(self) -> None:
        """A load failed. When it left no model (a switch to one that cannot be opened), the
        slider and figures must not describe the previous model any more."""
        if self.app.max_k is None:
            self.slider.setEnabled(False)
            self.refresh()

    def _moved(self, k: int) -> None:
        if k != self.app.settings.local_layers:
            self.app.set_local_layers(k)
        self.refresh()

    def refresh(self) -> None:
        k = self.slider.value()
        self.summary.setText(self.app.split_summary(k))
        self.memory.setText(self.app.memory_text(k))
        v = self.app.privacy_view(k)
        self.view = v
        self.level.setText(v.level)
        self.level.setStyleSheet(f"color: {Theme.color(v.color)};")
        self.level.setToolTip(v.tooltip)
        self.sentence.setText(v.sentence)
        self.reply.setText(v.reply)
        self.reply.setVisible(bool(v.reply))
        self.audit.setText(v.caption)
        self.audit.setToolTip(v.tooltip)
        self.level.setAccessibleName(v.accessible)
        # nothing is sent when fully local: there is nothing to audit at this setting
        self.run_button.setToolTip(
            "Nothing is sent at this setting; the audit measures the settings that use a server."
            if v.local
            else "Measure on this computer how many words a server could recover"
        )
        server_model = self.app.host.uses_server_model  # measured on the server, whole model
        if server_model:
            self.run_button.setToolTip(
                "Your organization's model comes with its audit, measured on its server"
            )
        if server_model or self._server_model:  # (a running audit keeps it off otherwise)
            self.run_button.setEnabled(not server_model)
            self._server_model = server_model
        applied = self.app.host.applied_k
        # a message sent since the change uses it (the note goes), a change made while a reply
        # is written waits for the next message (the note stays)
        pending = applied is not None and applied != k and self._sent_k != k
        self.note.setText("New setting: it applies from your next message." if pending else "")
        self.note.setVisible(pending)  # only while a change waits for the next message
        self.view_changed.emit(v)

    def set_audit_status(self, text: str, color: str = "muted") -> None:
        """A line under the audit buttons: running, finished, cancelled."""
        self.audit_status.setText(text)
        self.audit_status.setStyleSheet(f"color: {Theme.color(color)};" if text else "")
        self.audit_status.setVisible(bool(text))
