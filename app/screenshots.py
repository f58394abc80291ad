"""Capture the app's panes and dialogs at 1280×800, light and dark, for docs/screenshots (and
the conversation at smaller window sizes and larger text).

    QT_QPA_PLATFORM=offscreen python -m app.screenshots docs/screenshots \
        [--model SPEC] [--audit-from results.json]

Everything shown is real: replies come from the model through the built-in demo server (a
real ``veil-trunk`` child process); the audit table shows the audit file given (if any).
Dialogs are drawn over the dimmed main window, as a user sees them.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from PySide6.QtCore import QEventLoop, QPoint, QTimer
from PySide6.QtGui import QColor, QPainter, QPixmap, QTextCursor
from PySide6.QtWidgets import QApplication, QMessageBox, QWidget

from app.core.settings import MODE_DEMO
from app.core.trunk_sources import DemoServerSource
from app.smoke import DOC_TEXT, DOC_TITLE, SELECT
from engine.loading import DEFAULT_MODEL

CHAT = (
    "Write a short, friendly reminder that the team meeting moved to 3 pm on Friday.",
    "Show a tiny Python function that adds two numbers.",
)


def wait(cond: Any, timeout_s: float = 600) -> None:
    loop = QEventLoop()
    timer = QTimer(interval=100)
    timer.timeout.connect(lambda: loop.quit() if cond() else None)
    QTimer.singleShot(int(timeout_s * 1000), loop.quit)
    timer.start()
    loop.exec()
    timer.stop()
    if not cond():
        raise SystemExit(f"screenshots: timed out after {timeout_s:g} s")


def settle(ms: int = 300) -> None:
    loop = QEventLoop()
    QTimer.singleShot(ms, loop.quit)
    loop.exec()


def save(window: QWidget, out: Path, dialog: QWidget | None = None) -> None:
    settle()
    shot: QPixmap = window.grab()
    if dialog is not None:
        dialog.show()
        settle()
        d = dialog.grab()
        dialog.hide()
        p = QPainter(shot)
        p.fillRect(shot.rect(), QColor(0, 0, 0, 150))
        at = QPoint((shot.width() - d.width()) // 2, (shot.height() - d.height()) // 2)
        p.drawPixmap(at, d)
        p.end()
    shot.save(str(out))
    print(f"screenshots: {out}")


def capture(theme: str, data: Path, out: Path, args: argparse.Namespace) -> None:
    from app.main_window import create, parse_args
    from app.views.audit_dialog import AuditDialog
    from app.views.first_run_dialog import FirstRunDialog
    from app.views.settings_dialog import SettingsDialog

    app, w = create(parse_args(["--theme", theme]), str(data))
    s = app.settings
    s.first_run_done, s.mode, s.model, s.max_tokens = True, MODE_DEMO, args.model, 96
    app.apply_settings(s)
    w.resize(1280, 800)
    w.show()
    app.load_config()
    wait(lambda: w.privacy.slider.isEnabled())
    if args.only == "documents":
        documents(w, app, data, out, theme)
        w.close()
        return
    chat = app.chat

    def reply(text: str) -> None:
        w.chat_view.composer.setPlainText(text)
        w.chat_view.send_or_stop()
        wait(lambda: not chat.busy)

    # empty chat (welcome)
    chat.new_conversation()
    w.show_pane("chat")
    save(w, out / f"chat-empty-{theme}.png")
    # a conversation (the light run writes it; the dark run reopens it and adds one reply)
    if theme == "light":
        for text in CHAT:
            reply(text)
        first = chat.current
    else:
        first = app.store.conversations()[-1].id
        chat.delete(chat.current or -1)
        chat.open(first)
        reply("Thank you! Make it one sentence.")
    save(w, out / f"chat-{theme}.png")
    if theme == "light":
        window_sizes(w, app, out)
        long_message(w, app, out)

    # drafting with a finished suggestion
    w.show_pane("drafting")
    app.drafting.new_document(DOC_TITLE, DOC_TEXT)
    pane = w.drafting_pane
    start = DOC_TEXT.index(SELECT)
    c = pane.editor.textCursor()
    c.setPosition(start)
    c.setPosition(start + len(SELECT), QTextCursor.MoveMode.KeepAnchor)
    pane.editor.setTextCursor(c)
    pane.run_action("formal")
    wait(lambda: not app.drafting.busy)
    save(w, out / f"drafting-{theme}.png")
    pane.reject()
    w.show_pane("chat")

    save(w, out / f"settings-{theme}.png", SettingsDialog(app.settings, w))
    save(w, out / f"first-run-{theme}.png", FirstRunDialog(w))
    from app.core import audit_info

    rows = audit_info.rows(app.model_name(), app.n_layers)
    data_ = audit_info.latest(app.model_name()) or {}
    k = app.settings.local_layers
    shipped = audit_info.is_shipped(data_, app.model_name())
    dlg = AuditDialog(
        app.model_name(), str(data_.get("date", ""))[:10], rows, k, w, shipped=shipped,
        n_layers=app.n_layers,
    )  # fmt: skip
    save(w, out / f"audit-{theme}.png", dlg)
    n = app.n_layers or 2
    ks = audit_info.audit_depths(n, k)
    question = w.audit_question(ks, audit_info.estimate_seconds(ks, app.model_params()))
    box = QMessageBox(QMessageBox.Icon.Question, "Run the privacy audit?", question, parent=w)
    box.addButton("Run audit", QMessageBox.ButtonRole.AcceptRole)
    box.addButton(QMessageBox.StandardButton.Cancel)
    save(w, out / f"audit-question-{theme}.png", box)

    # a damaged invite code: one clear line under the field, and Save refuses it
    sd = SettingsDialog(app.settings, w)
    sd.server_radio.setChecked(True)
    sd.invite.setText("veil1:abc")
    save(w, out / f"settings-invite-{theme}.png", sd)

    # a well-formed invite whose key is not the server's: Save tries it and says so
    source = app.host.source
    if isinstance(source, DemoServerSource) and source.server is not None:
        import zmq

        from app.core.invite_check import check_invite_server
        from engine.protocol import make_invite

        srv = source.server
        keys = srv.client_keys  # the built-in server lets these in
        sd = SettingsDialog(app.settings, w, check=lambda c: check_invite_server(c, keys))
        sd.server_radio.setChecked(True)
        sd.invite.setText(make_invite(srv.address, zmq.curve_keypair()[0].decode()))
        sd._save()
        wait(lambda: sd.save_button.isEnabled(), 60)
        save(w, out / f"settings-invite-check-{theme}.png", sd)

    from app.core import logfile
    from app.views.about_dialog import AboutDialog

    about = AboutDialog(app.folder, logfile.log_path(), logfile.log_dir(), w)
    save(w, out / f"about-{theme}.png", about)

    # the built-in server stops: Veil says so and restarts it (the notice goes when it is back)
    if isinstance(source, DemoServerSource) and source.server is not None:
        source.server.kill()
        wait(lambda: w.chat_view.error.cause == "restart", 60)
        w.gauges.refresh()
        save(w, out / f"chat-restart-{theme}.png")
        wait(lambda: w.chat_view.error.isHidden(), 300)

    documents(w, app, data, out, theme)
    side_panels(w, app, out, theme, args.all_positions)
    w.close()


LEASE = [
    [
        "Residential lease between Alpha Properties Ltd (landlord) and Sam Patel (tenant).",
        "1. Term. The lease runs for two years from 1 March.",
    ],
    [
        "2. Rent. The rent is 1,200 euros a month, paid by the first day of each month.",
        "3. Repairs. The landlord repairs the roof, the heating and the plumbing.",
    ],
    [
        "4. Deposit. The security deposit equals three months of rent and is returned within "
        "thirty days after the keys are handed back.",
        "5. Notice. Either party may end the lease with ninety days written notice.",
    ],
]


def sample_matter(folder: Path) -> Path:
    """A small matter: a three-page lease (Word) and the house rules (text)."""
    import docx

    folder.mkdir(parents=True, exist_ok=True)
    d = docx.Document()
    for n, page in enumerate(LEASE):
        for para in page:
            d.add_paragraph(para)
        if n < len(LEASE) - 1:
            d.add_page_break()
    d.save(str(folder / "Lease Patel.docx"))
    (folder / "House rules.txt").write_text(
        "Quiet hours are from 10 pm to 7 am.\n\nBicycles stay in the cellar.\n\n"
        "Pets need the landlord's written consent.\n",
        encoding="utf-8",
    )
    return folder


def documents(w: Any, app: Any, data: Path, out: Path, theme: str) -> None:
    """A matter, a question answered with [file, page] links, the passage, Settings' API tab."""
    from app.views.settings_dialog import SettingsDialog

    docs = app.documents
    found = [m.id for m in docs.matters() if m.name == "Patel lease"]
    if found:
        matter = found[0]
    else:
        matter = docs.create_matter("Patel lease", [sample_matter(data / "Patel lease")])
    wait(lambda: docs.busy == 0)
    w.sidebar.set_pane("matters")
    w.sidebar.choose_matter(matter)
    save(w, out / f"matters-{theme}.png")
    w.matters_pane.ask()
    wait(app.chat.connected, 300)  # the built-in server may still be coming back (restart)
    w.chat_view.composer.setPlainText("How much is the security deposit, and when is it returned?")
    w.chat_view.send_or_stop()
    wait(lambda: not app.chat.busy)
    save(w, out / f"documents-chat-{theme}.png")
    last = w.chat_view.widgets[max(w.chat_view.widgets)]
    bar = getattr(last, "sources_bar", None)
    if bar is not None and bar.sources:
        dlg = bar.open(bar.sources[0])
        dlg.hide()
        save(w, out / f"documents-passage-{theme}.png", dlg)
        dlg.reject()
    sd = SettingsDialog(app.settings, w)
    if sd.api_tab is not None:
        sd.tabs.setCurrentWidget(sd.api_tab)
        sd.api_tab.enabled.setChecked(True)
        save(w, out / f"settings-api-{theme}.png", sd)
    w.show_pane("chat")


WINDOW_SIZES = ((1000, 640), (1150, 720), (1280, 800))
TRANSCRIPT = (
    "Q. Please state your name for the record. A. Dana Whitfield. Q. Where were you employed "
    "in March? A. At the Harbor Street office, as the office manager. Q. Did you review the "
    "supplier contract before it was signed? A. I read the first draft and sent my notes to "
    "the partners. Q. Who signed it? A. Mr. Okafor signed it on the fourteenth. "
)


def long_message(w: Any, app: Any, out: Path) -> None:
    """A pasted transcript: its size under the message box, then how far the model has read
    it, then the message shown collapsed with "Show all"; then one too long for the model
    (the question: send the first part, summarise in parts, or cancel)."""
    view, chat = w.chat_view, app.chat
    chat.new_conversation()
    text = "Summarize this deposition in three sentences.\n\n" + TRANSCRIPT * 30
    view.composer.setPlainText(text)
    view.update_length_note()
    save(w, out / "chat-long-message-light.png")
    seen: list[int] = []
    chat.reading.connect(lambda done, total, left: seen.append(done))
    view.send_or_stop()
    wait(lambda: len(seen) >= 3)
    save(w, out / "chat-reading-light.png")
    wait(lambda: not chat.busy)
    save(w, out / "chat-show-all-light.png")
    # too long for the model: what would be cut, and the offer to summarise it in parts
    chat.new_conversation()
    text = "Summarize this deposition in three sentences.\n\n" + TRANSCRIPT * 110
    check = chat.length_check(text)
    if check is not None and not check.fits:
        view.composer.setPlainText(text)
        view.update_length_note()
        box = view.cut_box(check, text)
        save(w, out / "chat-too-long-light.png", box)
        box.deleteLater()
        view.composer.clear()


def window_sizes(w: Any, app: Any, out: Path) -> None:
    """The conversation at common laptop window sizes (1000x640 is the smallest the window
    gets) at 10 and 13 pt: the side panel folds away where the conversation would be cramped."""
    for pt in (10, 13):
        s = copy.copy(app.settings)
        s.font_size = pt
        w.apply_settings(s)
        for width, height in WINDOW_SIZES:
            w.resize(width, height)
            settle(400)
            save(w, out / f"chat-{width}x{height}-{pt}pt.png")
    s = copy.copy(app.settings)
    s.font_size = 10
    w.apply_settings(s)
    w.resize(1280, 800)


def side_panels(w: Any, app: Any, out: Path, theme: str, every: Path | None) -> None:
    """The side panel at 13 pt text: a sheet of a few slider positions for the docs, and with
    ``every`` one image per position there (to look at all of them)."""
    s = copy.copy(app.settings)
    s.font_size = 13
    w.apply_settings(s)
    settle(600)
    top = w.privacy.slider.maximum()
    keep = sorted({1, 2, max(1, top // 2), top})
    shots: list[QPixmap] = []
    for k in range(1, top + 1):
        w.privacy.slider.setValue(k)
        w.gauges.refresh()
        settle(150)
        shot = w.side_scroll.grab()
        if every is not None:
            every.mkdir(parents=True, exist_ok=True)
            shot.save(str(every / f"side-panel-13pt-{theme}-k{k:02d}.png"))
        if k in keep:
            shots.append(shot)
    sheet = QPixmap(sum(p.width() for p in shots) + 12 * (len(shots) - 1), shots[0].height())
    sheet.fill(QColor(0, 0, 0, 0))
    p = QPainter(sheet)
    x = 0
    for shot in shots:
        p.drawPixmap(x, 0, shot)
        x += shot.width() + 12
    p.end()
    sheet.save(str(out / f"side-panel-13pt-{theme}.png"))
    print(f"screenshots: {out / f'side-panel-13pt-{theme}.png'} (k = {keep})")
    s.font_size = 10
    w.apply_settings(s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.screenshots")
    p.add_argument("out", type=Path)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--audit-from", type=Path, default=None, help="a stored audit results.json")
    p.add_argument(
        "--all-positions",
        type=Path,
        default=None,
        metavar="DIR",
        help="also save the side panel at every slider position in DIR",
    )
    p.add_argument(
        "--only",
        choices=("all", "documents"),
        default="all",
        help="documents: only the matters, cited answer, passage and API settings images",
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    QApplication.instance() or QApplication(["veil"])
    data = Path(tempfile.mkdtemp(prefix="veil-shots-"))
    try:
        if args.audit_from:
            from app.core.paths import data_dir

            data_dir(data)
            import os

            os.environ["VEIL_DATA_DIR"] = str(data)
            from engine.audit.store import results_dir

            dest = results_dir(args.model)
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(args.audit_from, dest / "results.json")
        for theme in ("light", "dark"):
            capture(theme, data, args.out, args)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
