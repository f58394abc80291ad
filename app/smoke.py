"""``veil --smoke-test OUT.png [--pane chat|drafting]``: start the app with the built-in demo
server and the default model, write one reply (or one drafting suggestion), save a screenshot
of the main window, and exit 0 — or 1 with one clear line on failure."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from PySide6.QtCore import QEventLoop, QTimer
from PySide6.QtWidgets import QApplication

from app.core.settings import MODE_DEMO
from engine.errors import VeilError
from engine.loading import DEFAULT_MODEL

CHAT_PROMPT = "In two sentences, why should an office protect its customers' data?"
DOC_TITLE = "Note to the team"
DOC_TEXT = (
    "Hi all,\n\n"
    "hey so the printer on floor 2 is broke again, dont send stuff to it till friday ok. "
    "use the one near reception instead.\n\n"
    "Thanks,\nSam"
)
SELECT = "hey so the printer on floor 2 is broke again, dont send stuff to it till friday ok."
TIMEOUT_S = 900


def run_smoke(args: argparse.Namespace) -> int:
    out = Path(args.smoke_test)
    tmp = None if args.data_dir else tempfile.mkdtemp(prefix="veil-smoke-")
    try:
        return _run(args, out, args.data_dir or tmp)
    except VeilError as exc:
        print(f"veil: error: smoke test failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # never a traceback: one line, exit 1
        print(f"veil: error: smoke test failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace, out: Path, data_dir: str | None) -> int:
    from app.main_window import create

    if not args.theme:
        args.theme = "light"
    app, window = create(args, data_dir)
    s = app.settings
    s.first_run_done, s.mode = True, MODE_DEMO
    s.model = args.model or DEFAULT_MODEL
    s.max_tokens = args.max_tokens
    app.apply_settings(s)
    window.resize(1280, 800)
    window.show()
    window.show_pane(args.pane)
    loop = QEventLoop()
    result: dict[str, object] = {}
    t0 = time.perf_counter()

    def ok(text: str, tokens: int) -> None:
        result.update(ok=True, text=text, tokens=tokens)
        QTimer.singleShot(400, loop.quit)  # let the last text render

    def fail(err: object) -> None:
        result.update(ok=False, error=str(err))
        loop.quit()

    app.load_failed.connect(fail)
    app.load_config()
    if args.pane == "chat":
        app.chat.failed.connect(lambda e, _t: fail(e))
        app.chat.finished.connect(lambda r: ok(r.text, r.stats.new_tokens))
        app.chat.new_conversation()
        window.chat_view.composer.setPlainText(CHAT_PROMPT)
        window.chat_view.send_or_stop()
    else:
        d = app.drafting
        d.failed.connect(fail)
        d.suggestion_finished.connect(lambda sg: None if sg.error else ok(sg.text, 0))
        d.new_document(DOC_TITLE, DOC_TEXT)
        pane = window.drafting_pane
        start = DOC_TEXT.index(SELECT)
        from PySide6.QtGui import QTextCursor

        c = pane.editor.textCursor()
        c.setPosition(start)
        c.setPosition(start + len(SELECT), QTextCursor.MoveMode.KeepAnchor)
        pane.editor.setTextCursor(c)
        pane.run_action("formal")
        if d.suggestion is None:
            raise VeilError(pane.error.text() or "the drafting action did not start")
    QTimer.singleShot(TIMEOUT_S * 1000, lambda: fail(f"no reply within {TIMEOUT_S} s"))
    loop.exec()
    if not result.get("ok"):
        window.close()
        raise VeilError(str(result.get("error", "unknown failure")))
    if not str(result.get("text", "")).strip():
        window.close()
        raise VeilError("the model's reply was empty")
    QApplication.processEvents()
    image = window.grab()
    out.parent.mkdir(parents=True, exist_ok=True)
    saved = image.save(str(out))
    state = app.connection_text()
    window.close()
    if not saved:
        raise VeilError(f"cannot write the screenshot {out}")
    secs = time.perf_counter() - t0
    print(
        f"veil: smoke test passed ({args.pane}, {state}, {secs:.1f} s): "
        f"screenshot {out} ({image.width()}x{image.height()})"
    )
    return 0
