"""Files into Veil: the file and folder pickers, dropping files on a pane, and the row above the
message box that lists a chat's files (or its matter) while they are read."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QEvent, QObject, QStandardPaths, Signal
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QFileDialog, QHBoxLayout, QLabel, QPushButton, QWidget

from app.core.documents.controller import DocumentsController, is_chat_matter
from app.core.documents.extract import FILE_FILTER
from app.views.theme import set_icon

LAST_FOLDER_KEY = "ui.attach_dir"
SHOWN_FILES = 4  # chips shown; more are summed up as "+ N more"


def _start(store: object) -> str:
    last = store.get(LAST_FOLDER_KEY) if store is not None else None  # type: ignore[attr-defined]
    if last and Path(str(last)).is_dir():
        return str(last)
    docs = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    return docs if docs and Path(docs).is_dir() else str(Path.home())


def ask_files(parent: QWidget, title: str, store: object = None) -> list[Path]:
    names, _ = QFileDialog.getOpenFileNames(parent, title, _start(store), FILE_FILTER)
    paths = [Path(n) for n in names]
    if paths and store is not None:
        store.set(LAST_FOLDER_KEY, str(paths[0].parent))  # type: ignore[attr-defined]
    return paths


def ask_folder(parent: QWidget, title: str, store: object = None) -> Path | None:
    name = QFileDialog.getExistingDirectory(parent, title, _start(store))
    if not name:
        return None
    if store is not None:
        store.set(LAST_FOLDER_KEY, str(Path(name).parent))  # type: ignore[attr-defined]
    return Path(name)


class FileDrop(QObject):
    """Lets the user drop files (and, with ``folders``, folders) on ``widget``."""

    dropped = Signal(list)  # [Path]

    def __init__(self, widget: QWidget, folders: bool = False) -> None:
        super().__init__(widget)
        self.folders = folders
        widget.setAcceptDrops(True)
        widget.installEventFilter(self)

    def paths(self, event: QDragEnterEvent | QDropEvent) -> list[Path]:
        mime = event.mimeData()
        if not mime.hasUrls():
            return []
        out = [Path(u.toLocalFile()) for u in mime.urls() if u.isLocalFile()]
        return [p for p in out if p.is_file() or (self.folders and p.is_dir())]

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        if event.type() in (QEvent.Type.DragEnter, QEvent.Type.DragMove):
            assert isinstance(event, QDragEnterEvent)
            if self.paths(event):
                event.acceptProposedAction()
                return True
        elif event.type() == QEvent.Type.Drop:
            assert isinstance(event, QDropEvent)
            paths = self.paths(event)
            if paths:
                event.acceptProposedAction()
                self.dropped.emit(paths)
                return True
        return False


class AttachmentsBar(QWidget):
    """The current chat's files (with ✕ to remove one) or its matter, and reading progress."""

    def __init__(self, documents: DocumentsController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.documents = documents
        self.conv_id: int | None = None
        self.row = QHBoxLayout(self)
        self.row.setContentsMargins(0, 0, 0, 0)
        self.row.setSpacing(6)
        self.status = QLabel()
        self.status.setObjectName("Small")
        self.chips: list[QWidget] = []
        documents.files_changed.connect(lambda _m: self.refresh())
        documents.progress.connect(self._progress)
        documents.indexed.connect(lambda _m, _r: self.refresh())
        documents.failed.connect(lambda _e: self.refresh())
        self.hide()

    def show_chat(self, conv_id: int | None) -> None:
        self.conv_id = conv_id
        self.refresh()

    def refresh(self) -> None:
        for w in self.chips:
            self.row.removeWidget(w)
            w.deleteLater()
        self.chips = []
        self.row.removeWidget(self.status)
        matter = self.documents.matter_of_chat(self.conv_id)
        files = self.documents.files(matter.id) if matter else []
        if matter is not None and not is_chat_matter(matter):
            label = QLabel(f"Matter: {matter.name} · {len(files)} file{'s' * (len(files) != 1)}")
            label.setObjectName("Small")
            label.setToolTip("Answers in this chat use this matter's files (and only them)")
            self._add(label)
        else:
            for f in files[:SHOWN_FILES]:
                self._add(self._chip(f.name, f.path, f.error, f.pages))
            if len(files) > SHOWN_FILES:
                more = QLabel(f"+ {len(files) - SHOWN_FILES} more")
                more.setObjectName("Small")
                self._add(more)
        self.row.addWidget(self.status)
        self.row.addStretch(1)
        busy = self.documents.busy > 0
        if not busy:
            self.status.setText("")
        self.setVisible(bool(self.chips) or busy)

    def _add(self, w: QWidget) -> None:
        self.row.insertWidget(len(self.chips), w)
        self.chips.append(w)

    def _chip(self, name: str, path: str, error: str, pages: int) -> QWidget:
        b = QPushButton(
            f"{name}"
            + (f" · {pages} p." if pages else "")
            + ("  (unreadable)" if error else "")
            + "  ✕"
        )
        b.setObjectName("ChipButton")
        set_icon(b, "attach", "muted", 14)
        b.setAccessibleName(f"Remove {name} from this chat")
        b.setToolTip(error or f"{path}\nClick to remove it from this chat (the file stays)")
        b.clicked.connect(lambda _=False, p=path: self._remove(p))
        return b

    def _remove(self, path: str) -> None:
        if self.conv_id is not None:
            self.documents.detach(self.conv_id, path)

    def _progress(self, stage: str, fraction: float) -> None:
        self.status.setText(progress_text(stage, fraction))
        self.show()


def progress_text(stage: str, fraction: float) -> str:
    """ "Reading lease.pdf (1 of 3)… 40%", or the last stage alone ("Documents ready")."""
    text = stage[:1].upper() + stage[1:]
    return text if fraction >= 1 else f"{text}… {int(fraction * 100)}%"
