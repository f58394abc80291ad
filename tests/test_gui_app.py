"""The desktop app (pytest-qt, offscreen) against a real ``veil-trunk serve`` child process
running a tiny model: streaming, stop, regenerate, re-split, persistence, server loss and
return, drafting accept/reject/undo."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt
from PySide6.QtGui import QTextCursor
from PySide6.QtWidgets import QApplication

from app.core.chat import regenerate_params
from app.core.engine_host import CONNECTED, OFFLINE
from app.core.settings import MODE_DEMO
from app.core.trunk_sources import DemoServerSource
from app.main_window import MainWindow, create, parse_args
from engine.chat import prompt_ids
from engine.generate import generate
from engine.protocol import make_invite
from engine.sampling import SamplingParams
from engine.session import RunnerOptions, open_runner
from tests.tiny import make_model

pytestmark = pytest.mark.gui
FAST = {"timeout_s": 1.0, "heartbeat_s": 0.2, "reconnect_s": 2.0, "connect_timeout_s": 3.0}
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tinygui") / "llama"
    make_model(folder, "llama", seed=5, n_layers=6)
    return folder


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[Any]:
    from engine.local_server import start_local_trunk

    srv = start_local_trunk(str(tiny), min_local_layers=1)
    yield srv
    srv.stop()


def open_window(qtbot: Any, tiny: Path, server: Any, data: Path, **settings: Any) -> MainWindow:
    app, window = create(parse_args(["--model", str(tiny), "--theme", "light"]), str(data))
    s = app.settings
    s.first_run_done, s.mode, s.model, s.system_prompt = True, MODE_DEMO, str(tiny), ""
    s.max_tokens = settings.get("max_tokens", 16)
    s.repetition_penalty = 1.0  # replies are compared with the engine's plain greedy run
    if "k" in settings:
        s.local_layers = settings["k"]
    app.apply_settings(s)
    qtbot.waitUntil(lambda: w_executor_idle(app), timeout=WAIT_MS)
    app.host.source = DemoServerSource(str(tiny), "float32", "cpu", server, FAST)
    qtbot.addWidget(window)
    window.resize(1280, 800)
    window.show()
    window.activateWindow()  # window shortcuts (Esc, Ctrl+N) need the active window
    qtbot.waitUntil(lambda: QApplication.activeWindow() is window, timeout=WAIT_MS)
    app.load_config()
    qtbot.waitUntil(lambda: window.privacy.slider.isEnabled(), timeout=WAIT_MS)
    return window


def w_executor_idle(app: Any) -> bool:
    return bool(app.executor.pending == 0)


def greedy(
    tiny: Path, history: list[dict[str, str]], k: int, n: int, params: SamplingParams | None = None
) -> str:
    """The engine's reply (greedy, or with ``params``) to ``history``."""
    runner = open_runner(RunnerOptions(model=str(tiny), local_layers=k))
    ids = prompt_ids(runner.client.tokenizer, history)
    return generate(runner, ids, params or SamplingParams(max_new_tokens=n)).text


def send(qtbot: Any, w: MainWindow, text: str) -> None:
    w.chat_view.composer.setPlainText(text)
    qtbot.mouseClick(w.chat_view.send_button, Qt.MouseButton.LeftButton)


def wait_idle(qtbot: Any, w: MainWindow) -> None:
    qtbot.waitUntil(lambda: not w.app.chat.busy and not w.app.drafting.busy, timeout=WAIT_MS)


def close(w: MainWindow) -> None:
    w.close()


def test_stream_stop_regenerate_and_resplit(qtbot: Any, tiny: Path, server: Any, tmp_path: Path):
    w = open_window(qtbot, tiny, server, tmp_path, k=1, max_tokens=16)
    chat = w.app.chat
    updates: list[str] = []
    chat.message_updated.connect(lambda m: updates.append(m.content))
    send(qtbot, w, "The quick brown fox")
    assert chat.busy and w.chat_view.send_button.text() == "Stop"  # the UI did not block
    assert w.chat_view.composer.toPlainText() == ""
    wait_idle(qtbot, w)
    msgs = chat.messages()
    want = greedy(tiny, [{"role": "user", "content": "The quick brown fox"}], 1, 16)
    assert msgs[-1].content == want and want
    assert len({u for u in updates}) > 2  # streamed, not all at once
    assert w.app.host.state == CONNECTED
    assert type(w.app.host.runner.trunk).__name__ == "RemoteTrunk"  # type: ignore[union-attr]
    bubble = w.chat_view.widgets[msgs[-1].id]
    assert bubble.plain_text().strip() == want.strip()
    assert w.gauges.speed.text() != "-" and w.gauges.per_rt.text() != "-"
    assert w.gauges.rtt.text().endswith("ms")

    # stop mid-generation
    w.app.settings.max_tokens = 300
    seen: list[int] = []

    def stop_soon(_m: Any) -> None:
        seen.append(1)
        if len(seen) == 1:
            qtbot.mouseClick(w.chat_view.send_button, Qt.MouseButton.LeftButton)

    chat.message_updated.connect(stop_soon)
    send(qtbot, w, "Veil splits a language model")
    wait_idle(qtbot, w)
    chat.message_updated.disconnect(stop_soon)
    stopped = chat.messages()[-1]
    assert stopped.finish_reason == "cancelled"
    assert w.chat_view.widgets[stopped.id].note.text() == "Stopped."
    assert w.chat_view.send_button.text() == "Send"

    # regenerate: the stopped reply is replaced by a full one, sampled with a fresh seed
    w.app.settings.max_tokens = 16
    chat.new_seed = lambda: 5
    qtbot.mouseClick(w.chat_view.regen_button, Qt.MouseButton.LeftButton)
    wait_idle(qtbot, w)
    msgs = chat.messages()
    assert len(msgs) == 4 and stopped.id not in w.chat_view.widgets
    history = [
        {"role": "user", "content": "The quick brown fox"},
        {"role": "assistant", "content": want},
        {"role": "user", "content": "Veil splits a language model"},
    ]
    params = regenerate_params(SamplingParams(max_new_tokens=16), 5)
    assert msgs[-1].content == greedy(tiny, history, 1, 16, params)

    # slider: re-split from the next message, same conversation, still exact
    w.privacy.slider.setValue(2)
    assert "4 of 6 layers" in w.privacy.summary.text()
    send(qtbot, w, "Jane Doe")
    wait_idle(qtbot, w)
    assert w.app.host.applied_k == 2
    trunk = w.app.host.runner.trunk  # type: ignore[union-attr]
    assert (trunk.start, trunk.end) == (2, 4)
    msgs = chat.messages()
    history = [{"role": m.role, "content": m.content} for m in msgs[:-1]]
    assert msgs[-1].content == greedy(tiny, history, 2, 16)
    w.privacy.slider.setValue(3)  # fully local: no server at all
    send(qtbot, w, "again")
    wait_idle(qtbot, w)
    assert w.app.host.runner.trunk is None  # type: ignore[union-attr]
    # fully local: no server, so no round trips and no network figures, and plain words
    assert w.gauges.rtt.isHidden() and w.gauges.per_rt.isHidden() and w.gauges.rtt_name.isHidden()
    assert not w.gauges.speed.isHidden()
    assert "fully on this computer (no server)" in w.gauges.connection.text()
    assert len(chat.messages()) == 8
    close(w)


def test_persistence_across_restart(qtbot: Any, tiny: Path, server: Any, tmp_path: Path):
    w = open_window(qtbot, tiny, server, tmp_path, k=1)
    send(qtbot, w, "hello there")
    wait_idle(qtbot, w)
    conv = w.app.chat.current
    reply = w.app.chat.messages()[-1].content
    w.chat_view.composer.setPlainText("an unsent draft")
    w.sidebar.set_pane("drafting")
    w.drafting_pane.editor.setFocus()
    qtbot.keyClicks(w.drafting_pane.editor, "My saved document.")  # typing creates a document
    w.privacy.slider.setValue(2)
    close(w)

    w2 = open_window(qtbot, tiny, server, tmp_path)
    assert w2.sidebar.pane == "drafting"
    assert w2.drafting_pane.editor.toPlainText() == "My saved document."
    assert w2.app.chat.current == conv
    assert [m.content for m in w2.app.chat.messages()] == ["hello there", reply]
    assert w2.chat_view.composer.toPlainText() == "an unsent draft"
    assert w2.privacy.slider.value() == 2
    assert w2.sidebar.chat_list.count() == 1 and w2.sidebar.doc_list.count() == 1
    close(w2)


def _select(w: MainWindow, start: int, end: int) -> None:
    c = w.drafting_pane.editor.textCursor()
    c.setPosition(start)
    c.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
    w.drafting_pane.editor.setTextCursor(c)


def test_drafting_accept_reject_undo(qtbot: Any, tiny: Path, server: Any, tmp_path: Path):
    w = open_window(qtbot, tiny, server, tmp_path)
    w.show_pane("drafting")
    pane = w.drafting_pane
    doc = "Dear team, the fox is quick 🙂 ok. Thanks, Sam."
    w.app.drafting.new_document("Memo", doc)
    assert pane.editor.toPlainText() == doc
    sel = "the fox is quick 🙂 ok."
    lo = doc.index(sel)
    q = lambda i: len(doc[:i].encode("utf-16-le")) // 2  # noqa: E731  Qt positions
    _select(w, q(lo), q(lo + len(sel)))
    qtbot.mouseClick(pane.action_buttons["formal"], Qt.MouseButton.LeftButton)
    assert pane.editor.isReadOnly()
    wait_idle(qtbot, w)
    s = w.app.drafting.suggestion
    assert s is not None and s.done and s.source == sel and s.text.strip()
    assert pane.s_text.toPlainText() == s.text
    assert pane.editor.toPlainText() == doc  # nothing changes before accepting
    qtbot.mouseClick(pane.accept_button, Qt.MouseButton.LeftButton)
    new = pane.editor.toPlainText()
    assert new == doc[:lo] + s.text.strip() + doc[lo + len(sel) :]
    assert w.app.store.document(w.app.drafting.current).body == new  # type: ignore[union-attr,arg-type]
    pane.editor.undo()
    assert pane.editor.toPlainText() == doc

    _select(w, 0, q(9))
    qtbot.mouseClick(pane.action_buttons["grammar"], Qt.MouseButton.LeftButton)
    wait_idle(qtbot, w)
    qtbot.mouseClick(pane.reject_button, Qt.MouseButton.LeftButton)
    assert pane.editor.toPlainText() == doc and w.app.drafting.suggestion is None
    assert not pane.editor.isReadOnly() and pane.action_buttons["grammar"].isEnabled()
    close(w)


@contextmanager
def reconnects_held(w: Any, every_ms: int = 200) -> Iterator[None]:
    """No reconnect attempt inside the block (one turns "offline" into "connecting" within
    ~200 ms: a race with the checks on a loaded machine); after it the window retries by
    itself every ``every_ms``."""
    w._reconnect.stop()
    w._soon_reconnect = lambda: None
    try:
        yield
    finally:
        del w._soon_reconnect
        w._reconnect.start(every_ms)


def test_server_down_shows_error_keeps_draft_then_recovers(
    qtbot: Any, tiny: Path, server: Any, tmp_path: Path
):
    w = open_window(qtbot, tiny, server, tmp_path)
    send(qtbot, w, "first message")
    wait_idle(qtbot, w)
    assert len(w.app.chat.messages()) == 2
    with reconnects_held(w):
        server.kill()
        try:
            send(qtbot, w, "please keep this text")
            qtbot.waitUntil(lambda: w.chat_view.error.isVisible(), timeout=WAIT_MS)
            text = w.chat_view.error.text()
            assert "built-in server on this computer stopped" in text
            assert "Traceback" not in text and "?." not in text and "restarting it" in text
            assert w.chat_view.composer.toPlainText() == "please keep this text"
            assert len(w.app.chat.messages()) == 2  # the failed turn is not left half-done
            assert w.app.host.state == OFFLINE
            assert "Cannot reach the built-in server" in w.gauges.connection.text()
        finally:
            server.restart()
    # Send while the background reconnect attempt may still run: the click is a send, not a
    # "Stop" of that attempt, and the message waits for it (it once raced the attempt's end).
    w._maybe_reconnect()
    assert w.app.chat.probing or w.app.host.state == CONNECTED
    assert w.chat_view.send_button.text() == "Send"
    qtbot.mouseClick(w.chat_view.send_button, Qt.MouseButton.LeftButton)
    assert w.app.chat.busy  # the turn started
    wait_idle(qtbot, w)
    assert w.app.host.state == CONNECTED
    msgs = w.app.chat.messages()
    assert [m.role for m in msgs] == ["user", "assistant"] * 2
    assert msgs[2].content == "please keep this text" and msgs[3].content
    assert not w.chat_view.error.isVisible()
    close(w)


def test_dialogs_settings_theme_and_shortcuts(qtbot: Any, tiny: Path, server: Any, tmp_path: Path):
    from app.views.audit_dialog import AuditDialog
    from app.views.first_run_dialog import DEMO, SERVER, FirstRunDialog
    from app.views.settings_dialog import SettingsDialog

    w = open_window(qtbot, tiny, server, tmp_path)
    d = FirstRunDialog(w)
    qtbot.addWidget(d)
    assert not d.server_button.isEnabled()
    qtbot.mouseClick(d.demo_button, Qt.MouseButton.LeftButton)
    assert d.choice == DEMO and d.result() == d.DialogCode.Accepted
    d = FirstRunDialog(w)
    qtbot.addWidget(d)
    qtbot.keyClicks(d.invite_edit, "veil1:xyz")
    qtbot.mouseClick(d.server_button, Qt.MouseButton.LeftButton)
    assert d.choice == "" and "damaged" in d.invite_error.text()  # refused, said why
    code = make_invite("tcp://10.0.0.7:5757", "k" * 40)
    d.invite_edit.setText(code)
    qtbot.mouseClick(d.server_button, Qt.MouseButton.LeftButton)
    assert (d.choice, d.invite) == (SERVER, code)

    dlg = SettingsDialog(w.app.settings, w)
    qtbot.addWidget(dlg)
    dlg.theme.setCurrentIndex(dlg.theme.findData("dark"))
    dlg.max_tokens.setValue(64)
    dlg.server_radio.setChecked(True)  # no invite code: refused with a clear line
    dlg._save()
    assert dlg.result_settings is None and "invite code" in dlg.invite_status.text()
    dlg.demo_radio.setChecked(True)
    dlg._save()
    assert dlg.result_settings is not None
    before = QApplication.instance().styleSheet()  # type: ignore[union-attr]
    w.apply_settings(dlg.result_settings)
    assert QApplication.instance().styleSheet() != before  # type: ignore[union-attr]
    assert w.app.store.get("settings")["theme"] == "dark"
    assert w.app.settings.max_tokens == 64

    rows = [{"k": 1, "attack": "mlp", "side": "input", "top1": 0.5, "top1_ci": [0.4, 0.6]}]
    a = AuditDialog("tiny", "2026-12-01", rows, 1, w)
    qtbot.addWidget(a)
    assert a.table.rowCount() == 1 and a.table.item(0, 3).text() == "50.0%"
    assert a.table.item(0, 4).text() == "40.0% – 60.0%" and a.table.item(0, 0).font().bold()

    # keyboard: Ctrl+N new chat, Ctrl+Enter sends, Esc stops
    w.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is w, timeout=WAIT_MS)
    n = w.sidebar.chat_list.count()
    qtbot.keyClick(w, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert w.sidebar.chat_list.count() == n + 1
    w.app.settings.max_tokens = 300
    w.chat_view.composer.setFocus()
    qtbot.keyClicks(w.chat_view.composer, "hello")
    pressed: list[int] = []

    def esc_once(_m: Any) -> None:
        if not pressed:
            pressed.append(1)
            qtbot.keyClick(w.chat_view.composer, Qt.Key.Key_Escape)

    w.app.chat.message_updated.connect(esc_once)
    qtbot.keyClick(w.chat_view.composer, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
    assert w.app.chat.busy
    wait_idle(qtbot, w)
    assert pressed and w.app.chat.messages()[-1].finish_reason == "cancelled"
    for widget in (w.chat_view.send_button, w.chat_view.composer, w.privacy.slider):
        assert widget.accessibleName()
    close(w)


def test_run_privacy_audit_from_the_slider_panel(
    qtbot: Any, tiny: Path, server: Any, tmp_path: Path
):
    w = open_window(qtbot, tiny, server, tmp_path, k=1)
    assert "not been audited" in w.privacy.audit.text() and w.privacy.level.text() == "Unknown"
    asked: list[str] = []
    w.ask_yes = lambda title, text, yes: asked.append(text) or True  # type: ignore[method-assign]
    qtbot.mouseClick(w.privacy.run_button, Qt.MouseButton.LeftButton)
    assert asked and "It takes about" in asked[0]  # asked first, with a time estimate
    assert w.privacy.run_button.text() == "Cancel audit"
    assert "Running the privacy audit" in w.privacy.audit_status.text()
    qtbot.waitUntil(lambda: w._audit_task is None, timeout=180_000)
    assert not w.chat_view.error.isVisible(), w.chat_view.error.text()
    assert w.privacy.audit_status.text().startswith("Audit finished in")  # says it is done
    assert "% of words" in w.privacy.audit.text()  # the worst case measured at k=1
    assert "audit of 20" in w.privacy.audit.text()
    assert w.privacy.level.text() in ("High", "Medium", "Low")
    w.privacy.slider.setValue(2)
    assert "% of words" in w.privacy.audit.text()  # k=2 was measured too
    w.privacy.slider.setValue(3)  # k = L/2: nothing is sent, so never audited
    assert w.privacy.level.text() == "None" and "%" not in w.privacy.audit.text()
    close(w)
