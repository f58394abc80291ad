"""Where the app keeps its data: ``--data-dir`` > ``$VEIL_DATA_DIR`` > the platform's user data
dir (``~/.local/share/veil`` on Linux)."""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import VeilError


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
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VeilError(
            f"cannot create the data folder {path}: {exc.strerror}",
            hint="choose another folder with --data-dir or VEIL_DATA_DIR",
        ) from None
    return path
