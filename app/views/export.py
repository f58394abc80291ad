"""Saving a chat or a document to a file: the save dialog starts in the user's Documents folder
(or where the last export went), the formats have names a non-programmer understands, and the
window confirms where the file went with a button that opens the folder."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from PySide6.QtCore import QStandardPaths, QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QFileDialog, QWidget

from app.core.problems import EXPORT
from app.views.error_banner import ErrorBanner

# (name shown in the save dialog, file extension)
MARKDOWN = ("Formatted text", ".md")
PLAIN = ("Plain text", ".txt")
JSON = ("Data for other programs", ".json")
WORD = ("Word document", ".docx")
LAST_FOLDER_KEY = "ui.export_dir"


def safe_name(name: str, limit: int = 80) -> str:
    """A file name from a title: no path separators or characters Windows refuses, no "…"
    where the title was cut short (a chat's title is its first message, cut after a word),
    at most ``limit`` characters, cut after a whole word."""
    s = " ".join(name.split())
    s = re.sub(r'[\\/:*?"<>|\x00-\x1f…]+', "-", s)
    if len(s) > limit:
        s = s[: limit + 1].rsplit(" ", 1)[0] if " " in s[:limit] else s[:limit]
    return s.strip(" .,;:-") or "Untitled"


def start_folder(store: Any) -> Path:
    """Where the save dialog opens: the last export's folder, else Documents, else home."""
    last = store.get(LAST_FOLDER_KEY) if store is not None else None
    if last and Path(str(last)).is_dir():
        return Path(str(last))
    docs = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
    if docs and Path(docs).is_dir():
        return Path(docs)
    return Path.home()


def filters(formats: list[tuple[str, str]]) -> str:
    return ";;".join(f"{label} (*{ext})" for label, ext in formats)


def ask_save_path(
    parent: QWidget, title: str, store: Any, name: str, formats: list[tuple[str, str]]
) -> Path | None:
    """The file the user chose (with the chosen format's extension), or None."""
    folder = start_folder(store)
    suggested = folder / f"{safe_name(name)}{formats[0][1]}"
    path, chosen = QFileDialog.getSaveFileName(parent, title, str(suggested), filters(formats))
    if not path:
        return None
    out = Path(path)
    if out.suffix.lower() not in {ext for _, ext in formats}:
        ext = next((e for label, e in formats if chosen.startswith(label)), formats[0][1])
        out = out.with_name(out.name + ext)
    if store is not None:
        store.set(LAST_FOLDER_KEY, str(out.parent))
    return out


def open_folder(path: Path) -> bool:
    """Show the folder holding ``path`` in the file manager."""
    return bool(QDesktopServices.openUrl(QUrl.fromLocalFile(str(path.parent))))


def confirm_saved(banner: ErrorBanner, path: Path) -> None:
    banner.show_notice(
        f"Saved “{path.name}”",
        f"in {path.parent}",
        "Open folder",
        lambda: open_folder(path),
        cause=EXPORT,
    )
