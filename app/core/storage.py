"""SQLite storage for conversations, messages, documents and settings.

Every change is committed at once (WAL journal), so a crash loses at most the text streamed
since the last write. One :class:`Store` is used from one thread (the GUI thread).

Private at rest: the database and its WAL/SHM files are mode 0600 (created so, and tightened on
every start), exports are written through a 0600 temporary file (:func:`write_private_file`).

Failures never reach the user as a traceback. Every SQLite error becomes a :class:`StorageError`
whose message and hint fit the cause (disk full, read-only, damaged, in use) and is reported on
:attr:`Store.failed`. *Saves* (edits, drafts, streamed text, settings) report and return False —
the text stays in the window, and :attr:`Store.unsaved` says what the user would lose by closing
now; *creations*, deletions and reads report and raise.
"""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from app.core.logfile import remember
from app.core.tasks import Event
from engine.errors import VeilError

F = TypeVar("F", bound=Callable[..., Any])
PRIVATE_FILE = 0o600

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    created REAL NOT NULL,
    finish_reason TEXT NOT NULL DEFAULT '',
    stats TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE TABLE IF NOT EXISTS documents (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    body TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str  # system | user | assistant
    content: str
    created: float
    finish_reason: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        remember(self.content)  # never in the log file


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str
    created: float
    updated: float

    def __post_init__(self) -> None:
        remember(self.title, self.system_prompt)


@dataclass
class Document:
    id: int
    title: str
    body: str
    created: float
    updated: float

    def __post_init__(self) -> None:
        remember(self.title, self.body)


class StorageError(VeilError):
    """The app database could not be read or written; the message says what to do."""


def storage_error(exc: BaseException, path: Path, doing: str) -> StorageError:
    """The one-line error for ``exc`` while ``doing`` (e.g. "save the document"), with the
    advice that fits its cause."""
    name = str(getattr(exc, "sqlite_errorname", "") or "")
    text = str(exc).lower()
    folder = path.parent
    if name == "SQLITE_FULL" or "disk is full" in text or "no space" in text:
        return StorageError(
            f"could not {doing}: the disk holding {folder} is full",
            hint="free some space on it; what you typed is still in the window",
        )
    if name.startswith("SQLITE_READONLY") or "readonly" in text or "read-only" in text:
        return StorageError(
            f"could not {doing}: the app database {path} is read-only",
            hint="make the file and its folder writable (or start Veil with another "
            "--data-dir); what you typed is still in the window",
        )
    if name in ("SQLITE_NOTADB",) or name.startswith("SQLITE_CORRUPT") or "malformed" in text:
        return StorageError(
            f"could not {doing}: the app database {path} is damaged",
            hint="quit Veil and move the file away to start fresh (it holds your chats), or "
            "start Veil with another --data-dir",
        )
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
        return StorageError(
            f"could not {doing}: the app database is in use by another program",
            hint="close the other Veil window and try again",
        )
    if name.startswith("SQLITE_CANTOPEN") or name.startswith("SQLITE_PERM"):
        return StorageError(
            f"could not {doing}: cannot open the app database {path}",
            hint=f"make sure {folder} exists and is writable, or start Veil with another "
            "--data-dir",
        )
    return StorageError(
        f"could not {doing}: {exc}",
        hint="check the disk holding the data folder; what you typed is still in the window",
    )


def _save(doing: str, key: Callable[..., str | None] | None = None) -> Callable[[F], F]:
    """A save: on failure report it and remember it in ``unsaved`` (under ``key(*args)``, a
    description of what the user would lose; None for things that are not the user's text)
    instead of raising. A later successful save under the same key clears it."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: Store, *args: Any, **kwargs: Any) -> None:
            what = key(*args) if key is not None else None
            try:
                fn(self, *args, **kwargs)
            except sqlite3.Error as exc:
                err = storage_error(exc, self.path, doing)
                if what is not None:
                    self.unsaved[what] = err.message
                self.failed.emit(err)
                return
            if what is not None:
                self.unsaved.pop(what, None)

        return inner  # type: ignore[return-value]

    return wrap


def _strict(doing: str) -> Callable[[F], F]:
    """A creation, deletion or read: on failure report it and raise :class:`StorageError`."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: Store, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except sqlite3.Error as exc:
                err = storage_error(exc, self.path, doing)
                self.failed.emit(err)
                raise err from None

        return inner  # type: ignore[return-value]

    return wrap


def _draft_label(key: str) -> str | None:
    return (
        f"the unsent message in chat {key[len('draft:') :]}" if key.startswith("draft:") else None
    )


def make_private(path: Path) -> None:
    """Mode 0600 for ``path`` if it exists (POSIX; a no-op elsewhere)."""
    if os.name == "posix" and path.exists():
        os.chmod(path, PRIVATE_FILE)


def write_private_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a 0600 temporary file in the same folder, so no
    half-written or world-readable copy is ever on disk (a new file stays 0600; an existing
    one keeps its mode)."""
    mode = path.stat().st_mode & 0o777 if path.exists() else PRIVATE_FILE
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Store:
    """All persistent app state in one SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failed = Event()  # (StorageError) each failure, for a banner
        self.unsaved: dict[str, str] = {}  # user text not saved (description -> why)
        try:
            if os.name == "posix" and not path.exists():
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, PRIVATE_FILE))
            for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                make_private(p)  # existing installs are tightened on start
        except OSError as exc:
            raise storage_error(exc, path, "open the app database") from None
        try:
            self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            check = self.db.execute("PRAGMA quick_check(1)").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"database disk image is malformed ({check})")
            self.db.executescript(SCHEMA)
            self.db.execute(
                "INSERT INTO kv(key, value) VALUES('schema_version', ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (json.dumps(SCHEMA_VERSION),),
            )
        except sqlite3.Error as exc:
            with_db = getattr(self, "db", None)
            if with_db is not None:
                with_db.close()
            raise self._start_error(exc) from None

    def _start_error(self, exc: sqlite3.Error) -> StorageError:
        err = storage_error(exc, self.path, "open the app database")
        if "read-only" not in err.message and (
            not os.access(self.path, os.W_OK) or not os.access(self.path.parent, os.W_OK)
        ):
            readonly = sqlite3.OperationalError("readonly")
            err = storage_error(readonly, self.path, "open the app database")
        return err

    @classmethod
    def open(cls, folder: Path) -> Store:
        return cls(folder / "veil.sqlite3")

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN")
        try:
            yield self.db
        except BaseException:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- key/value settings ---------------------------------------------------------------

    @_strict("read the settings")
    def get(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row["value"]) if row else default

    @_save("save a setting", key=lambda key, value: _draft_label(key))
    def set(self, key: str, value: Any) -> None:
        self.db.execute(
            "INSERT INTO kv(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, json.dumps(value)),
        )

    @_save("save a setting", key=lambda key: _draft_label(key))
    def delete_key(self, key: str) -> None:
        self.db.execute("DELETE FROM kv WHERE key = ?", (key,))

    # --- conversations --------------------------------------------------------------------

    @_strict("start a new chat")
    def create_conversation(self, title: str = "New chat", system_prompt: str = "") -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations(title, system_prompt, created, updated) VALUES(?,?,?,?)",
            (title, system_prompt, now, now),
        )
        return int(cur.lastrowid or 0)

    @_strict("read the chats")
    def conversation(self, conv_id: int) -> Conversation | None:
        row = self.db.execute("SELECT * FROM conversations WHERE id = ?", (conv_id,)).fetchone()
        return Conversation(**dict(row)) if row else None

    @_strict("read the chats")
    def conversations(self, search: str = "") -> list[Conversation]:
        """Newest first; ``search`` matches titles and message text (case-insensitive)."""
        if search.strip():
            pat = "%" + search.strip().replace("%", r"\%").replace("_", r"\_") + "%"
            rows = self.db.execute(
                "SELECT * FROM conversations c WHERE c.title LIKE ? ESCAPE '\\' OR EXISTS("
                "SELECT 1 FROM messages m WHERE m.conversation_id = c.id "
                "AND m.content LIKE ? ESCAPE '\\') ORDER BY updated DESC, id DESC",
                (pat, pat),
            )
        else:
            rows = self.db.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC")
        return [Conversation(**dict(r)) for r in rows]

    @_save("rename the chat", key=lambda conv_id, _: f"the name of chat {conv_id}")
    def rename_conversation(self, conv_id: int, title: str) -> None:
        remember(title)
        self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conv_id))

    @_save("save the system prompt", key=lambda conv_id, _: f"the system prompt of chat {conv_id}")
    def set_system_prompt(self, conv_id: int, system_prompt: str) -> None:
        self.db.execute(
            "UPDATE conversations SET system_prompt = ? WHERE id = ?", (system_prompt, conv_id)
        )

    @_strict("delete the chat")
    def delete_conversation(self, conv_id: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE conversation_id = ?", (conv_id,))
            db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))
        self.delete_key(f"draft:{conv_id}")

    @_save("save the chat")
    def touch(self, conv_id: int) -> None:
        self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conv_id))

    # --- messages -------------------------------------------------------------------------

    @_strict("save the message")
    def add_message(self, conv_id: int, role: str, content: str) -> Message:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO messages(conversation_id, role, content, created) VALUES(?,?,?,?)",
            (conv_id, role, content, now),
        )
        self.touch(conv_id)
        return Message(int(cur.lastrowid or 0), conv_id, role, content, now)

    @_save("save the reply", key=lambda msg_id, *_: f"reply {msg_id}")
    def update_message(
        self,
        msg_id: int,
        content: str,
        finish_reason: str | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None:
        remember(content)
        self.db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, msg_id))
        if finish_reason is not None:
            self.db.execute(
                "UPDATE messages SET finish_reason = ? WHERE id = ?", (finish_reason, msg_id)
            )
        if stats is not None:
            self.db.execute(
                "UPDATE messages SET stats = ? WHERE id = ?", (json.dumps(stats), msg_id)
            )

    @_strict("delete the messages")
    def delete_messages_from(self, conv_id: int, msg_id: int) -> None:
        """Delete message ``msg_id`` and every later message of the conversation."""
        self.db.execute(
            "DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conv_id, msg_id)
        )

    @_strict("read the chat")
    def messages(self, conv_id: int) -> list[Message]:
        rows = self.db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conv_id,)
        )
        out = []
        for r in rows:
            d = dict(r)
            d["stats"] = json.loads(d["stats"] or "{}")
            out.append(Message(**d))
        return out

    # --- documents ------------------------------------------------------------------------

    @_strict("create the document")
    def create_document(self, title: str = "Untitled document", body: str = "") -> int:
        remember(title, body)
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO documents(title, body, created, updated) VALUES(?,?,?,?)",
            (title, body, now, now),
        )
        return int(cur.lastrowid or 0)

    @_strict("read the document")
    def document(self, doc_id: int) -> Document | None:
        row = self.db.execute("SELECT * FROM documents WHERE id = ?", (doc_id,)).fetchone()
        return Document(**dict(row)) if row else None

    @_strict("read the documents")
    def documents(self) -> list[Document]:
        rows = self.db.execute("SELECT * FROM documents ORDER BY updated DESC, id DESC")
        return [Document(**dict(r)) for r in rows]

    @_save("save the document", key=lambda doc_id, *_: f"document {doc_id}")
    def save_document(self, doc_id: int, body: str, title: str | None = None) -> None:
        remember(body, title)
        now = time.time()
        if title is None:
            self.db.execute(
                "UPDATE documents SET body = ?, updated = ? WHERE id = ?", (body, now, doc_id)
            )
        else:
            self.db.execute(
                "UPDATE documents SET body = ?, title = ?, updated = ? WHERE id = ?",
                (body, title, now, doc_id),
            )

    @_save("rename the document", key=lambda doc_id, _: f"the name of document {doc_id}")
    def rename_document(self, doc_id: int, title: str) -> None:
        remember(title)
        self.db.execute("UPDATE documents SET title = ? WHERE id = ?", (title, doc_id))

    @_strict("delete the document")
    def delete_document(self, doc_id: int) -> None:
        self.db.execute("DELETE FROM documents WHERE id = ?", (doc_id,))
