"""The app's log file: what "the details are in the log" points to (issue 30).

A rotating file (``veil.log``, 1 MB, 3 old copies) in the user's log folder (platformdirs:
``~/.local/state/veil/log`` on Linux, ``~/Library/Logs/veil`` on macOS,
``%LOCALAPPDATA%\\veil\\Logs`` on Windows; ``$VEIL_LOG_DIR`` overrides it), private (0600 in a
0700 folder on POSIX). It never holds what the user wrote or a key: every line, tracebacks
included, goes through :func:`scrub`, which removes invite codes, CurveZMQ keys and any run of
text the app holds as a chat message, chat title, style or document (the storage layer hands
them to :func:`remember` as it reads and writes them).

Qt-free.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

LOG_NAME = "veil.log"
MAX_BYTES = 1_000_000
BACKUPS = 3
REMOVED = "[removed]"
SHINGLE = 4  # this many words in a row from a private text are removed wherever they appear
MAX_SHINGLES = 200_000
MAX_LINES = 20_000
MAX_TEXTS = 1_000
MIN_LINE = 4  # shorter lines are matched only as part of a longer run of words

# an invite code, and a 40-character Z85 CurveZMQ key standing on its own
_INVITE = re.compile(r"veil1:[A-Za-z0-9_=-]+")
_Z85 = r"0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#"
_KEY = re.compile(rf"(?<![{_Z85}])[{_Z85}]{{40}}(?![{_Z85}])")
_WORD = re.compile(r"\w+")


class PrivateTexts:
    """What the user wrote, as far as the app holds it, in a form :meth:`scrub` can find:
    every line, and every run of :data:`SHINGLE` words (so a fragment quoted in an error is
    found too). Bounded: the oldest are forgotten first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, None] = OrderedDict()  # whole texts already taken in
        self._lines: OrderedDict[str, None] = OrderedDict()
        self._shingles: OrderedDict[tuple[str, ...], None] = OrderedDict()

    def remember(self, *texts: str | None) -> None:
        with self._lock:
            for text in texts:
                if not text or text in self._seen:
                    continue
                self._seen[text] = None
                for line in text.splitlines():
                    line = line.strip()
                    if len(line) >= MIN_LINE:
                        self._lines[line] = None
                words = [w.lower() for w in _WORD.findall(text)]
                for i in range(len(words) - SHINGLE + 1):
                    self._shingles[tuple(words[i : i + SHINGLE])] = None
            for store, most in (
                (self._seen, MAX_TEXTS),
                (self._lines, MAX_LINES),
                (self._shingles, MAX_SHINGLES),
            ):
                while len(store) > most:
                    store.popitem(last=False)  # type: ignore[attr-defined]

    def scrub(self, text: str) -> str:
        with self._lock:
            lines = sorted(self._lines, key=len, reverse=True)
            shingles = set(self._shingles)
        for line in lines:
            if line in text:
                text = text.replace(line, REMOVED)
        spans = [(m.start(), m.end(), m.group().lower()) for m in _WORD.finditer(text)]
        hit = [False] * len(spans)
        for i in range(len(spans) - SHINGLE + 1):
            if tuple(w for _s, _e, w in spans[i : i + SHINGLE]) in shingles:
                hit[i : i + SHINGLE] = [True] * SHINGLE
        out, pos, i = [], 0, 0
        while i < len(spans):
            if not hit[i]:
                i += 1
                continue
            j = i
            while j + 1 < len(spans) and hit[j + 1]:
                j += 1
            out += [text[pos : spans[i][0]], REMOVED]
            pos, i = spans[j][1], j + 1
        out.append(text[pos:])
        return "".join(out)

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()
            self._lines.clear()
            self._shingles.clear()


PRIVATE = PrivateTexts()


def remember(*texts: str | None) -> None:
    """Texts the log must never contain (a message, a title, a document)."""
    PRIVATE.remember(*texts)


def scrub(text: str) -> str:
    """``text`` without invite codes, keys or anything :func:`remember` was given."""
    text = _INVITE.sub("veil1:" + REMOVED, text)
    text = _KEY.sub(REMOVED, text)
    return PRIVATE.scrub(text)


class ScrubbingFormatter(logging.Formatter):
    """Formats a record (its traceback too), then scrubs the whole text."""

    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record))


def log_dir() -> Path:
    override = os.environ.get("VEIL_LOG_DIR", "").strip()
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_log_dir("veil", appauthor=False))


def log_path() -> Path:
    return log_dir() / LOG_NAME


class _PrivateRotatingHandler(logging.handlers.RotatingFileHandler):
    """A rotating file whose every copy is created 0600."""

    def _open(self):  # type: ignore[no-untyped-def]
        if os.name == "posix" and not os.path.exists(self.baseFilename):
            os.close(os.open(self.baseFilename, os.O_CREAT | os.O_WRONLY, 0o600))
        return super()._open()


_handler: logging.Handler | None = None


def setup(level: int = logging.INFO) -> Path | None:
    """Log to stderr (warnings) and to the private, rotating, scrubbed file (``level`` and up,
    with tracebacks). Returns the file's path, or None when the folder cannot be written (the
    app then logs to stderr only and says so there). Safe to call twice."""
    global _handler
    root = logging.getLogger()
    if not any(getattr(h, "veil_stderr", False) for h in root.handlers):
        err = logging.StreamHandler()
        err.setLevel(logging.WARNING)
        err.setFormatter(ScrubbingFormatter("%(levelname)s %(name)s: %(message)s"))
        err.veil_stderr = True  # type: ignore[attr-defined]
        root.addHandler(err)
    root.setLevel(min(root.level or logging.WARNING, level))
    if _handler is not None:
        return log_path()
    folder = log_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.name == "posix":
            os.chmod(folder, 0o700)
        handler = _PrivateRotatingHandler(
            folder / LOG_NAME, maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8"
        )
    except OSError as exc:
        logging.getLogger("veil.app").warning("cannot write the log in %s: %s", folder, exc)
        return None
    handler.setLevel(level)
    handler.setFormatter(ScrubbingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    _handler = handler
    return folder / LOG_NAME


def current() -> Path | None:
    """The file the app logs to now (None when it logs to stderr only)."""
    return Path(_handler.baseFilename) if isinstance(_handler, logging.FileHandler) else None


def shutdown() -> None:
    """Close the file (tests; the app's exit does it through logging.shutdown)."""
    global _handler
    if _handler is not None:
        logging.getLogger().removeHandler(_handler)
        _handler.close()
        _handler = None
