"""The Matters pane: one matter's files and folders, their reading state, and "Ask a question",
which opens a chat whose answers quote only this matter's files."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.core import problems
from app.core.documents.controller import DocumentsController
from app.core.documents.index import SyncReport
from app.views.attach import FileDrop, ask_files, ask_folder, progress_text
from app.views.elided_label import ElidedLabel
from app.views.error_banner import ErrorBanner
from app.views.theme import Theme, set_icon
from engine.errors import VeilError

INTRO = (
    "A matter is the set of files about one case or client: add files or whole folders. They "
    "are read on this computer and read again when they change. Answers in a matter's chats "
    "quote only its files, as [file, page] links."
)


class MattersPane(QWidget):
    chat_opened = Signal(int)  # a chat in this matter was started (conversation id)

    def __init__(
        self, documents: DocumentsController, store: object, parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self.documents, self.store = documents, store
        self.current: int | None = None
        outer = QVBoxLayout(self)
        outer.setContentsMargins(24, 14, 24, 16)
        outer.setSpacing(10)
        bar = QHBoxLayout()
        self.title = ElidedLabel("Matters")
        self.title.setObjectName("PaneTitle")
        bar.addWidget(self.title, 1)
        self.ask_button = QPushButton("Ask a question")
        set_icon(self.ask_button, "chat", "accent_text")
        self.ask_button.setObjectName("PrimaryButton")
        self.ask_button.setAccessibleName("Ask a question about this matter")
        self.ask_button.setToolTip("A new chat whose answers use this matter's files only")
        self.ask_button.clicked.connect(self.ask)
        bar.addWidget(self.ask_button)
        outer.addLayout(bar)
        self.intro = QLabel(INTRO)
        self.intro.setObjectName("Small")
        self.intro.setWordWrap(True)
        outer.addWidget(self.intro)
        buttons = QHBoxLayout()
        self.add_files_button = QPushButton("Add files…")
        set_icon(self.add_files_button, "document")
        self.add_files_button.clicked.connect(lambda: self.add(None))
        self.add_folder_button = QPushButton("Add folder…")
        set_icon(self.add_folder_button, "folder")
        self.add_folder_button.clicked.connect(self.add_folder)
        self.reindex_button = QPushButton("Read again")
        set_icon(self.reindex_button, "regenerate")
        self.reindex_button.setAccessibleName("Read every file of the matter again")
        self.reindex_button.setToolTip(
            "Veil reads changed files by itself before each answer; this reads them all again"
        )
        self.reindex_button.clicked.connect(
            lambda: self.current is not None and self.documents.reindex(self.current, force=True)
        )
        for b in (self.add_files_button, self.add_folder_button, self.reindex_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        outer.addLayout(buttons)
        self.error = ErrorBanner()
        outer.addWidget(self.error)
        added = QLabel("Added to the matter:")
        added.setObjectName("CardTitle")
        outer.addWidget(added)
        self.sources = QListWidget()
        self.sources.setAccessibleName("Files and folders added to the matter")
        self.sources.setMaximumHeight(84)
        outer.addWidget(self.sources)
        self.remove_button = QPushButton("Remove from the matter")
        set_icon(self.remove_button, "trash", "bad")
        self.remove_button.setToolTip("The file or folder stays on disk; its text leaves Veil")
        self.remove_button.clicked.connect(self.remove_selected)
        row = QHBoxLayout()
        row.addWidget(self.remove_button)
        row.addStretch(1)
        outer.addLayout(row)
        self.summary = QLabel()
        self.summary.setObjectName("CardTitle")
        outer.addWidget(self.summary)
        self.files = QTreeWidget()
        self.files.setAccessibleName("The matter's files")
        self.files.setHeaderLabels(["File", "Pages", "Words", "State"])
        self.files.setRootIsDecorated(False)
        self.files.setAlternatingRowColors(True)
        head = self.files.header()
        head.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for col in (1, 2, 3):
            head.setSectionResizeMode(col, QHeaderView.ResizeMode.ResizeToContents)
        outer.addWidget(self.files, 1)
        self.status = QLabel()
        self.status.setObjectName("Small")
        outer.addWidget(self.status)
        FileDrop(self, folders=True).dropped.connect(self.add)
        documents.files_changed.connect(self._changed)
        documents.indexed.connect(self._indexed)
        documents.progress.connect(lambda s, f: self.status.setText(progress_text(s, f)))
        documents.matters_changed.connect(lambda: self.show_matter(self.current))
        self.show_matter(None)

    def show_matter(self, matter_id: int | None) -> None:
        m = self.documents.index.matter(matter_id) if matter_id is not None else None
        self.current = m.id if m else None
        self.title.setText(m.name if m else "Matters")
        for w in (
            self.ask_button,
            self.add_files_button,
            self.add_folder_button,
            self.reindex_button,
            self.remove_button,
            self.sources,
            self.files,
        ):
            w.setEnabled(m is not None)
        self.error.hide()
        self.refresh()

    def refresh(self) -> None:
        self.sources.clear()
        self.files.clear()
        if self.current is None:
            self.summary.setText("Choose a matter on the left, or make a new one.")
            return
        for path, folder in self.documents.index.sources(self.current):
            item = QListWidgetItem(("Folder: " if folder else "File: ") + path)
            item.setData(Qt.ItemDataRole.UserRole, path)
            item.setToolTip(path)
            self.sources.addItem(item)
        files = self.documents.files(self.current)
        pages = sum(f.pages for f in files)
        bad = [f for f in files if f.error]
        text = f"{len(files)} file{'s' * (len(files) != 1)}"
        if pages:
            text += f", {pages} pages"
        if bad:
            text += f" ({len(bad)} could not be read)"
        self.summary.setText(text)
        for f in files:
            state = "Could not read" if f.error else (f.notes or "Ready")
            row = QTreeWidgetItem(
                [f.name, str(f.pages or "–"), f"{f.words:,}" if not f.error else "–", state]
            )
            row.setToolTip(0, f.path)
            row.setToolTip(3, f.error or f.notes or "Read and ready for questions")
            if f.error:
                row.setForeground(3, QColor(Theme.color("bad")))
            self.files.addTopLevelItem(row)

    def _changed(self, matter_id: int | None) -> None:
        if matter_id == self.current:
            self.refresh()

    def _indexed(self, matter_id: int, report: SyncReport) -> None:
        if matter_id != self.current:
            return
        parts = []
        for what, names in (("read", report.added), ("read again", report.updated)):
            if names:
                parts.append(f"{len(names)} {what}")
        if report.removed:
            parts.append(f"{len(report.removed)} gone")
        if report.missing:
            parts.append("not found: " + ", ".join(report.missing[:3]))
        self.status.setText(("Files: " + ", ".join(parts) + ".") if parts else "Up to date.")
        self.refresh()

    def add(self, paths: list[Path] | None) -> None:
        if self.current is None:
            return
        if paths is None:
            paths = ask_files(self, "Add files to the matter", self.store)
        if not paths:
            return
        try:
            self.documents.add_to_matter(self.current, paths)
        except VeilError as exc:
            self.error.show_error(exc, cause=problems.DOCUMENTS)

    def add_folder(self) -> None:
        folder = ask_folder(self, "Add a folder to the matter", self.store)
        if folder is not None:
            self.add([folder])

    def remove_selected(self) -> None:
        item = self.sources.currentItem()
        if self.current is None or item is None:
            return
        self.documents.remove_from_matter(self.current, str(item.data(Qt.ItemDataRole.UserRole)))
        self.refresh()

    def ask(self) -> None:
        if self.current is not None:
            self.chat_opened.emit(self.documents.new_chat_in(self.current))
