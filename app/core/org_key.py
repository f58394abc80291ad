"""The organisation key on this computer: imported once into the app's data folder (mode 0600)
from the file IT gives out, and used when the organisation's server runs a keyed model
(``veil-trunk keyed-model``). Qt-free."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from engine.keyed.transform import KeyedError, OrgKey

log = logging.getLogger("veil.app")

KEY_FILE = "organisation.key"

EXPLANATION = (
    "If your IT department says your organisation's server uses an organisation key, import "
    "the key file they gave you: the server's model works only together with that key. Veil "
    "keeps a copy that only you can read. If you lose it, IT must give it to you again: the "
    "server does not have it and cannot recover it."
)


def key_path(folder: Path) -> Path:
    return folder / KEY_FILE


def installed(folder: Path) -> OrgKey | None:
    """The imported key, or None (none imported, or the copy is damaged: logged)."""
    path = key_path(folder)
    if not path.is_file():
        return None
    try:
        return OrgKey.load(path)
    except KeyedError as exc:
        log.warning("the organisation key in the data folder cannot be used: %s", exc)
        return None


def import_key(folder: Path, source: Path) -> OrgKey:
    """Check ``source`` and keep a copy readable by this user only (it replaces an earlier key:
    IT rotates keys). One-line :class:`KeyedError` for a file that is not a key."""
    key = OrgKey.load(source)
    dest = key_path(folder)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.to_text())
        os.replace(tmp, dest)
    except OSError as exc:
        raise KeyedError(f"cannot keep the key in {folder}: {exc.strerror}") from None
    return key


def forget(folder: Path) -> None:
    """Remove the imported key (the server's keyed model then refuses this computer)."""
    key_path(folder).unlink(missing_ok=True)


def status_text(key: OrgKey | None) -> str:
    if key is None:
        return "No organisation key (only needed if IT says your server uses one)"
    return f"Organisation key {key.key_id} imported"
