"""The app as a new, non-technical user meets it (issue 18), part 1, pytest-qt, offscreen,
tiny model: the privacy panel never contradicts itself, the privacy audit asks, cancels and
reports, banners clear when their cause is gone, invite codes and numbers are checked in
Settings, the built-in server restarts mid-reply, and dialogs are deleted after use."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QEvent, Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QApplication,
    QDialog,
    QLabel,
)

from app.core.engine_host import CONNECTED, OFFLINE
from app.core.settings import MODE_DEMO
from app.core.trunk_sources import DemoServerSource
from tests.gui_support import GOOD_INVITE, demo_window, local_window
from tests.test_gui_app import (  # noqa: F401
    FAST,
    WAIT_MS,
    reconnects_held,
    send,
    server,
    tiny,
    wait_idle,
)

pytestmark = pytest.mark.gui


def _save_audit(name: str) -> None:
    """An audit like an old one that also measured the fully local depth k = L/2 = 3."""
    from engine.audit.store import save_results

    rows = [
        {"k": 1, "attack": "known_weights", "side": "input", "top1": 0.97, "top1_ci": [0.9, 1]},
        {"k": 1, "attack": "mlp", "side": "input", "top1": 0.4, "top1_ci": [0.3, 0.5]},
        {"k": 3, "attack": "mlp", "side": "input", "top1": 0.87, "top1_ci": [0.8, 0.9]},
    ]
    save_results({"model": name, "date": "2026-12-01", "n_layers": 6, "results": rows})


def test_fully_local_panel_shows_no_recovery_figure(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    from app.core import audit_info
    from app.views.audit_dialog import AuditDialog

    w = local_window(qtbot, tiny, tmp_path, k=1)
    _save_audit(w.app.model_name())
    p = w.privacy
    p.slider.setValue(1)
    p.refresh()
    assert p.level.text() == "High" and "recovered 97% of words" in p.audit.text()
    assert "all of what you type" in p.sentence.text()  # 97%: "all", as the figure says
    assert "all of what you type" in w.chat_view.welcome.text()  # the welcome agrees
    assert "2026-12-01" in p.audit.text()
    p.slider.setValue(2)  # not measured: no figure, and no comforting word either
    assert p.level.text() == "Unknown" and "%" not in p.audit.text()

    p.slider.setValue(3)  # k = L/2: every layer here, nothing is sent
    assert "Nothing is sent" in p.summary.text()
    assert p.level.text() == "None"
    assert p.sentence.text() == "Nothing you type leaves this computer."
    shown = " ".join(lb.text() for lb in p.findChildren(QLabel) if not lb.isHidden())
    assert "%" not in shown and "87" not in shown and "audit of" not in shown
    assert "nothing to audit" in p.audit.text()
    assert "nothing you type is sent" in w.chat_view.welcome.text()
    # the audit never measures a depth at which nothing is sent, and hides such old rows
    assert audit_info.audit_depths(6, 3) == [1, 2]
    assert all(r["k"] != 3 for r in audit_info.rows(w.app.model_name(), 6))
    rows = audit_info.rows(w.app.model_name(), 6)
    dlg = AuditDialog("m", "2026-12-01", rows, 3, w, fully_local=True)
    qtbot.addWidget(dlg)
    assert dlg.bold_rows == [] and "nothing is sent" in dlg.findChildren(QLabel)[1].text()
    w.close()


def test_audit_details_plain_names_and_bold_rows(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    from app.views.audit_dialog import AuditDialog

    w = local_window(qtbot, tiny, tmp_path)
    rows = [
        {"k": 1, "attack": "known_weights", "side": "input", "top1": 0.9, "top1_ci": [0.8, 1]},
        {"k": 2, "attack": "logit_lens", "side": "output", "top1": 0.5, "top1_ci": [0.4, 0.6]},
    ]
    d = AuditDialog("tiny", "2026-12-01", rows, 2, w)
    qtbot.addWidget(d)
    d.show()
    name = d.table.item(0, 1)
    assert name.text() == "Re-running the public model" and "known_weights" in name.toolTip()
    assert "Known-weights inversion" in name.toolTip()
    assert d.bold_rows == [1]
    for c in range(d.table.columnCount()):
        assert d.table.item(1, c).font().bold() and not d.table.item(0, c).font().bold()
    # drawn bold: the bold row's text is wider than the same text in a normal row would be
    rect = d.table.visualItemRect(d.table.item(1, 3))
    img = d.table.viewport().grab(rect).toImage()
    normal = d.table.viewport().grab(d.table.visualItemRect(d.table.item(0, 3))).toImage()

    def ink(im: Any) -> int:
        base = QColor(im.pixel(0, 0)).lightness()
        return sum(
            1
            for x in range(im.width())
            for y in range(im.height())
            if abs(QColor(im.pixel(x, y)).lightness() - base) > 80
        )

    assert ink(img) > ink(normal)  # "50.0%" in bold has more ink than "90.0%" in regular
    w.close()


def test_run_audit_asks_first_can_cancel_and_says_when_done(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
):
    w = local_window(qtbot, tiny, tmp_path, k=1)
    asked: list[str] = []
    w.ask_yes = lambda title, text, yes: asked.append(text) or False  # type: ignore[method-assign]
    qtbot.mouseClick(w.privacy.run_button, Qt.MouseButton.LeftButton)
    assert asked and "about" in asked[0] and "cancel" in asked[0].lower()
    assert "(1 and 2 layers" in asked[0]  # k=3 of 6 is fully local: never audited
    assert w._audit_task is None and "Run" in w.privacy.run_button.text()  # declined: nothing

    w.ask_yes = lambda title, text, yes: True  # type: ignore[method-assign]
    qtbot.mouseClick(w.privacy.run_button, Qt.MouseButton.LeftButton)
    assert w.privacy.run_button.text() == "Cancel audit"
    qtbot.mouseClick(w.privacy.run_button, Qt.MouseButton.LeftButton)  # Cancel
    qtbot.waitUntil(lambda: w._audit_task is None, timeout=180_000)
    assert "cancelled" in w.privacy.audit_status.text()
    assert not w.chat_view.error.isVisible()
    w.close()


# --- errors and connection -------------------------------------------------------------------


def test_banners_clear_when_the_server_is_back(qtbot: Any, tiny: Path, server: Any, tmp_path: Path):  # noqa: F811
    w = demo_window(qtbot, tiny, server, tmp_path)
    send(qtbot, w, "first message")
    wait_idle(qtbot, w)
    with reconnects_held(w):
        server.kill()
        try:
            send(qtbot, w, "keep this")
            qtbot.waitUntil(lambda: w.chat_view.error.isVisible(), timeout=WAIT_MS)
            text = w.chat_view.error.text()
            assert "built-in server on this computer stopped" in text
            assert "restarting it" in text and "tcp://" not in text and "network" not in text
            assert w.chat_view.error.cause == "connection"
            assert w.app.host.state == OFFLINE
        finally:
            server.restart()
    # nothing pressed: the window reconnects by itself and the banner goes away
    qtbot.waitUntil(lambda: w.app.host.state == CONNECTED, timeout=WAIT_MS)
    qtbot.waitUntil(lambda: not w.chat_view.error.isVisible(), timeout=WAIT_MS)
    assert w.chat_view.composer.toPlainText() == "keep this"
    w.close()


def test_model_banner_clears_when_the_model_is_restored(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    w = local_window(qtbot, tiny, tmp_path)
    s = w.app.settings
    bad = type(s)(**{**vars(s), "model": str(tmp_path / "missing-model")})
    w.apply_settings(bad, reconnect=True)
    qtbot.waitUntil(lambda: w.chat_view.error.isVisible(), timeout=WAIT_MS)
    assert w.chat_view.error.cause == "model"
    good = type(s)(**{**vars(s), "model": str(tiny)})
    w.apply_settings(good, reconnect=True)  # Settings → Save: reconnects at once
    qtbot.waitUntil(lambda: not w.chat_view.error.isVisible(), timeout=WAIT_MS)
    qtbot.waitUntil(lambda: w.app.executor.pending == 0, timeout=WAIT_MS)
    assert w.app.host.runner is not None  # loaded without waiting for the next message
    w.close()


def test_invite_validation_in_settings_and_first_run(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    from app.core.invite_check import OK, ServerCheck
    from app.views.first_run_dialog import SERVER, FirstRunDialog
    from app.views.settings_dialog import SettingsDialog

    w = local_window(qtbot, tiny, tmp_path)

    def answers(_code: str) -> ServerCheck:  # the real check is tested in test_gui_day_one_b
        return ServerCheck(OK, "The server answers.")

    dlg = SettingsDialog(w.app.settings, w, check=answers)
    qtbot.addWidget(dlg)
    dlg.show()
    dlg.server_radio.setChecked(True)
    dlg.invite.setText("veil1:abc")  # a paste: checked at once, error under the field
    assert not dlg.invite_status.isHidden() and dlg.invite_status.objectName() == "FieldError"
    assert "damaged" in dlg.invite_status.text()
    dlg._save()
    assert dlg.result_settings is None  # refused, the dialog stays open
    dlg.invite.setText("")
    dlg._save()
    assert dlg.result_settings is None and "Paste the invite code" in dlg.invite_status.text()
    dlg.invite.setText("veil1:abc")
    dlg.demo_radio.setChecked(True)  # back to the demo: the damaged code is not kept
    assert dlg.values().invite == w.app.settings.invite and dlg.invite_status.isHidden()
    dlg.server_radio.setChecked(True)
    dlg.invite.setText(GOOD_INVITE)
    assert dlg.invite_status.objectName() == "FieldNote" and "10.0.0.7:5757" in (
        dlg.invite_status.text()
    )
    dlg._save()  # Save tries the server first (tests/test_gui_day_one_b.py)
    qtbot.waitUntil(lambda: dlg.result_settings is not None, timeout=WAIT_MS)
    assert dlg.result_settings.invite == GOOD_INVITE

    first = FirstRunDialog(w)
    qtbot.addWidget(first)
    first.show()
    first.invite_edit.setText("veil1:abc")
    assert not first.invite_error.isHidden() and "damaged" in first.invite_error.text()
    qtbot.mouseClick(first.server_button, Qt.MouseButton.LeftButton)
    assert first.choice == ""  # not accepted
    first.invite_edit.setText(GOOD_INVITE)
    assert first.invite_error.isHidden()
    qtbot.mouseClick(first.server_button, Qt.MouseButton.LeftButton)
    assert (first.choice, first.invite) == (SERVER, GOOD_INVITE)
    w.close()


def test_out_of_range_numbers_are_reported(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    from app.views.settings_dialog import SettingsDialog

    w = local_window(qtbot, tiny, tmp_path)
    dlg = SettingsDialog(w.app.settings, w)
    qtbot.addWidget(dlg)
    dlg.show()
    dlg.tabs.setCurrentIndex(1)
    f = dlg.max_tokens
    f.setFocus()
    f.selectAll()
    qtbot.keyClicks(f, "999999")
    dlg._save()  # the value is checked now: changed to the largest value, and said so
    assert f.value() == 4096 and dlg.result_settings is None
    note = dlg.notes[3]
    assert not note.isHidden() and "999999" in note.text() and "4096" in note.text()
    dlg._save()  # the second Save keeps the (now visible) corrected value
    assert dlg.result_settings is not None and dlg.result_settings.max_tokens == 4096
    w.close()


# --- keyboard, layout, text -------------------------------------------------------------------


def test_dialogs_are_deleted_after_use(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    """An exec()'d dialog left under the window was deleted twice at exit (PySide6 gives it
    back to Python while Qt keeps it as the window's child)."""
    w = local_window(qtbot, tiny, tmp_path)
    monkeypatch.setattr(QDialog, "exec", lambda self: 0)
    w.open_settings()
    w.open_audit_details()
    QApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    assert w.findChildren(QDialog) == []
    w.close()


def test_app_exits_cleanly_after_first_run_and_dialogs(tiny: Path, tmp_path: Path):  # noqa: F811
    """The real ``main()``: first start, Settings, audit details, close. Before the fix this
    printed "shared QObject was deleted directly" and often crashed at exit."""
    script = textwrap.dedent(
        f"""
        import sys
        from PySide6.QtCore import QTimer
        from PySide6.QtWidgets import QApplication
        qapp = QApplication(["veil"])

        def visible(name):
            return [w for w in QApplication.topLevelWidgets()
                    if type(w).__name__ == name and w.isVisible()]

        def first_run():
            for d in visible("FirstRunDialog"):
                d._demo()
            QTimer.singleShot(1500, dialogs)

        def dialogs():
            for win in visible("MainWindow"):
                QTimer.singleShot(300, lambda: [d.accept() for d in visible("SettingsDialog")])
                win.open_settings()
                QTimer.singleShot(300, lambda: [d.accept() for d in visible("AuditDialog")])
                win.open_audit_details()
                win.close()

        QTimer.singleShot(500, first_run)
        from app.main_window import main
        sys.exit(main(["--data-dir", {str(tmp_path / "data")!r}, "--model", {str(tiny)!r}]))
        """
    )
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
        cwd=root,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert "shared QObject" not in p.stderr and "malloc" not in p.stderr


def test_built_in_server_restarts_by_itself_mid_reply(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    """The demo server is killed while it writes: Veil says so, restarts it, and the reply
    continues (the transport replays the conversation to the new server) without an error."""
    from tests.test_gui_app import greedy

    w = local_window(qtbot, tiny, tmp_path, max_tokens=48)
    app = w.app
    app.settings.mode = app.host.mode = MODE_DEMO
    app.host.shutdown_blocking()
    source = DemoServerSource(str(tiny), "float32", "cpu", None, {**FAST, "reconnect_s": 60.0})
    app.host.source = source  # owned: started (and restarted) by Veil itself
    seen: list[str] = []
    killed: list[int] = []

    def kill_once(_m: Any) -> None:
        if not killed and source.server is not None:
            killed.append(source.server.proc.pid)
            source.server.kill()

    app.chat.message_updated.connect(kill_once)
    send(qtbot, w, "The quick brown fox")
    qtbot.waitUntil(lambda: bool(killed), timeout=WAIT_MS)
    qtbot.waitUntil(lambda: w.chat_view.error.cause == "restart", timeout=WAIT_MS)
    seen.append(w.chat_view.error.text())
    wait_idle(qtbot, w)
    reply = app.chat.messages()[-1]
    assert reply.finish_reason in ("eos", "length"), reply.finish_reason
    want = greedy(tiny, [{"role": "user", "content": "The quick brown fox"}], 1, 48)
    assert reply.content == want  # continued exactly where it was
    assert source.restarts == 1 and source.server.proc.pid != killed[0]
    assert "built-in server on this computer stopped" in seen[0] and "restarting" in seen[0]
    qtbot.waitUntil(lambda: w.chat_view.error.isHidden(), timeout=WAIT_MS)  # and it goes away
    w.close()  # stops the server it started
    assert not source.alive() or source.server is None


def test_damaged_stored_invite_then_back_to_the_demo(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    """A damaged code stored by an older version: one line with "Open Settings", no promise to
    reconnect; choosing another server in Settings takes the banner away at once."""
    from app.core.settings import MODE_SERVER

    w = local_window(qtbot, tiny, tmp_path)
    app = w.app
    s = app.settings
    app.host.reconfigure(s.model, MODE_SERVER, "veil1:abc")
    app.connect_now()
    qtbot.waitUntil(lambda: w.chat_view.error.isVisible(), timeout=WAIT_MS)
    banner = w.chat_view.error
    assert banner.cause == "invite" and banner.action.text() == "Open Settings"
    assert "damaged" in banner.text() and "reconnects" not in banner.text()
    assert app.host.state == "Not connected" and not app.chat.needs_reconnect()
    w.apply_settings(type(s)(**vars(s)), reconnect=True)  # Save with the in-process trunk
    assert banner.isHidden()
    qtbot.waitUntil(lambda: app.executor.pending == 0, timeout=WAIT_MS)
    assert app.host.runner is not None
    w.close()


def test_pyside_keeps_none_alive() -> None:
    """PySide6 6.12.0 on Python 3.11 dropped a reference to None on every call that returns
    nothing (the interpreter aborted after ~200 000 calls); pyproject.toml pins below it."""
    label = QLabel()
    before = sys.getrefcount(None)
    for _ in range(1000):
        label.setText("x")
        label.setVisible(False)
    assert sys.getrefcount(None) - before > -50
