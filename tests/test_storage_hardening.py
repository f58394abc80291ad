"""The app's data at rest (issue 17): private file modes, a full disk, a read-only or damaged
database — one clear message with the advice that fits, nothing typed lost, a clean exit.

A full disk is SQLite's own SQLITE_FULL, made by capping the database's page count
(``PRAGMA max_page_count``) and filling it; a read-only database is one opened with
``mode=ro`` (the tests run as root, for whom file modes do not stop writes)."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.core import storage
from app.core.controller import AppController
from app.core.paths import data_dir
from app.core.settings import MODE_IN_PROCESS, Settings
from app.core.storage import StorageError, Store, write_private_file
from app.core.tasks import InlineExecutor

REPO = Path(__file__).resolve().parent.parent


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def umask022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def fill(store: Store) -> None:
    """Make the database full: cap its pages where they are, then fill every table's pages."""
    db = store.db
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    conv = db.execute("SELECT id FROM conversations LIMIT 1").fetchone()
    inserts = [
        ("INSERT INTO kv(key, value) VALUES(?, ?)", lambda i, x: (f"junk{len(x)}.{i}", x)),
        (
            "INSERT INTO documents(title, body, created, updated) VALUES(?,?,0,0)",
            lambda i, x: ("j", x),
        ),
        ("INSERT INTO conversations(title, created, updated) VALUES(?,0,0)", lambda i, x: (x,)),
    ]
    if conv is not None:
        sql = "INSERT INTO messages(conversation_id, role, content, created) VALUES(?,?,?,0)"
        inserts.append((sql, lambda i, x: (conv[0], "user", x)))
    for sql, args in inserts:
        for size in (4000, 500, 50, 5, 1):
            for i in range(100_000):
                try:
                    db.execute(sql, args(i, "x" * size))
                except sqlite3.OperationalError:
                    break


def unfill(store: Store) -> None:
    store.db.execute("PRAGMA max_page_count = 1073741823")


def make_app(data: Path) -> AppController:
    s = Settings(first_run_done=True, mode=MODE_IN_PROCESS, model=str(data / "no-model"))
    return AppController(InlineExecutor(), data, settings=s)


# ----------------------------------------------------------------------------- defect 7


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_the_data_folder_database_wal_and_exports_are_private(tmp_path: Path, umask022: None):
    d = data_dir(tmp_path / "veil")
    st = Store.open(d)
    st.set("k", 1)  # the WAL and SHM files exist while the database is open
    files = [d / "veil.sqlite3", d / "veil.sqlite3-wal", d / "veil.sqlite3-shm"]
    assert mode(d) == 0o700
    assert [mode(f) for f in files] == [0o600] * 3
    # an install made before: folder 0755, files 0644 -> tightened on the next start
    os.chmod(d, 0o755)
    for f in files:
        os.chmod(f, 0o644)
    again = Store.open(data_dir(d))
    assert mode(d) == 0o700 and [mode(f) for f in files] == [0o600] * 3
    again.close()
    st.close()
    # exports go through a private temporary file
    app = make_app(d)
    doc = app.drafting.new_document("Plan", "private plans")
    out = tmp_path / "plan.md"
    app.drafting.export(doc, out)
    assert mode(out) == 0o600 and "private plans" in out.read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    write_private_file(out, "replaced")
    assert out.read_text() == "replaced" and mode(out) == 0o600
    app.close()


def test_a_chosen_data_dir_that_is_not_veils_keeps_its_mode(tmp_path: Path, umask022: None):
    other = tmp_path / "documents"
    other.mkdir()
    (other / "letter.txt").write_text("hi")
    os.chmod(other, 0o755)
    assert data_dir(other) == other and mode(other) == 0o755


# ----------------------------------------------------------------------------- defect 6


def test_a_full_disk_reports_one_line_and_loses_nothing_typed(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    errors: list[StorageError] = []
    app.store.failed.connect(errors.append)
    doc = app.drafting.new_document("Plan", "first")
    conv = app.chat.new_conversation()
    fill(app.store)
    body = "the long text I typed " * 3000
    app.drafting.save(body)  # no exception: reported, remembered
    app.chat.save_draft("a message I am writing " * 500)
    assert errors and all("\n" not in str(e) for e in errors)
    assert "is full" in errors[0].message and "still in the window" in (errors[0].hint or "")
    assert f"document {doc}" in app.store.unsaved
    assert f"the unsent message in chat {conv}" in app.store.unsaved
    # sending on a full disk: refused with the banner, the text stays with the user
    n = len(errors)
    assert app.chat.send("hello there") is False
    assert len(errors) > n and not [m for m in app.chat.messages() if m.content == "hello there"]
    # space again: the next save goes through and nothing is pending
    unfill(app.store)
    app.drafting.save(body)
    app.chat.save_draft("a message I am writing")
    assert app.store.unsaved == {}
    assert app.store.document(doc).body == body  # type: ignore[union-attr]
    app.close()


# ----------------------------------------------------------------------------- defect 8


def test_a_damaged_database_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "veil.sqlite3").write_bytes(b"not a database at all " * 200)
    with pytest.raises(StorageError) as ei:
        Store.open(tmp_path)
    assert "damaged" in ei.value.message and "move the file away" in (ei.value.hint or "")


def test_a_corrupt_page_is_found_at_start(tmp_path: Path) -> None:
    st = Store.open(tmp_path)
    conv = st.create_conversation("A")
    for i in range(60):
        st.add_message(conv, "user", f"message {i} " * 300)
    st.close()
    db = tmp_path / "veil.sqlite3"
    data = bytearray(db.read_bytes())
    page = 4096
    assert len(data) > 6 * page
    data[3 * page : 4 * page] = b"\xff" * page  # one page of a table is garbage
    db.write_bytes(bytes(data))
    with pytest.raises(StorageError, match="damaged"):
        Store.open(tmp_path)


def test_a_read_only_database_gets_read_only_advice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Store.open(tmp_path).close()
    real = sqlite3.connect

    def read_only(path: str, **kw: Any) -> sqlite3.Connection:
        return real(f"file:{path}?mode=ro", uri=True, **kw)

    monkeypatch.setattr(storage.sqlite3, "connect", read_only)
    with pytest.raises(StorageError) as ei:
        Store.open(tmp_path)
    err = ei.value
    assert "read-only" in err.message and "writable" in (err.hint or "")
    assert "move the file away" not in str(err)


@pytest.mark.gui
def test_a_damaged_database_at_start_exits_cleanly_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "veil.sqlite3").write_bytes(b"garbage" * 1000)
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("veil: error: ") and "damaged" in lines[0]


@pytest.mark.gui
def test_the_window_shows_the_banner_keeps_the_text_and_warns_on_close(
    qtbot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.main_window import create, parse_args

    app, window = create(parse_args(["--theme", "light"]), str(tmp_path))
    qtbot.addWidget(window)
    window.show()
    window.show_pane("drafting")
    app.drafting.new_document("Plan", "x")
    fill(app.store)
    pane = window.drafting_pane
    pane.editor.setPlainText("my important text " * 500)
    pane.save_now()
    assert pane.error.isVisible() and "is full" in pane.error.text()
    assert pane.editor.toPlainText().startswith("my important text")
    asked: list[dict[str, str]] = []
    answer = [False]
    monkeypatch.setattr(window, "confirm_close_unsaved", lambda u: asked.append(u) or answer[0])
    window.close()
    assert len(asked) == 1 and "document 1" in asked[0] and window.isVisible()  # kept open
    answer[0] = True
    window.close()
    assert len(asked) == 2 and not window.isVisible()
