"""The organisation key on this computer, used when the organisation's server runs a keyed model
(``veil-trunk keyed-model``). Qt-free.

Importing the file IT gives out keeps its secret where this computer's own keys are kept
(:mod:`engine.keys`: the OS keyring, or the store ``VEIL_KEYRING`` chooses), in the single
entry ``org-key`` of the service ``veil`` (importing another key replaces it: IT rotates keys).
The data folder keeps only a note that a key was imported (``organisation-key.json``: the key's
public id and when), so that a computer where no key was ever imported never opens the keyring
for it. Without a usable keyring, importing fails with the same one line as the client keys
(:class:`KeyStoreError`, naming the opt-in stores); nothing falls back to a plain file.

Versions before this one kept the key in the data folder (``organisation.key``, mode 0600). The
first read moves such a file into the keyring: write, read back and compare, and only then
delete the file. If the keyring cannot keep it, the file stays and is used (logged once).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path

from engine import keys
from engine.errors import KeyStoreError, VeilError
from engine.keyed.transform import KeyedError, OrgKey

log = logging.getLogger("veil.app")

KEY_FILE = "organisation.key"  # where versions before the keyring kept the key (migrated)
INFO_FILE = "organisation-key.json"  # the note that a key was imported: id and time, no secret
ENTRY = keys.ORG_KEY
IN_STORE = "the organisation key in the key store"
AGAIN = "import the key file from your IT department again"

EXPLANATION = (
    "If your IT department says your organisation's server uses an organisation key, import "
    "the key file they gave you: the server's model works only together with that key. Veil "
    "keeps it with this computer's own key, in the key store named above (the system keyring "
    "unless VEIL_KEYRING chooses another), not in its data folder. If you lose it (a new "
    "computer, a reset keyring, or a store that forgets at exit), IT must give it to you "
    "again: the server does not have it and cannot recover it."
)

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """One log line per problem per run (the key is read before every reply)."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def key_path(folder: Path) -> Path:
    """The key file of earlier versions (moved into the keyring on first read)."""
    return folder / KEY_FILE


def info_path(folder: Path) -> Path:
    return folder / INFO_FILE


def _write_info(folder: Path, key: OrgKey) -> None:
    dest = info_path(folder)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.unlink(missing_ok=True)
    note = {"key_id": key.key_id, "imported": datetime.now(UTC).isoformat(timespec="seconds")}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(note, f)
    os.replace(tmp, dest)


def _store(key: OrgKey) -> None:
    """Keep ``key`` in the key store and check that the store gives the same key back."""
    keys.save_org_key_text(key.to_text())
    back = keys.org_key_text()
    if back is None or back.split() != key.to_text().split():
        raise KeyStoreError(
            "the keyring gave back another key than the organisation key written to it",
            hint="VEIL_KEYRING=file, encrypted or memory chooses another store",
        )


def _migrate(folder: Path) -> OrgKey:
    """The key of the old file; moved into the key store when it can keep it (else the file
    stays and is used: logged once)."""
    old = key_path(folder)
    key = OrgKey.load(old)  # a damaged old file: KeyedError, and the file stays
    try:
        _store(key)
    except VeilError as exc:
        _warn_once(f"the organisation key stays in {old}: the key store cannot keep it ({exc})")
        return key
    try:
        _write_info(folder, key)
        old.unlink()
    except OSError as exc:
        _warn_once(f"the organisation key is in the key store but {old} stays: {exc.strerror}")
        return key
    log.info("moved the organisation key %s from %s into the key store", key.key_id, old)
    return key


def load(folder: Path) -> OrgKey | None:
    """The imported key (None: none imported). Raises a one-line :class:`VeilError` when a key
    was imported but cannot be used: damaged, gone from the key store, or no key store."""
    if key_path(folder).is_file():
        return _migrate(folder)
    if not info_path(folder).is_file():
        return None  # never imported here: the keyring is not opened for it
    text = keys.org_key_text()
    if text is None:
        raise KeyedError(f"{IN_STORE} is gone (removed, or the store forgot it)", hint=AGAIN)
    try:
        return OrgKey.from_text(text, IN_STORE)
    except KeyedError as exc:
        raise KeyedError(exc.message, hint=AGAIN) from None


def installed(folder: Path) -> OrgKey | None:
    """The imported key, or None (none imported, or it cannot be used: logged once)."""
    try:
        return load(folder)
    except VeilError as exc:
        _warn_once(f"the organisation key cannot be used: {exc}")
        return None


def import_key(folder: Path, source: Path) -> OrgKey:
    """Check ``source`` and keep its key in the key store (it replaces an earlier key: IT
    rotates keys). One-line :class:`KeyedError` for a file that is not a key,
    :class:`KeyStoreError` when there is no usable key store (the earlier key, if any, stays)."""
    key = OrgKey.load(source)
    _store(key)
    try:
        _write_info(folder, key)
    except OSError as exc:
        raise KeyedError(f"cannot note the key in {folder}: {exc.strerror}") from None
    key_path(folder).unlink(missing_ok=True)  # an earlier version's copy of an earlier key
    _warned.clear()
    return key


def forget(folder: Path) -> None:
    """Remove the imported key: from the key store and the data folder (the server's keyed
    model then refuses this computer). Without a usable key store nothing was kept in it: the
    files go and the reason is logged."""
    try:
        keys.delete_org_key_text()
    except KeyStoreError as exc:
        log.warning("the key store could not be cleared of the organisation key: %s", exc)
    for path in (key_path(folder), info_path(folder)):
        path.unlink(missing_ok=True)
        path.with_name(path.name + ".tmp").unlink(missing_ok=True)
    _warned.clear()


def status_text(key: OrgKey | None) -> str:
    if key is None:
        return "No organisation key (only needed if IT says your server uses one)"
    return f"Organisation key {key.key_id} imported"
