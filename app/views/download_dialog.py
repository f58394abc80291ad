"""The organisation's model, downloaded from its server on first connect: the question (with
the size) before it starts, and a dialog with a progress bar while it runs."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot
from PySide6.QtWidgets import QDialog, QLabel, QMessageBox, QProgressBar, QVBoxLayout, QWidget

from app.core.gauges import human_bytes
from engine.delivery.fetch import STAGE

__all__ = ["STAGE", "DownloadAsker", "DownloadDialog", "question"]


def question(model: str, size: int) -> str:
    return (
        f"Your organization's server provides the model {model}. This computer needs its "
        f"part of it once: {human_bytes(size)} to download. It is kept for later, and "
        "downloaded again only when your IT department changes the model.\n\nDownload it now?"
    )


class DownloadAsker(QObject):
    """``asker(manifest, size)`` from the engine's thread: asks on the GUI thread and waits
    for the answer (True: download)."""

    _ask = Signal(str, int)

    def __init__(self, parent: QWidget) -> None:
        super().__init__(parent)
        self.window = parent
        self.answer = False
        self.asked: list[tuple[str, int]] = []
        self._ask.connect(self._on_ask, Qt.ConnectionType.BlockingQueuedConnection)

    def __call__(self, manifest: Any, size: int) -> bool:
        if QThread.currentThread() is self.thread():
            self._on_ask(str(manifest.model), int(size))
        else:
            self._ask.emit(str(manifest.model), int(size))
        return self.answer

    @Slot(str, int)
    def _on_ask(self, model: str, size: int) -> None:
        self.asked.append((model, size))
        box = QMessageBox(self.window)
        box.setWindowTitle("Download your organization's model")
        box.setIcon(QMessageBox.Icon.Question)
        box.setText(question(model, size))
        box.setStandardButtons(QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel)
        box.setDefaultButton(QMessageBox.StandardButton.Yes)
        box.button(QMessageBox.StandardButton.Yes).setText("Download")
        try:
            self.answer = box.exec() == QMessageBox.StandardButton.Yes
        finally:
            box.deleteLater()


class DownloadDialog(QDialog):
    """Shows the download's progress; closes itself when it is done."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Downloading your organization's model")
        self.setModal(False)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(20, 18, 20, 18)
        self.label = QLabel("Downloading the model from your organization's server…")
        self.label.setWordWrap(True)
        lay.addWidget(self.label)
        self.bar = QProgressBar()
        self.bar.setRange(0, 1000)
        self.bar.setAccessibleName("Download progress")
        lay.addWidget(self.bar)
        note = QLabel("You can keep this window open; Veil connects when it is done.")
        note.setObjectName("Small")
        note.setWordWrap(True)
        lay.addWidget(note)
        self.resize(440, 150)

    def update_progress(self, fraction: float) -> None:
        f = max(0.0, min(1.0, fraction))
        self.bar.setValue(int(f * 1000))
        self.label.setText(f"Downloading the model from your organization's server… {f * 100:.0f}%")
        if f >= 1.0:
            self.hide()
        elif not self.isVisible():
            self.show()
