"""Under a reply that used the user's files: its sources as [file, page] links, each opening
the passage it quoted (with a button that opens the file), and a line saying what was used.
Also "Copy as Word-friendly text" for replies."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from PySide6.QtCore import QMimeData, QPoint, Qt, QUrl
from PySide6.QtGui import QDesktopServices, QGuiApplication
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QLabel,
    QMenu,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.core.documents.context import Source, used_text
from app.core.documents.word import html, word_friendly
from app.views.theme import set_icon

SHOWN = 6  # links shown; the rest are behind "+ N more"


class PassageDialog(QDialog):
    """The passage a reply was given, with the words of the question marked."""

    def __init__(self, source: Source, question: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.source = source
        self.setWindowTitle(f"{source.name} — {source.where()}")
        self.resize(620, 420)
        lay = QVBoxLayout(self)
        title = QLabel(f"[{source.n}] {source.name}, {source.where()}")
        title.setObjectName("CardTitle")
        lay.addWidget(title)
        where = QLabel(source.path)
        where.setObjectName("Small")
        where.setWordWrap(True)
        where.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay.addWidget(where)
        self.text = QTextBrowser()
        self.text.setAccessibleName("The passage")
        self.text.setHtml(marked(source.text, question))
        lay.addWidget(self.text, 1)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        self.open_button = QPushButton("Open the file")
        set_icon(self.open_button, "document")
        self.open_button.setAccessibleName(f"Open {source.name}")
        self.open_button.setEnabled(Path(source.path).exists())
        self.open_button.setToolTip(
            f"Opens {source.name} in its program; the passage is on {source.where()}"
            if Path(source.path).exists()
            else "The file is not there any more"
        )
        self.open_button.clicked.connect(self.open_file)
        buttons.addButton(self.open_button, QDialogButtonBox.ButtonRole.ActionRole)
        buttons.rejected.connect(self.reject)
        lay.addWidget(buttons)

    def open_file(self) -> bool:
        return bool(QDesktopServices.openUrl(QUrl.fromLocalFile(self.source.path)))


def marked(text: str, question: str) -> str:
    """The passage as HTML with the question's words in bold."""
    from html import escape

    from app.core.documents.index import STOP_WORDS

    words = {w for w in re.findall(r"\w+", question.lower()) if w not in STOP_WORDS and len(w) > 2}
    out = escape(text)
    if words:
        pat = re.compile(r"\b(" + "|".join(re.escape(w) for w in sorted(words)) + r")\w*", re.I)
        out = pat.sub(lambda m: f"<b>{m.group(0)}</b>", out)
    return f"<p style='line-height:140%'>{out}</p>"


class SourcesBar(QWidget):
    """ "Sources: [1] lease.pdf, p. 3  [2] …" and "Used 3 passages from 2 files"."""

    def __init__(
        self,
        sources: list[Source],
        question: str = "",
        files_in_matter: int | None = None,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.sources, self.question = sources, question
        self.setObjectName("SourcesBar")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 4, 0, 0)
        lay.setSpacing(2)
        # one wrapping line of links (a row of buttons would widen the reply past the window)
        self.links = QLabel(self.links_html())
        self.links.setWordWrap(True)
        self.links.setTextFormat(Qt.TextFormat.RichText)
        self.links.setTextInteractionFlags(
            Qt.TextInteractionFlag.LinksAccessibleByMouse
            | Qt.TextInteractionFlag.LinksAccessibleByKeyboard
        )
        self.links.setAccessibleName("Sources of this reply")
        self.links.setToolTip("Click a source to read the passage the reply was given")
        self.links.linkActivated.connect(self.follow)
        lay.addWidget(self.links)
        self.used = QLabel(used_text([s.to_dict() for s in sources], files_in_matter) + ".")
        self.used.setObjectName("Small")
        self.used.setWordWrap(True)
        lay.addWidget(self.used)
        self.dialog: PassageDialog | None = None

    def links_html(self) -> str:
        from html import escape

        from app.views.theme import Theme

        color = Theme.color("accent")
        parts = [
            f"<a href='{s.n}' style='color:{color}; text-decoration:none'>"
            f"[{s.n}]&nbsp;{escape(s.label()).replace(' ', '&nbsp;')}</a>"
            for s in self.sources[:SHOWN]
        ]
        if len(self.sources) > SHOWN:
            parts.append(
                f"<a href='more' style='color:{color}'>+&nbsp;{len(self.sources) - SHOWN}"
                "&nbsp;more</a>"
            )
        return "Sources: " + " &nbsp; ".join(parts)

    def texts(self) -> list[str]:
        """The links as shown ("[1] lease.pdf, p. 3")."""
        return [f"[{s.n}] {s.label()}" for s in self.sources[:SHOWN]]

    def follow(self, link: str) -> None:
        if link == "more":
            self._more()
            return
        s = next((s for s in self.sources if str(s.n) == link), None)
        if s is not None:
            self.open(s)

    def open(self, s: Source) -> PassageDialog:
        """Show the passage (window-modal; deleted when closed)."""
        dlg = PassageDialog(s, self.question, self.window())
        self.dialog = dlg

        def closed(_result: int) -> None:
            if self.dialog is dlg:
                self.dialog = None
            dlg.deleteLater()

        dlg.finished.connect(closed)
        dlg.open()
        return dlg

    def _more(self) -> None:
        menu = QMenu(self)
        for s in self.sources[SHOWN:]:
            menu.addAction(f"[{s.n}] {s.label()}", functools.partial(self.open, s))
        menu.exec(self.mapToGlobal(QPoint(0, self.height())))


def copy_word_friendly(markdown: str) -> None:
    """The reply on the clipboard for a word processor: formatted (HTML) where it pastes
    formatting, plain text without Markdown marks where it does not."""
    cb = QGuiApplication.clipboard()
    if cb is None:
        return
    data = QMimeData()
    data.setText(word_friendly(markdown))
    data.setHtml(html(markdown))
    cb.setMimeData(data)


def reply_menu(widget: QWidget, text: Any) -> None:
    """Right-click on a reply: "Copy as Word-friendly text"."""

    def show(pos: QPoint) -> None:
        menu = QMenu(widget)
        menu.addAction("Copy as Word-friendly text", lambda: copy_word_friendly(text()))
        menu.exec(widget.mapToGlobal(pos))

    widget.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
    widget.customContextMenuRequested.connect(show)
