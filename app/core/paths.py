"""Where the app keeps its data: ``--data-dir`` > ``$VEIL_DATA_DIR`` > the platform's user data
dir (``~/.local/share/veil`` on Linux). The folder is private (mode 0700 on POSIX)."""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import VeilError

PRIVATE_DIR = 0o700


def data_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The data folder (created if missing)."""
    if override:
        path = Path(override).expanduser()
    elif os.environ.get("VEIL_DATA_DIR"):
        path = Path(os.environ["VEIL_DATA_DIR"]).expanduser()
    else:
        import platformdirs

        path = Path(platformdirs.user_data_dir("veil", appauthor=False))
    try:
        path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        if os.name == "posix" and (_is_veil_folder(path) or not any(path.iterdir())):
            os.chmod(path, PRIVATE_DIR)  # chats are private: tighten existing installs too
    except OSError as exc:
        raise VeilError(
            f"cannot create the data folder {path}: {exc.strerror}",
            hint="choose another folder with --data-dir or VEIL_DATA_DIR",
        ) from None
    return path


def _is_veil_folder(path: Path) -> bool:
    """A folder Veil keeps its data in (not, say, a --data-dir pointing at ~/Documents, whose
    mode is the user's business; the database in it is private either way)."""
    return (path / "veil.sqlite3").exists()
