"""The left sidebar: Chat/Documents switch, new, search, the list (rename, export, delete),
and Settings."""

from __future__ import annotations

from PySide6.QtCore import QPoint, Qt, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.core.chat import ChatController
from app.core.documents.controller import DocumentsController
from app.core.drafting import DraftingController
from app.views.theme import app_icon, icon, later, set_icon
from engine.errors import VeilError


class Sidebar(QWidget):
    pane_changed = Signal(str)  # "chat" | "drafting" | "matters"
    settings_requested = Signal()
    about_requested = Signal()
    export_chat = Signal(int)
    export_document = Signal(int)
    new_requested = Signal()  # + New chat / New document (the window creates it and focuses)

    matter_chosen = Signal(object)  # matter id, or None

    def __init__(
        self,
        chat: ChatController,
        drafting: DraftingController,
        parent: QWidget | None = None,
        documents: DocumentsController | None = None,
    ) -> None:
        super().__init__(parent)
        self.chat, self.drafting, self.documents = chat, drafting, documents
        self.setObjectName("Sidebar")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        self.setFixedWidth(270)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(14, 16, 14, 12)
        lay.setSpacing(8)

        head = QHBoxLayout()
        logo = QLabel()
        logo.setPixmap(app_icon().pixmap(28, 28))
        head.addWidget(logo)
        title = QLabel("Veil")
        title.setObjectName("AppTitle")
        head.addWidget(title)
        head.addStretch(1)
        lay.addLayout(head)
        lay.addSpacing(6)

        self.nav_chat = QPushButton("  Chat")
        set_icon(self.nav_chat, "chat")
        self.nav_docs = QPushButton("  Documents")
        set_icon(self.nav_docs, "document")
        self.nav_group = QButtonGroup(self)
        navs = [(self.nav_chat, "chat"), (self.nav_docs, "drafting")]
        if documents is not None:
            self.nav_matters = QPushButton("  Matters")
            set_icon(self.nav_matters, "folder")
            self.nav_matters.setToolTip(
                "Sets of files about one case or client, with cited answers"
            )
            navs.append((self.nav_matters, "matters"))
        for b, key in navs:
            b.setObjectName("NavButton")
            b.setCheckable(True)
            b.setAccessibleName(f"Show {b.text().strip()}")
            b.clicked.connect(lambda _=False, k=key: self.set_pane(k))
            self.nav_group.addButton(b)
            lay.addWidget(b)
        lay.addSpacing(8)

        self.new_button = QPushButton("New chat")
        set_icon(self.new_button, "plus", "accent_text")
        self.new_button.setObjectName("PrimaryButton")
        # a click leaves the focus where the window puts it (the message box): a space typed
        # next must not press the button again (Tab still reaches it)
        self.new_button.setFocusPolicy(Qt.FocusPolicy.TabFocus)
        self.new_button.clicked.connect(self.new_requested)
        lay.addWidget(self.new_button)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats (Ctrl+F)")
        self.search.setAccessibleName("Search chats")
        self.search.setClearButtonEnabled(True)
        find = self.search.addAction(
            icon("search", "muted"), QLineEdit.ActionPosition.LeadingPosition
        )
        set_icon(find, "search", "muted")
        self.search.textChanged.connect(self.refresh_chats)
        lay.addWidget(self.search)
        # right under the search box, where the eye is ("No chats match.")
        self.empty_hint = QLabel()
        self.empty_hint.setObjectName("Small")
        self.empty_hint.setWordWrap(True)
        self.empty_hint.setContentsMargins(4, 2, 4, 2)
        lay.addWidget(self.empty_hint)

        self.stack = QStackedWidget()
        self.chat_list = QListWidget()
        self.chat_list.setAccessibleName("Chats")
        self.doc_list = QListWidget()
        self.doc_list.setAccessibleName("Documents")
        self.matter_list = QListWidget()
        self.matter_list.setAccessibleName("Matters")
        for lst in (self.chat_list, self.doc_list, self.matter_list):
            lst.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
            lst.setTextElideMode(Qt.TextElideMode.ElideRight)
            lst.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
            lst.customContextMenuRequested.connect(lambda p, lst=lst: self._menu(lst, p))
            lst.itemActivated.connect(self._activated)
            lst.itemClicked.connect(self._activated)
            # the highlight always marks the open item: moving it with the keys opens it
            lst.currentItemChanged.connect(self._moved)
            self.stack.addWidget(lst)
        lay.addWidget(self.stack, 1)

        self.settings_button = QPushButton("  Settings")
        set_icon(self.settings_button, "settings")
        self.settings_button.setObjectName("NavButton")
        self.settings_button.setAccessibleName("Open settings")
        self.settings_button.clicked.connect(self.settings_requested)
        lay.addWidget(self.settings_button)
        self.about_button = QPushButton("  About Veil")
        set_icon(self.about_button, "info")
        self.about_button.setObjectName("NavButton")
        self.about_button.setAccessibleName("About Veil, the server, and the log (F1)")
        self.about_button.setToolTip("What Veil and the server do, and where the log is (F1)")
        self.about_button.clicked.connect(self.about_requested)
        lay.addWidget(self.about_button)

        chat.conversations_changed.connect(self.refresh_chats)
        chat.conversation_opened.connect(lambda _: self.refresh_chats())
        drafting.documents_changed.connect(self.refresh_docs)
        drafting.document_opened.connect(lambda _: self.refresh_docs())
        if documents is not None:
            documents.matters_changed.connect(self.refresh_matters)
        self.current_matter: int | None = None
        self.pane = "chat"
        self.nav_chat.setChecked(True)
        self.refresh_chats()
        self.refresh_docs()
        self.refresh_matters()

    def set_pane(self, pane: str) -> None:
        self.pane = pane
        is_chat = pane == "chat"
        index = {"chat": 0, "drafting": 1, "matters": 2}.get(pane, 0)
        (self.nav_chat, self.nav_docs, getattr(self, "nav_matters", self.nav_chat))[
            index
        ].setChecked(True)
        self.stack.setCurrentIndex(index)
        self.search.setVisible(is_chat)
        self.new_button.setText(("New chat", "New document", "New matter")[index])
        self.new_button.setAccessibleName(self.new_button.text())
        self._update_hint()
        self.pane_changed.emit(pane)

    def new_item(self) -> None:
        if self.pane == "chat":
            self.chat.new_conversation()
        elif self.pane == "matters":
            self.new_matter()
        else:
            self.drafting.new_document()

    def new_matter(self) -> None:
        if self.documents is None:
            return
        name, ok = QInputDialog.getText(self, "New matter", "Name of the matter (case, client):")
        if not ok:
            return
        try:
            matter_id = self.documents.create_matter(name)
        except VeilError as exc:
            QMessageBox.warning(self, "New matter", str(exc))
            return
        self.choose_matter(matter_id)

    def choose_matter(self, matter_id: int | None) -> None:
        self.current_matter = matter_id
        self.refresh_matters()
        self.matter_chosen.emit(matter_id)

    def refresh_matters(self) -> None:
        if self.documents is None:
            return
        lst = self.matter_list
        lst.blockSignals(True)
        lst.clear()
        for m in self.documents.matters():
            item = QListWidgetItem(m.name)
            item.setData(Qt.ItemDataRole.UserRole, m.id)
            item.setToolTip(m.name)
            lst.addItem(item)
            if m.id == self.current_matter:
                lst.setCurrentItem(item)
        lst.blockSignals(False)
        self._update_hint()

    def refresh_chats(self) -> None:
        lst = self.chat_list
        lst.blockSignals(True)
        lst.clear()
        for c in self.chat.store.conversations(self.search.text()):
            item = QListWidgetItem(c.title)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            item.setToolTip(c.title)
            lst.addItem(item)
            if c.id == self.chat.current:
                lst.setCurrentItem(item)
        lst.blockSignals(False)
        self._update_hint()

    def refresh_docs(self) -> None:
        lst = self.doc_list
        lst.blockSignals(True)
        lst.clear()
        for d in self.drafting.store.documents():
            item = QListWidgetItem(d.title)
            item.setData(Qt.ItemDataRole.UserRole, d.id)
            lst.addItem(item)
            if d.id == self.drafting.current:
                lst.setCurrentItem(item)
        lst.blockSignals(False)
        self._update_hint()

    def _update_hint(self) -> None:
        lst = {"chat": self.chat_list, "matters": self.matter_list}.get(self.pane, self.doc_list)
        if lst.count():
            self.empty_hint.hide()
            return
        if self.pane == "chat":
            text = "No chats match." if self.search.text() else "Your chats will appear here."
        elif self.pane == "matters":
            text = "Your matters will appear here: press New matter."
        else:
            text = "Your documents will appear here."
        self.empty_hint.setText(text)
        self.empty_hint.show()

    def _activated(self, item: QListWidgetItem) -> None:
        self._open(int(item.data(Qt.ItemDataRole.UserRole)))

    def _moved(self, item: QListWidgetItem | None, _old: QListWidgetItem | None) -> None:
        """The arrow keys moved the highlight: open that item once Qt has finished moving it
        (opening rebuilds the list)."""
        if item is not None:
            item_id = int(item.data(Qt.ItemDataRole.UserRole))
            later(0, self, lambda: self._open(item_id))

    def _open(self, item_id: int) -> None:
        if self.pane == "matters":
            self.choose_matter(item_id)
        elif self.pane == "chat":
            if item_id != self.chat.current:
                self.chat.open(item_id)
        elif item_id != self.drafting.current:
            self.drafting.open(item_id)

    def _menu(self, lst: QListWidget, pos: QPoint) -> None:
        item = lst.itemAt(pos)
        if item is None:
            return
        item_id = int(item.data(Qt.ItemDataRole.UserRole))
        if lst is self.matter_list:
            self._matter_menu(item_id, lst.mapToGlobal(pos))
            return
        is_chat = lst is self.chat_list
        menu = QMenu(self)
        menu.addAction(icon("edit"), "Rename…", lambda: self.rename(item_id, is_chat))
        menu.addAction(
            icon("export"),
            "Export…",
            lambda: (self.export_chat if is_chat else self.export_document).emit(item_id),
        )
        menu.addSeparator()
        menu.addAction(icon("trash", "bad"), "Delete…", lambda: self.delete(item_id, is_chat))
        menu.exec(lst.mapToGlobal(pos))

    def _matter_menu(self, matter_id: int, at: QPoint) -> None:
        docs = self.documents
        if docs is None:
            return
        m = docs.index.matter(matter_id)
        if m is None:
            return

        def rename() -> None:
            name, ok = QInputDialog.getText(self, "Rename", "New name:", text=m.name)
            if ok:
                try:
                    docs.rename_matter(matter_id, name)
                except VeilError as exc:
                    QMessageBox.warning(self, "Rename", str(exc))

        def delete() -> None:
            answer = QMessageBox.question(
                self,
                "Delete matter",
                f"Delete the matter “{m.name}”? Its files stay on disk; Veil forgets their "
                "text. Its chats stay, without the files.",
            )
            if answer == QMessageBox.StandardButton.Yes:
                docs.delete_matter(matter_id)
                if self.current_matter == matter_id:
                    self.choose_matter(None)

        menu = QMenu(self)
        menu.addAction(icon("edit"), "Rename…", rename)
        menu.addSeparator()
        menu.addAction(icon("trash", "bad"), "Delete…", delete)
        menu.exec(at)

    def rename(self, item_id: int, is_chat: bool) -> None:
        store = self.chat.store
        rec = store.conversation(item_id) if is_chat else store.document(item_id)
        if rec is None:
            return
        title, ok = QInputDialog.getText(self, "Rename", "New name:", text=rec.title)
        if not ok:
            return
        try:
            if is_chat:
                self.chat.rename(item_id, title)
            else:
                self.drafting.rename(item_id, title)
        except VeilError as exc:
            QMessageBox.warning(self, "Rename", str(exc))

    def delete(self, item_id: int, is_chat: bool) -> None:
        what = "chat" if is_chat else "document"
        answer = QMessageBox.question(
            self,
            f"Delete {what}",
            f"Delete this {what}? This cannot be undone.",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No,  # Enter never deletes by accident
        )
        if answer != QMessageBox.StandardButton.Yes:
            return
        if is_chat:
            self.chat.delete(item_id)
        else:
            self.drafting.delete(item_id)
