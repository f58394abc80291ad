"""Shared helpers for the GUI tests of issue 18 (a window without a server child, one with
the module's demo server, the theme reset)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtWidgets import QApplication

from app.core.settings import MODE_IN_PROCESS
from app.main_window import MainWindow, create, parse_args
from engine.protocol import make_invite
from tests.test_gui_app import WAIT_MS

GOOD_INVITE = make_invite("tcp://10.0.0.7:5757", "k" * 40)


def local_window(qtbot: Any, tiny: Path, data: Path, **settings: Any) -> MainWindow:
    """A window whose trunk runs in this process (no server child): for what needs no server."""
    app, w = create(parse_args(["--model", str(tiny), "--theme", "light"]), str(data))
    s = app.settings
    s.first_run_done, s.mode, s.model, s.system_prompt = True, MODE_IN_PROCESS, str(tiny), ""
    s.max_tokens, s.repetition_penalty = settings.get("max_tokens", 8), 1.0
    s.local_layers = settings.get("k", 1)
    app.apply_settings(s)
    qtbot.waitUntil(lambda: app.executor.pending == 0, timeout=WAIT_MS)
    qtbot.addWidget(w)
    w.resize(1280, 800)
    w.show()
    w.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is w, timeout=WAIT_MS)
    app.load_config()
    qtbot.waitUntil(lambda: w.privacy.slider.isEnabled(), timeout=WAIT_MS)
    return w


def demo_window(qtbot: Any, tiny: Path, server: Any, data: Path) -> MainWindow:
    from tests.test_gui_app import open_window

    return open_window(qtbot, tiny, server, data)


def theme_reset() -> None:
    """The next test starts in the light theme at 10 pt."""
    from app.views.theme import Theme

    qapp = QApplication.instance()
    assert isinstance(qapp, QApplication)
    Theme.apply(qapp, "light", 10)
