"""Which draft head a client drafts with: the one shipped for its model (found by fingerprint),
one the user names, or none."""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

from engine.delivery.part import HEAD_FILE
from engine.drafts.head import (
    DraftHead,
    DraftHeadError,
    find_shipped_head,
    load_head,
    model_fingerprint,
)

log = logging.getLogger("veil.drafts")

_FINGERPRINTS: weakref.WeakKeyDictionary[Any, tuple[str, str]] = weakref.WeakKeyDictionary()
_AUTO: weakref.WeakKeyDictionary[Any, DraftHead | None] = weakref.WeakKeyDictionary()


def client_fingerprint(client: Any) -> tuple[str, str]:
    """The model fingerprint of a :class:`engine.split.ClientModel` (computed once)."""
    fp = _FINGERPRINTS.get(client)
    if fp is None:
        fp = _delivered_fingerprint(client) or model_fingerprint(client.reader, client.config)
        _FINGERPRINTS[client] = fp
    return fp


def _delivered_fingerprint(client: Any) -> tuple[str, str] | None:
    """The whole model's fingerprint for a client part from the trunk server: the part lacks
    the trunk's tensors, so it is taken from the part's signed manifest (None otherwise)."""
    from engine.delivery.fetch import part_info

    resolved = getattr(client, "resolved", None)
    if resolved is None or type(client.reader).__name__ == "OverlayReader":
        return None
    info = part_info(resolved.folder)
    fp = info.get("model_fp") if info else None
    if not isinstance(fp, list) or len(fp) != 2 or fp[0] != client.config.fingerprint():
        return None
    return str(fp[0]), str(fp[1])


def check_split(head: DraftHead, client: Any) -> str | None:
    """Why ``client``'s current split cannot feed ``head`` (None: it can)."""
    taps = tuple(client.tap_layers())
    if taps == head.feature_layers:
        return None
    h, t, n = head.feature_layers
    return (
        f"the draft head was trained for a split with {h} head and {n - t} tail layers on this "
        f"computer; the current split has {taps[0]} and {taps[2] - taps[1]}"
    )


def load_for_client(path: str | Path, client: Any) -> DraftHead:
    """A head file the user named, for this client; one clear error when it does not fit."""
    head = load_head(path, client_fingerprint(client))
    why = check_split(head, client)
    if why:
        raise DraftHeadError(why)
    return head


def auto_head(client: Any) -> DraftHead | None:
    """The head shipped with Veil for this client's model, if there is one (None otherwise).
    A head for a split other than the current one is kept: drafting resumes with it when the
    split matches again."""
    if client in _AUTO:
        return _AUTO[client]
    head = None
    resolved = getattr(client, "resolved", None)
    delivered = Path(resolved.folder) / HEAD_FILE if resolved is not None else None
    if delivered is not None and delivered.is_file():
        path: Path | None = delivered  # the head that came with the server's model
    else:
        path = find_shipped_head(client.config.fingerprint())
    if path is not None:
        try:
            head = load_head(path, client_fingerprint(client))
        except DraftHeadError as exc:
            log.info("not using the shipped draft head: %s", exc)
    _AUTO[client] = head
    return head


def parse_head_choice(value: str | None, client: Any) -> str | DraftHead:
    """``--draft-head`` / a setting: ``auto`` (default), ``none``, or a file path."""
    v = (value or "auto").strip()
    if v.lower() in ("auto", "none"):
        return v.lower()
    return load_for_client(v, client)
