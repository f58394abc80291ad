"""The privacy slider: how much of the model runs on this computer, what it costs in memory,
and what the latest privacy audit measured for that setting."""

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
from app.views.theme import Theme, icon


class PrivacyPanel(QFrame):
    details_requested = Signal()
    audit_requested = Signal()

    def __init__(self, app: AppController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.app = app
        self.setObjectName("Card")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(16, 14, 16, 14)
        lay.setSpacing(8)
        head = QHBoxLayout()
        ic = QLabel()
        ic.setPixmap(icon("shield", "accent", 20).pixmap(20, 20))
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
        less = QLabel("Less here\n(faster)")
        more = QLabel("All here\n(no server)")
        for w in (less, more):
            w.setObjectName("Small")
        more.setAlignment(Qt.AlignmentFlag.AlignRight)
        ends.addWidget(less)
        ends.addStretch(1)
        ends.addWidget(more)
        lay.addLayout(ends)

        self.summary = QLabel("Loading the model…")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        self.memory = self._row(lay, "Memory needed here")
        self.audit = self._row(lay, "Words a server could recover")
        self.audit_caption = QLabel()
        self.audit_caption.setObjectName("Small")
        self.audit_caption.setWordWrap(True)
        lay.addWidget(self.audit_caption)
        buttons = QHBoxLayout()
        self.details_button = QPushButton("Audit details…")
        self.details_button.setAccessibleName("Show the privacy audit details")
        self.details_button.clicked.connect(self.details_requested)
        self.run_button = QPushButton("Run privacy audit")
        self.run_button.setAccessibleName("Run a privacy audit of this model")
        self.run_button.clicked.connect(self.audit_requested)
        buttons.addWidget(self.details_button)
        buttons.addWidget(self.run_button)
        lay.addLayout(buttons)
        self.note = QLabel("Changes apply from your next message.")
        self.note.setObjectName("Small")
        self.note.setWordWrap(True)
        lay.addWidget(self.note)

        app.config_loaded.connect(self.setup)
        app.split_changed.connect(lambda k: self.refresh())

    def _row(self, lay: QVBoxLayout, label: str) -> QLabel:
        row = QVBoxLayout()
        row.setSpacing(0)
        name = QLabel(label)
        name.setObjectName("Small")
        value = QLabel("-")
        value.setObjectName("GaugeValue")
        value.setWordWrap(True)
        value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row.addWidget(name)
        row.addWidget(value)
        lay.addLayout(row)
        return value

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

    def _moved(self, k: int) -> None:
        if k != self.app.settings.local_layers:
            self.app.set_local_layers(k)
        self.refresh()

    def refresh(self) -> None:
        k = self.slider.value()
        self.summary.setText(self.app.split_summary(k))
        self.memory.setText(self.app.memory_text(k))
        fig = self.app.audit_figure(k)
        self.audit.setText(fig.value)
        risk = "muted" if fig.top1 is None else "ok" if fig.top1 < 0.05 else "warn"
        if fig.top1 is not None and fig.top1 >= 0.25:
            risk = "bad"
        self.audit.setStyleSheet(f"color: {Theme.color(risk)};")
        self.audit_caption.setText(fig.caption)
        self.audit_caption.setVisible(bool(fig.caption))
        self.audit.setToolTip(f"Worst case over attacks: {fig.attack}" if fig.attack else "")
        self.audit.setAccessibleName(f"Privacy audit: {fig.text}")
        applied = self.app.host.applied_k
        self.note.setText(
            "Changes apply from your next message."
            if applied is None or applied == k
            else "New setting: it applies from your next message."
        )
