"""Where the organisation key lives: the key store of this computer's own keys (engine/keys.py),
not the data folder; the key file of earlier versions moves there on first read."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.core import org_key
from engine import keys
from engine.errors import KeyStoreError
from engine.keyed.transform import KeyedError, OrgKey

KEY = OrgKey(bytes(range(32)))
OTHER = OrgKey(bytes(range(32, 64)))


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[tuple[str, str], str]]:
    """VEIL_KEYRING=memory, fresh for each test: the backend's dict."""
    monkeypatch.setenv("VEIL_KEYRING", "memory")
    monkeypatch.setattr(keys, "_backend", None)
    monkeypatch.setattr(keys, "_backend_kind", None)
    monkeypatch.setattr(org_key, "_warned", set())
    yield keys.backend().store


@pytest.fixture
def data(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    return folder


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_import_keeps_the_secret_in_the_key_store_and_only_a_note_in_the_data_folder(
    store: dict[tuple[str, str], str], data: Path, tmp_path: Path
) -> None:
    src = tmp_path / "from-it.key"
    KEY.save(src)
    assert org_key.installed(data) is None
    assert org_key.import_key(data, src) == KEY
    assert store[(keys.SERVICE, org_key.ENTRY)].split() == KEY.to_text().split()
    assert not org_key.key_path(data).exists()
    note = org_key.info_path(data).read_text()
    assert KEY.key_id in note and KEY.secret.hex() not in note
    assert [p.name for p in data.iterdir()] == [org_key.INFO_FILE]
    assert org_key.installed(data) == KEY
    rotated = tmp_path / "rotated.key"
    OTHER.save(rotated)
    assert org_key.import_key(data, rotated) == OTHER  # one entry: the new key replaces it
    assert org_key.installed(data) == OTHER and len(store) == 1
    assert "key store" in org_key.EXPLANATION and "cannot recover" in org_key.EXPLANATION


def test_a_computer_that_never_imported_a_key_does_not_open_the_key_store(
    monkeypatch: pytest.MonkeyPatch, data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def no_store() -> Any:
        raise AssertionError("the key store was opened")

    monkeypatch.setattr(keys, "backend", no_store)
    assert org_key.installed(data) is None and not warnings(caplog)


def test_the_key_file_of_earlier_versions_moves_into_the_key_store(
    store: dict[tuple[str, str], str], data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    KEY.save(org_key.key_path(data))
    with caplog.at_level(logging.INFO, logger="veil.app"):
        assert org_key.installed(data) == KEY
    assert not org_key.key_path(data).exists()
    assert keys.org_key_text() == KEY.to_text()
    assert KEY.key_id in org_key.info_path(data).read_text()
    assert any("moved the organisation key" in m for m in caplog.messages)
    assert not warnings(caplog)
    assert org_key.installed(data) == KEY  # from the key store now


class FailingStore:
    """A key store that cannot write (``lies``: it writes, but gives another key back)."""

    def __init__(self, lies: bool = False) -> None:
        self.lies = lies
        self.kept: dict[str, str] = {}

    def get_password(self, service: str, name: str) -> str | None:
        if self.lies and name in self.kept:
            return OrgKey(bytes(32)).to_text()
        return self.kept.get(name)

    def set_password(self, service: str, name: str, value: str) -> None:
        if not self.lies:
            raise RuntimeError("the keyring is locked")
        self.kept[name] = value

    def delete_password(self, service: str, name: str) -> None:
        self.kept.pop(name, None)


@pytest.mark.parametrize("lies", [False, True], ids=["write-fails", "reads-back-wrong"])
def test_a_key_store_that_cannot_keep_the_key_leaves_the_old_file_in_use(
    monkeypatch: pytest.MonkeyPatch,
    data: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    lies: bool,
) -> None:
    monkeypatch.setenv("VEIL_KEYRING", "memory")
    monkeypatch.setattr(keys, "_backend", FailingStore(lies))
    monkeypatch.setattr(keys, "_backend_kind", "memory")
    monkeypatch.setattr(org_key, "_warned", set())
    old = org_key.key_path(data)
    KEY.save(old)
    for _ in range(3):  # the key is read before every reply: one log line, not three
        assert org_key.installed(data) == KEY
    assert old.read_text() == KEY.to_text()
    (line,) = warnings(caplog)
    assert "\n" not in line and str(old) in line and "key store cannot keep it" in line
    # importing (a rotated key) fails in one line and the old file, the key in use, stays
    src = tmp_path / "rotated.key"
    OTHER.save(src)
    with pytest.raises(KeyStoreError) as err:
        org_key.import_key(data, src)
    assert "\n" not in str(err.value)
    assert org_key.installed(data) == KEY


def test_without_a_key_store_import_says_what_the_client_keys_say(
    monkeypatch: pytest.MonkeyPatch, data: Path, tmp_path: Path
) -> None:
    def no_store() -> Any:
        raise KeyStoreError("no OS keyring", hint=keys.FALLBACK_HINT)

    monkeypatch.setattr(keys, "backend", no_store)
    src = tmp_path / "it.key"
    KEY.save(src)
    with pytest.raises(KeyStoreError) as err:
        org_key.import_key(data, src)
    msg = str(err.value)
    assert "\n" not in msg and "no OS keyring" in msg and "VEIL_KEYRING=file" in msg
    assert list(data.iterdir()) == []  # no fallback file of its own


def test_remove_clears_the_key_store_and_any_leftover_file(
    store: dict[tuple[str, str], str], data: Path, tmp_path: Path
) -> None:
    src = tmp_path / "it.key"
    KEY.save(src)
    org_key.import_key(data, src)
    OTHER.save(org_key.key_path(data))  # a leftover from an earlier version
    org_key.forget(data)
    assert store == {} and list(data.iterdir()) == []
    assert org_key.installed(data) is None
    org_key.forget(data)  # nothing left: no error


@pytest.mark.parametrize(
    ("stored", "says"),
    [
        ("veil-org-key-v1 not-hexadecimal", "is damaged"),
        ("veil-org-key-v1 " + "ab" * 5, "is damaged"),
        ("garbage", "not a Veil organisation key"),
        (None, "is gone"),
    ],
)
def test_a_damaged_or_missing_stored_key_is_one_clear_line(
    store: dict[tuple[str, str], str],
    data: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    stored: str | None,
    says: str,
) -> None:
    src = tmp_path / "it.key"
    KEY.save(src)
    org_key.import_key(data, src)
    if stored is None:
        store.clear()
    else:
        store[(keys.SERVICE, org_key.ENTRY)] = stored
    with pytest.raises(KeyedError) as err:
        org_key.load(data)
    msg = str(err.value)
    assert "\n" not in msg and says in msg and "import the key file" in msg
    assert "key store" in msg
    assert org_key.installed(data) is None and org_key.installed(data) is None
    (line,) = warnings(caplog)
    assert "\n" not in line and says in line
