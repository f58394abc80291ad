"""SQLite storage for conversations, messages, documents and settings.

Every change is committed at once (WAL journal), so a crash loses at most the text streamed
since the last write. One :class:`Store` is used from one thread (the GUI thread).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import VeilError

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


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str
    created: float
    updated: float


@dataclass
class Document:
    id: int
    title: str
    body: str
    created: float
    updated: float


class Store:
    """All persistent app state in one SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.executescript(SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise VeilError(
                f"cannot open the app database {path}: {exc}",
                hint="move the file away to start fresh, or use another --data-dir",
            ) from None
        self.set("schema_version", SCHEMA_VERSION)

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
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # --- key/value settings ---------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row["value"]) if row else default

    def set(self, key: str, value: Any) -> None:
        self.db.execute(
            "INSERT INTO kv(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, json.dumps(value)),
        )

    def delete_key(self, key: str) -> None:
        self.db.execute("DELETE FROM kv WHERE key = ?", (key,))

    # --- conversations --------------------------------------------------------------------

    def create_conversation(self, title: str = "New chat", system_prompt: str = "") -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations(title, system_prompt, created, updated) VALUES(?,?,?,?)",
            (title, system_prompt, now, now),
        )
        return int(cur.lastrowid or 0)

    def conversation(self, conv_id: int) -> Conversation | None:
        row = self.db.execute("SELECT * FROM conversations WHERE id = ?", (conv_id,)).fetchone()
        return Conversation(**dict(row)) if row else None

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

    def rename_conversation(self, conv_id: int, title: str) -> None:
        self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conv_id))

    def set_system_prompt(self, conv_id: int, system_prompt: str) -> None:
        self.db.execute(
            "UPDATE conversations SET system_prompt = ? WHERE id = ?", (system_prompt, conv_id)
        )

    def delete_conversation(self, conv_id: int) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM messages WHERE conversation_id = ?", (conv_id,))
            db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,))
        self.delete_key(f"draft:{conv_id}")

    def touch(self, conv_id: int) -> None:
        self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conv_id))

    # --- messages -------------------------------------------------------------------------

    def add_message(self, conv_id: int, role: str, content: str) -> Message:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO messages(conversation_id, role, content, created) VALUES(?,?,?,?)",
            (conv_id, role, content, now),
        )
        self.touch(conv_id)
        return Message(int(cur.lastrowid or 0), conv_id, role, content, now)

    def update_message(
        self,
        msg_id: int,
        content: str,
        finish_reason: str | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None:
        self.db.execute("UPDATE messages SET content = ? WHERE id = ?", (content, msg_id))
        if finish_reason is not None:
            self.db.execute(
                "UPDATE messages SET finish_reason = ? WHERE id = ?", (finish_reason, msg_id)
            )
        if stats is not None:
            self.db.execute(
                "UPDATE messages SET stats = ? WHERE id = ?", (json.dumps(stats), msg_id)
            )

    def delete_messages_from(self, conv_id: int, msg_id: int) -> None:
        """Delete message ``msg_id`` and every later message of the conversation."""
        self.db.execute(
            "DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conv_id, msg_id)
        )

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

    def create_document(self, title: str = "Untitled document", body: str = "") -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO documents(title, body, created, updated) VALUES(?,?,?,?)",
            (title, body, now, now),
        )
        return int(cur.lastrowid or 0)

    def document(self, doc_id: int) -> Document | None:
        row = self.db.execute("SELECT * FROM documents WHERE id = ?", (doc_id,)).fetchone()
        return Document(**dict(row)) if row else None

    def documents(self) -> list[Document]:
        rows = self.db.execute("SELECT * FROM documents ORDER BY updated DESC, id DESC")
        return [Document(**dict(r)) for r in rows]

    def save_document(self, doc_id: int, body: str, title: str | None = None) -> None:
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

    def rename_document(self, doc_id: int, title: str) -> None:
        self.db.execute("UPDATE documents SET title = ? WHERE id = ?", (title, doc_id))

    def delete_document(self, doc_id: int) -> None:
        self.db.execute("DELETE FROM documents WHERE id = ?", (doc_id,))
