"""The client allow-list: ``allowed_clients.txt``, one Z85 public key per line, optionally
followed by whitespace and a note; other lines (``# comment``) are ignored.

:class:`AllowList` is what the server asks — at every handshake and for every message — so
``veil-trunk allow`` / ``revoke`` take effect without a restart. It re-reads the file when its
``stat`` signature changes *or* at least every ``interval_s``, and compares the content's hash:
two edits within one timestamp tick (same mtime and size) are still seen. A change that removes
keys is confirmed by a second read, so a file caught half-written (an editor that truncates and
rewrites) never revokes everyone for a moment. A read that fails (no free file descriptor, no
permission, an I/O error) changes nothing: the last list read stays in force, the failure is
logged once, and the file is read again at the next question. Only a file that is gone counts
as an empty list. ``allow``/``revoke`` write atomically, and a line they add is
``KEY  # NOTE`` with a note that cannot break the line (:func:`note_problem`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import unicodedata
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("veil.trunk")

CONFIRM_S = 0.05  # pause before the confirming read of a change that removes keys
MAX_NOTE = 200  # characters in the note ``allow --name`` stores next to a key
# control and format characters, line and paragraph separators, lone surrogates (undecodable
# bytes in argv): each could end a line (``str.splitlines`` splits at \x1c-\x1e, \x85, U+2028...)
# or hide part of one in a terminal
_NOT_IN_NOTES = ("Cc", "Cf", "Cs", "Zl", "Zp")


def line_key(line: str) -> str | None:
    """The key on one allow-list line, or None for comments and blank lines."""
    parts = line.split()
    # a z85 key may start with '#', so a comment is any line whose first word is not a key
    return parts[0] if parts and len(parts[0]) == 40 else None


def parse_allow_list(text: str) -> set[str]:
    return {k for k in (line_key(ln) for ln in text.splitlines()) if k}


def read_allow_list(path: Path) -> set[str]:
    """The keys in an allow-list file (none when it does not exist)."""
    if not path.is_file():
        return set()
    return parse_allow_list(path.read_text())


def note_problem(note: str) -> str | None:
    """Why ``note`` cannot be stored next to a key on its line (None when it can)."""
    if len(note) > MAX_NOTE:
        return f"a name is at most {MAX_NOTE} characters"
    for ch in note:
        if unicodedata.category(ch) in _NOT_IN_NOTES:
            return f"a name cannot contain control characters or line breaks (U+{ord(ch):04X})"
    return None


def allow_line(key: str, note: str = "") -> str:
    """The allow-list line for ``key`` (a checked key) with its note; ValueError for a note
    that could break the line."""
    problem = note_problem(note)
    if problem is not None:
        raise ValueError(problem)
    line = key + (f"  # {note}" if note else "") + "\n"
    assert len(line.splitlines()) == 1 and line_key(line) == key
    return line


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (mode 0600) so a reader sees the old or the new file."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class AllowList:
    """The allow-list file (and keys fixed at start), re-read when its content changes."""

    def __init__(self, path: Path | None, fixed: Iterable[str] = (), interval_s: float = 1.0):
        self.path = path
        self.fixed = set(fixed)
        self.keys: set[str] = set()
        self.interval_s = interval_s
        self._sig: tuple[int, int, int] | None = None
        self._digest: bytes | None = None
        self._read_at = float("-inf")
        self.failing: OSError | None = None  # the error of the last read, until one works

    def _read(self) -> bytes | None:
        """The file's bytes (empty when it does not exist), or None when it cannot be read."""
        assert self.path is not None
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""  # gone: nobody is allowed
        except OSError as exc:
            if self.failing is None:
                log.warning(
                    "cannot read the allow-list %s (%s): the last list read (%d keys) stays in "
                    "force until it can be read again",
                    self.path,
                    exc.strerror or exc,
                    len(self.keys),
                )
            self.failing = exc
            return None
        if self.failing is not None:
            log.info("the allow-list %s can be read again", self.path)
            self.failing = None
        return data

    def refresh(self) -> None:
        """Re-read the file if its stat signature changed or ``interval_s`` has passed."""
        if self.path is None:
            return
        try:
            st = self.path.stat()
            sig: tuple[int, int, int] | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            sig = None
        now = time.monotonic()
        if sig == self._sig and now - self._read_at < self.interval_s:
            return
        self._read_at = now
        data = self._read()
        if data is None:
            return  # keep the last list; try again at the next question
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if digest != self._digest:
            keys = parse_allow_list(data.decode("utf-8", "replace"))
            if self.keys - keys:  # something was revoked: make sure the file is complete
                time.sleep(CONFIRM_S)
                if self._read() != data:
                    return  # still being written (or unreadable now); look again next time
            self.keys, self._digest = keys, digest
        self._sig = sig

    def __call__(self, key: str) -> bool:
        self.refresh()
        return key in self.fixed or key in self.keys
