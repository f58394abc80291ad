"""Matters and their index: named sets of files and folders, their text cut into chunks and
indexed with SQLite FTS5 (BM25 ranking, Porter stemming; exact legal terms match as typed).

One SQLite file next to the app database (``documents.sqlite3``, mode 0600: it holds the text
of the user's files). A matter's files are re-read when their size or modification time changes
and dropped when they disappear (:meth:`DocIndex.sync`). Every search names its matter: a chat
in one matter never sees another's text.

Each conversation may belong to one matter: a named matter the user made, or the matter that
holds the files attached to that chat alone (``kind = 'chat'``, not listed with the others).
"""

from __future__ import annotations

import itertools
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from app.core.documents.chunks import chunk_passages
from app.core.documents.extract import DocumentError, Progress, extract, supported
from app.core.storage import PRIVATE_FILE, make_private, storage_error
from engine.errors import VeilError

INDEX_FILE = "documents.sqlite3"
MAX_FILES = 5000  # per matter: a folder with more is refused, not indexed half
KIND_MATTER = "matter"
KIND_CHAT = "chat"

SCHEMA = """
CREATE TABLE IF NOT EXISTS matters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    kind TEXT NOT NULL DEFAULT 'matter',
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS sources (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    matter_id INTEGER NOT NULL REFERENCES matters(id) ON DELETE CASCADE,
    path TEXT NOT NULL,
    folder INTEGER NOT NULL,
    UNIQUE(matter_id, path)
);
CREATE TABLE IF NOT EXISTS files (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    matter_id INTEGER NOT NULL REFERENCES matters(id) ON DELETE CASCADE,
    path TEXT NOT NULL,
    size INTEGER NOT NULL DEFAULT -1,
    mtime_ns INTEGER NOT NULL DEFAULT -1,
    kind TEXT NOT NULL DEFAULT '',
    pages INTEGER NOT NULL DEFAULT 0,
    words INTEGER NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '',
    notes TEXT NOT NULL DEFAULT '',
    indexed REAL NOT NULL DEFAULT 0,
    UNIQUE(matter_id, path)
);
CREATE TABLE IF NOT EXISTS chat_links (
    conversation_id INTEGER PRIMARY KEY,
    matter_id INTEGER NOT NULL REFERENCES matters(id) ON DELETE CASCADE
);
CREATE VIRTUAL TABLE IF NOT EXISTS chunks USING fts5(
    text, matter_id UNINDEXED, file_id UNINDEXED, page UNINDEXED, para UNINDEXED,
    seq UNINDEXED, tokenize = 'porter unicode61 remove_diacritics 2'
);
"""

# Words that carry no meaning for a search (a question's "what does the ... say about ...").
_STOP = """
a an and are as at be by can could do does did for from has have how i if in into is it its me my
of on or our please say says said should tell that the their them there these they this those to
was we were what when where which who whom why will with would you your about any all also than
then so such not no yes
"""
STOP_WORDS = frozenset(_STOP.split())


def fts5_available() -> bool:
    con = sqlite3.connect(":memory:")
    try:
        con.execute("CREATE VIRTUAL TABLE t USING fts5(x)")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        con.close()


@dataclass
class Matter:
    id: int
    name: str
    kind: str
    created: float


@dataclass
class FileInfo:
    id: int
    matter_id: int
    path: str
    kind: str
    pages: int
    words: int
    error: str
    notes: str

    @property
    def name(self) -> str:
        return Path(self.path).name


@dataclass
class Hit:
    """One chunk found for a question (``score``: BM25, lower is better; 0 when not ranked)."""

    chunk_id: int
    file_id: int
    path: str
    page: int | None
    para: int
    seq: int
    text: str
    score: float = 0.0

    @property
    def name(self) -> str:
        return Path(self.path).name


@dataclass
class SyncReport:
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (file name, error)
    missing: list[str] = field(default_factory=list)  # folders or files added but gone

    @property
    def changed(self) -> bool:
        return bool(self.added or self.updated or self.removed)


def match_query(question: str) -> str:
    """An FTS5 query for a question: each meaningful word, and each pair of neighbouring words
    as a phrase (so "force majeure" ranks a passage with the exact term first), ORed; every
    term quoted, so nothing the user types is read as query syntax. "" when nothing is left."""
    words = [w for w in re.findall(r"\w+", question.lower()) if w not in STOP_WORDS]
    words = [w for w in words if len(w) > 1 or w.isdigit()]
    terms: list[str] = []
    for w in words:
        if f'"{w}"' not in terms:
            terms.append(f'"{w}"')
    for a, b in itertools.pairwise(words):
        phrase = f'"{a} {b}"'
        if phrase not in terms:
            terms.append(phrase)
    return " OR ".join(terms)


class DocIndex:
    """The index database; safe to use from several threads (one lock around every call)."""

    def __init__(self, path: Path) -> None:
        if not fts5_available():
            raise VeilError(
                "this installation's SQLite has no full-text search (FTS5), which documents need",
                hint="install Veil from its installer, or a Python whose sqlite3 has FTS5",
            )
        self.path = path
        self._lock = threading.RLock()
        self._sync_lock = threading.Lock()  # one sync at a time (the app's two threads)
        memory = str(path) == ":memory:"
        try:
            if os.name == "posix" and not memory and not path.exists():
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, PRIVATE_FILE))
            for p in () if memory else (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                make_private(p)
            self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise storage_error(exc, path, "open the documents index") from None

    @classmethod
    def open(cls, folder: Path) -> DocIndex:
        return cls(folder / INDEX_FILE)

    @classmethod
    def in_memory(cls) -> DocIndex:
        """An index that lives only as long as this process (`veil generate --attach`)."""
        return cls(Path(":memory:"))

    def close(self) -> None:
        with self._lock:
            self.db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self.db.execute("BEGIN")
                yield self.db
                self.db.execute("COMMIT")
            except sqlite3.Error as exc:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise storage_error(exc, self.path, "update the documents index") from None
            except BaseException:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise

    def _rows(self, sql: str, args: Iterable[object] = ()) -> list[sqlite3.Row]:
        with self._lock:
            try:
                return self.db.execute(sql, tuple(args)).fetchall()
            except sqlite3.Error as exc:
                raise storage_error(exc, self.path, "read the documents index") from None

    # --- matters --------------------------------------------------------------------------------

    def create_matter(self, name: str, kind: str = KIND_MATTER) -> int:
        name = " ".join(name.split())
        if not name:
            raise VeilError("a matter needs a name")
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO matters(name, kind, created) VALUES(?,?,?)", (name, kind, time.time())
            )
            return int(cur.lastrowid or 0)

    def matters(self, kind: str = KIND_MATTER) -> list[Matter]:
        rows = self._rows(
            "SELECT * FROM matters WHERE kind = ? ORDER BY name COLLATE NOCASE", (kind,)
        )
        return [Matter(**dict(r)) for r in rows]

    def matter(self, matter_id: int) -> Matter | None:
        rows = self._rows("SELECT * FROM matters WHERE id = ?", (matter_id,))
        return Matter(**dict(rows[0])) if rows else None

    def rename_matter(self, matter_id: int, name: str) -> None:
        name = " ".join(name.split())
        if not name:
            raise VeilError("a matter needs a name")
        with self._tx() as db:
            db.execute("UPDATE matters SET name = ? WHERE id = ?", (name, matter_id))

    def delete_matter(self, matter_id: int) -> None:
        """The matter, its list of files and their indexed text (the files stay on disk)."""
        with self._tx() as db:
            db.execute("DELETE FROM chunks WHERE matter_id = ?", (matter_id,))
            db.execute("DELETE FROM matters WHERE id = ?", (matter_id,))

    def add_paths(self, matter_id: int, paths: Iterable[str | Path]) -> list[Path]:
        """Add files and folders to a matter (indexed by the next :meth:`sync`). Returns the
        paths added; unsupported files raise :class:`DocumentError` before anything changes."""
        items = [Path(p).expanduser().resolve() for p in paths]
        for p in items:
            if p.is_file() and not supported(p):
                extract(p)  # raises the clear "not a supported kind of file" error
            if not p.exists():
                raise DocumentError(f"“{p.name}” is not there any more")
        with self._tx() as db:
            for p in items:
                db.execute(
                    "INSERT OR IGNORE INTO sources(matter_id, path, folder) VALUES(?,?,?)",
                    (matter_id, str(p), int(p.is_dir())),
                )
        return items

    def remove_path(self, matter_id: int, path: str | Path) -> None:
        """Take a file or folder out of the matter (the next sync drops its text)."""
        with self._tx() as db:
            db.execute(
                "DELETE FROM sources WHERE matter_id = ? AND path = ?", (matter_id, str(path))
            )

    def sources(self, matter_id: int) -> list[tuple[str, bool]]:
        rows = self._rows(
            "SELECT path, folder FROM sources WHERE matter_id = ? ORDER BY id", (matter_id,)
        )
        return [(str(r["path"]), bool(r["folder"])) for r in rows]

    def files(self, matter_id: int) -> list[FileInfo]:
        rows = self._rows(
            "SELECT id, matter_id, path, kind, pages, words, error, notes FROM files "
            "WHERE matter_id = ? ORDER BY path",
            (matter_id,),
        )
        return [FileInfo(**dict(r)) for r in rows]

    # --- chats ----------------------------------------------------------------------------------

    def matter_of_chat(self, conv_id: int) -> int | None:
        rows = self._rows("SELECT matter_id FROM chat_links WHERE conversation_id = ?", (conv_id,))
        return int(rows[0]["matter_id"]) if rows else None

    def link_chat(self, conv_id: int, matter_id: int | None) -> None:
        """Put a chat in a matter (None: in none). The chat's own attachments go with it."""
        old = self.matter_of_chat(conv_id)
        with self._tx() as db:
            db.execute("DELETE FROM chat_links WHERE conversation_id = ?", (conv_id,))
            if matter_id is not None:
                db.execute(
                    "INSERT INTO chat_links(conversation_id, matter_id) VALUES(?,?)",
                    (conv_id, matter_id),
                )
        if old is not None and old != matter_id:
            m = self.matter(old)
            if m is not None and m.kind == KIND_CHAT:
                self.delete_matter(old)

    def chat_matter(self, conv_id: int) -> int:
        """The matter holding this chat's files (made for it on the first attachment)."""
        current = self.matter_of_chat(conv_id)
        if current is not None:
            return current
        matter_id = self.create_matter(f"Files of chat {conv_id}", KIND_CHAT)
        self.link_chat(conv_id, matter_id)
        return matter_id

    def forget_chats(self, keep: Callable[[int], bool]) -> None:
        """Drop the links (and attached files' text) of chats for which ``keep(id)`` is False:
        deleting a chat deletes the text of the files attached to it."""
        for r in self._rows("SELECT conversation_id FROM chat_links"):
            conv = int(r["conversation_id"])
            if not keep(conv):
                self.link_chat(conv, None)

    # --- indexing -------------------------------------------------------------------------------

    def _found_files(self, matter_id: int, report: SyncReport) -> dict[str, os.stat_result]:
        found: dict[str, os.stat_result] = {}
        for path, folder in self.sources(matter_id):
            p = Path(path)
            if not p.exists():
                report.missing.append(p.name)
                continue
            candidates = _walk(p) if folder else [p]
            for f in candidates:
                try:
                    found[str(f)] = f.stat()
                except OSError:
                    continue
                if len(found) > MAX_FILES:
                    raise VeilError(
                        f"the matter has more than {MAX_FILES} files",
                        hint="add smaller folders (one per case or client)",
                    )
        return found

    def sync(
        self,
        matter_id: int,
        progress: Progress | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        force: bool = False,
    ) -> SyncReport:
        """Bring the matter's index up to date with its files: new and changed files are read,
        removed ones dropped. ``force`` reads every file again."""
        with self._sync_lock:
            return self._sync(matter_id, progress, cancelled, force)

    def _sync(
        self,
        matter_id: int,
        progress: Progress | None,
        cancelled: Callable[[], bool],
        force: bool,
    ) -> SyncReport:
        report = SyncReport()
        found = self._found_files(matter_id, report)
        known = {
            str(r["path"]): r
            for r in self._rows(
                "SELECT id, path, size, mtime_ns, error FROM files WHERE matter_id = ?",
                (matter_id,),
            )
        }
        for path, row in known.items():
            if path not in found:
                with self._tx() as db:
                    db.execute("DELETE FROM chunks WHERE file_id = ?", (int(row["id"]),))
                    db.execute("DELETE FROM files WHERE id = ?", (int(row["id"]),))
                report.removed.append(Path(path).name)
        todo = [
            (path, st)
            for path, st in sorted(found.items())
            if force
            or path not in known
            or (int(known[path]["size"]), int(known[path]["mtime_ns"]))
            != (st.st_size, st.st_mtime_ns)
        ]
        for i, (path, st) in enumerate(todo):
            if cancelled():
                break
            name = Path(path).name

            def step(stage: str, frac: float, i: int = i) -> None:
                if progress:
                    progress(f"{stage} ({i + 1} of {len(todo)})", (i + frac) / len(todo))

            step(f"reading {name}", 0.0)
            try:
                doc = extract(path, step)
                error, chunks = "", chunk_passages(doc.passages)
            except DocumentError as exc:
                doc, error, chunks = None, str(exc), []
                report.failed.append((name, str(exc)))
            with self._tx() as db:
                old = known.get(path)
                if old is not None:
                    db.execute("DELETE FROM chunks WHERE file_id = ?", (int(old["id"]),))
                    db.execute("DELETE FROM files WHERE id = ?", (int(old["id"]),))
                cur = db.execute(
                    "INSERT INTO files(matter_id, path, size, mtime_ns, kind, pages, words, "
                    "error, notes, indexed) VALUES(?,?,?,?,?,?,?,?,?,?)",
                    (
                        matter_id,
                        path,
                        st.st_size,
                        st.st_mtime_ns,
                        doc.kind if doc else "",
                        doc.pages if doc else 0,
                        doc.words if doc else 0,
                        error,
                        "; ".join(doc.notes) if doc else "",
                        time.time(),
                    ),
                )
                file_id = int(cur.lastrowid or 0)
                db.executemany(
                    "INSERT INTO chunks(text, matter_id, file_id, page, para, seq) "
                    "VALUES(?,?,?,?,?,?)",
                    [(c.text, matter_id, file_id, c.page, c.para, c.seq) for c in chunks],
                )
            if not error:
                (report.updated if path in known else report.added).append(name)
        if progress:
            progress("documents ready", 1.0)
        return report

    # --- search ---------------------------------------------------------------------------------

    def search(self, matter_id: int, question: str, limit: int = 8) -> list[Hit]:
        """The chunks of this matter that best match ``question`` (BM25), best first."""
        query = match_query(question)
        if not query:
            return []
        rows = self._rows(
            "SELECT c.rowid AS chunk_id, c.file_id, f.path, c.page, c.para, c.seq, c.text, "
            "bm25(chunks) AS score FROM chunks c JOIN files f ON f.id = c.file_id "
            "WHERE chunks MATCH ? AND c.matter_id = ? AND f.matter_id = ? "
            "ORDER BY score, c.rowid LIMIT ?",
            (query, matter_id, matter_id, limit),
        )
        return [_hit(r) for r in rows]

    def in_order(self, matter_id: int, limit: int = 10_000) -> list[Hit]:
        """The matter's chunks in reading order (file by file), for a matter small enough to
        send whole or a question with no words to search for."""
        rows = self._rows(
            "SELECT c.rowid AS chunk_id, c.file_id, f.path, c.page, c.para, c.seq, c.text, "
            "0.0 AS score FROM chunks c JOIN files f ON f.id = c.file_id "
            "WHERE c.matter_id = ? AND f.matter_id = ? ORDER BY f.path, c.seq LIMIT ?",
            (matter_id, matter_id, limit),
        )
        return [_hit(r) for r in rows]

    def chunk_count(self, matter_id: int) -> int:
        rows = self._rows("SELECT count(*) AS n FROM chunks WHERE matter_id = ?", (matter_id,))
        return int(rows[0]["n"])


def _hit(r: sqlite3.Row) -> Hit:
    page = r["page"]
    return Hit(
        chunk_id=int(r["chunk_id"]),
        file_id=int(r["file_id"]),
        path=str(r["path"]),
        page=int(page) if page is not None else None,
        para=int(r["para"]),
        seq=int(r["seq"]),
        text=str(r["text"]),
        score=float(r["score"]),
    )


def _walk(folder: Path) -> list[Path]:
    """Supported files under ``folder`` (hidden files and folders, and Word's "~$" lock files,
    left out), sorted."""
    out = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            if n.startswith((".", "~$")):
                continue
            p = Path(root) / n
            if supported(p):
                out.append(p)
    return out
