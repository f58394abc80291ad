"""The Veil main window, and ``main(argv)``: the ``veil`` command with no subcommand.

``veil`` opens the app; ``veil --data-dir DIR`` keeps chats, documents and settings in DIR;
``veil --smoke-test OUT.png [--pane chat|drafting]`` starts with the demo server, writes one
reply, saves a screenshot and exits 0 (1 on failure).
"""

from __future__ import annotations

import argparse
import base64
import logging
import sys
import time
from collections.abc import Sequence

from PySide6.QtCore import QByteArray, QCoreApplication, QEvent, Qt, QTimer
from PySide6.QtGui import QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QApplication,
    QDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QScrollArea,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.core import audit_info, problems
from app.core.controller import AppController
from app.core.engine_host import OFFLINE, RESTARTED, RESTARTING
from app.core.privacy import PrivacyView, welcome_text
from app.core.settings import Settings
from app.core.tasks import Task, TaskContext
from app.views.audit_dialog import AuditDialog
from app.views.chat_view import ChatView
from app.views.download_dialog import STAGE as DOWNLOAD_STAGE
from app.views.download_dialog import DownloadAsker, DownloadDialog
from app.views.drafting_pane import DraftingPane
from app.views.first_run_dialog import DEMO, FirstRunDialog
from app.views.gauges_panel import GaugesPanel
from app.views.privacy_panel import PrivacyPanel
from app.views.settings_dialog import SettingsDialog
from app.views.sidebar import Sidebar
from app.views.theme import Theme, app_icon, later
from engine.errors import Cancelled, VeilError

log = logging.getLogger("veil.app")
RECONNECT_EVERY_MS = 5000
WATCH_SERVER_MS = 1000
SIDE_PANEL_PX = 330  # at 10 pt; wider (up to SIDE_PANEL_MAX_PX) for larger text, and it wraps
SIDE_PANEL_MAX_PX = 430


def run_modal(dlg: QDialog) -> int:
    """``dlg.exec()``, then delete the dialog.

    PySide6 hands an exec()'d dialog back to Python while Qt still lists it as a child of its
    parent; a dialog kept alive until exit (its lambdas hold it) was then deleted twice, by its
    parent and by PySide's exit clean-up ("shared QObject was deleted directly", then a crash).
    """
    try:
        return int(dlg.exec())
    finally:
        dlg.deleteLater()


def side_panel_width(font_pt: int) -> int:
    return max(SIDE_PANEL_PX, min(SIDE_PANEL_MAX_PX, SIDE_PANEL_PX + (font_pt - 10) * 10))


class MainWindow(QMainWindow):
    def __init__(self, app: AppController, executor: object) -> None:
        super().__init__()
        self.app = app
        self.executor = executor
        self.setWindowTitle("Veil")
        self.setWindowIcon(app_icon())
        self.setMinimumSize(1000, 640)
        central = QWidget()
        row = QHBoxLayout(central)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(0)
        self.sidebar = Sidebar(app.chat, app.drafting)
        row.addWidget(self.sidebar)
        self.stack = QStackedWidget()
        self.chat_view = ChatView(app.chat)
        self.drafting_pane = DraftingPane(app.drafting)
        self.stack.addWidget(self.chat_view)
        self.stack.addWidget(self.drafting_pane)
        row.addWidget(self.stack, 1)

        right = QWidget()
        right.setObjectName("RightPanel")
        right.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)
        rl = QVBoxLayout(right)
        rl.setContentsMargins(14, 16, 14, 16)
        rl.setSpacing(14)
        self.privacy = PrivacyPanel(app)
        self.gauges = GaugesPanel(app)
        rl.addWidget(self.privacy)
        rl.addWidget(self.gauges)
        rl.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidget(right)
        scroll.setWidgetResizable(True)
        scroll.setFixedWidth(side_panel_width(app.settings.font_size))
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAsNeeded)
        self.side_scroll, self.side_panel = scroll, right
        row.addWidget(scroll)
        self.setCentralWidget(central)

        self.status = QLabel("Starting…")
        self.status.setContentsMargins(10, 2, 0, 2)
        self.progress_bar = QProgressBar()
        self.progress_bar.setRange(0, 100)
        self.progress_bar.setFixedWidth(200)
        self.progress_bar.setTextVisible(False)
        self.progress_bar.hide()
        self.statusBar().addWidget(self.status, 1)
        self.statusBar().addPermanentWidget(self.progress_bar)

        self.sidebar.pane_changed.connect(self.show_pane)
        self.sidebar.settings_requested.connect(self.open_settings)
        self.sidebar.export_chat.connect(self._export_chat)
        self.sidebar.export_document.connect(self._export_document)
        self.privacy.details_requested.connect(self.open_audit_details)
        self.privacy.audit_requested.connect(self.run_audit)
        self.privacy.view_changed.connect(self._privacy_changed)
        self.chat_view.settings_requested.connect(self.open_settings)
        app.resolved.connect(self._resolved)
        app.chat.failed.connect(lambda _e, _t: self._soon_reconnect())
        self._audit_task: Task | None = None
        app.chat.progress.connect(self.show_progress)
        app.drafting.progress.connect(self.show_progress)
        # the organisation's model from its server: asked before, a dialog while downloading
        self.download_asker = DownloadAsker(self)
        self.download: DownloadDialog | None = None  # while a download runs
        self.download_shown = 0.0  # the last fraction it showed
        app.host.confirm_download = self.download_asker
        app.chat.busy_changed.connect(lambda _: self._idle_status())
        app.drafting.busy_changed.connect(lambda _: self._idle_status())
        app.config_loaded.connect(self._idle_status)
        app.load_failed.connect(self._load_failed)
        app.gauges_changed.connect(lambda _: self._idle_status())
        app.store.failed.connect(self.show_error)  # a full or read-only disk: one line

        QShortcut(QKeySequence("Ctrl+N"), self, self._new)
        QShortcut(QKeySequence("Ctrl+F"), self, self._search)
        QShortcut(QKeySequence("Ctrl+,"), self, self.open_settings)
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, self._stop)
        self._reconnect = QTimer(self, interval=RECONNECT_EVERY_MS)
        self._reconnect.timeout.connect(self._maybe_reconnect)
        self._reconnect.start()
        self._watch_server = QTimer(self, interval=WATCH_SERVER_MS)
        self._watch_server.timeout.connect(self._server_notice)
        self._watch_server.start()
        self.restore_ui()
        self._privacy_changed(self.app.privacy_view(self.app.settings.local_layers))

    # --- panes and state ----------------------------------------------------------------------

    def show_pane(self, pane: str) -> None:
        self.stack.setCurrentWidget(self.chat_view if pane == "chat" else self.drafting_pane)
        if self.sidebar.pane != pane:
            self.sidebar.set_pane(pane)
        (self.chat_view.composer if pane == "chat" else self.drafting_pane.editor).setFocus()

    def _new(self) -> None:
        self.sidebar.new_item()
        if self.sidebar.pane == "chat":
            self.chat_view.composer.setFocus()

    def _search(self) -> None:
        self.show_pane("chat")
        self.sidebar.search.setFocus()
        self.sidebar.search.selectAll()

    def _stop(self) -> None:
        self.app.chat.stop()
        self.app.drafting.stop()

    def show_progress(self, stage: str, fraction: float) -> None:
        if stage == DOWNLOAD_STAGE:
            if self.download is None:
                self.download = DownloadDialog(self)
            self.download.update_progress(fraction)
            self.download_shown = fraction
            if fraction >= 1.0:
                self._end_download()
        self.status.setText(stage[:1].upper() + stage[1:] + "…")
        self.progress_bar.show()
        self.progress_bar.setValue(int(max(0.0, min(1.0, fraction)) * 100))

    def _idle_status(self) -> None:
        busy = self.app.chat.busy or self.app.drafting.busy
        if not busy:
            self.progress_bar.hide()
        self.status.setText(
            ("Writing… (Esc to stop)  ·  " if busy else "") + self.app.connection_text()
        )

    def show_error(self, err: VeilError) -> None:
        """One error line in the banner of the pane the user is looking at."""
        pane = self.chat_view if self.sidebar.pane == "chat" else self.drafting_pane
        pane.error.show_error(err)

    def confirm_close_unsaved(self, unsaved: dict[str, str]) -> bool:
        """Closing would lose text that could not be saved: ask (True = close anyway)."""
        from PySide6.QtWidgets import QMessageBox

        what = ", ".join(list(unsaved)[:3]) + (" and more" if len(unsaved) > 3 else "")
        reason = next(iter(unsaved.values()))
        answer = QMessageBox.warning(
            self,
            "Your last changes are not saved",
            f"Veil could not save {what}: {reason}.\n\nIf you close now, that text is lost. "
            "Copy it somewhere safe first, or fix the problem and keep Veil open.",
            QMessageBox.StandardButton.Close | QMessageBox.StandardButton.Cancel,
            QMessageBox.StandardButton.Cancel,
        )
        return answer == QMessageBox.StandardButton.Close

    def _end_download(self) -> None:
        if self.download is not None:
            self.download.hide()
            self.download.deleteLater()
            self.download = None

    def _load_failed(self, err: VeilError) -> None:
        self._end_download()
        self._idle_status()
        state = self.app.host.state
        cause = problems.cause_of(err, state)
        shown = problems.explain(err, state)
        if cause in (problems.INVITE, problems.MODEL, problems.SETTINGS):
            self.chat_view.error.show_error(shown, "Open Settings", self.open_settings, cause)
        else:
            self.chat_view.error.show_error(shown, "Try again", self.app.connect_now, cause)

    def _resolved(self, cause: str) -> None:
        """A problem is gone: take its banners away (and tell the status bar)."""
        for banner in (self.chat_view.error, self.drafting_pane.error):
            banner.clear(cause)
        self._idle_status()

    def _maybe_reconnect(self) -> None:
        if self.app.chat.needs_reconnect() and not self.app.drafting.busy:
            self.app.chat.reconnect()

    def _soon_reconnect(self) -> None:
        """After a failed reply, try the server again at once (the built-in one restarts)."""
        if self.app.host.state == OFFLINE:
            later(300, self, self._maybe_reconnect)

    def _server_notice(self) -> None:
        """Tell the user while the built-in server is being restarted, and when it is back."""
        notice = self.app.host.server_notice()
        banner = self.chat_view.error
        if notice == RESTARTING and (banner.isHidden() or banner.cause == "restart"):
            banner.show_notice(
                "The built-in server on this computer stopped",
                "Veil is restarting it; a reply being written continues when it is back.",
                cause="restart",
            )
            self._idle_status()
            self.gauges.refresh()
        elif notice == RESTARTED:
            self.app.host.clear_server_notice()
            banner.clear("restart")
            self.gauges.refresh()
            self.status.setText(
                "Veil restarted the built-in server.  ·  " + self.app.connection_text()
            )

    def _privacy_changed(self, view: PrivacyView) -> None:
        self.chat_view.set_welcome(welcome_text(view))

    # --- dialogs ------------------------------------------------------------------------------

    def open_settings(self) -> None:
        dlg = SettingsDialog(self.app.settings, self)
        if run_modal(dlg) and dlg.result_settings is not None:
            self.apply_settings(dlg.result_settings, reconnect=True)

    def apply_settings(self, s: Settings, reconnect: bool = False) -> None:
        """Apply settings (Save in the Settings dialog reconnects at once)."""
        try:
            self.app.apply_settings(s, reconnect=reconnect)
        except VeilError as exc:
            self.chat_view.error.show_error(exc, cause=problems.SETTINGS)
            return
        app = QApplication.instance()
        if isinstance(app, QApplication):
            Theme.apply(app, s.theme, s.font_size)
        self.side_scroll.setFixedWidth(side_panel_width(s.font_size))
        self.privacy.refresh()
        self.gauges.refresh()

    def open_audit_details(self) -> None:
        k = self.app.settings.local_layers
        name = self.app.model_name()
        data = audit_info.latest(name)
        rows = audit_info.rows(name, self.app.n_layers)
        date = str(data.get("date", ""))[:10] if data else ""
        dlg = AuditDialog(
            name,
            date,
            rows,
            k,
            self,
            fully_local=self.app.is_fully_local(k),
            shipped=audit_info.is_shipped(data, name),
        )
        run_modal(dlg)

    def ask_yes(self, title: str, text: str, yes: str) -> bool:
        """A question with a ``yes`` button and Cancel (tests replace this)."""
        box = QMessageBox(QMessageBox.Icon.Question, title, text, parent=self)
        go = box.addButton(yes, QMessageBox.ButtonRole.AcceptRole)
        box.addButton(QMessageBox.StandardButton.Cancel)
        box.setDefaultButton(go)
        run_modal(box)
        return box.clickedButton() is go

    def audit_question(self, ks: list[int], seconds: float) -> str:
        """What "Run privacy audit" asks before it starts."""
        name = self.app.model_name()
        data = audit_info.latest(name)
        date = str(data.get("date", ""))[:10] if data else ""
        if data is None:
            replaces = "The results will appear beside the slider."
        elif audit_info.is_shipped(data, name):
            replaces = (
                f"Its results replace the figures shown now, measured by the Veil team on {date}."
            )
        else:
            replaces = f"Its results replace the figures from your audit of {date}."
        k = self.app.settings.local_layers
        local = (
            f" At your current setting ({k}) nothing is sent, so it measures the settings that "
            "use a server."
            if self.app.is_fully_local(k)
            else ""
        )
        names = [str(x) for x in ks]
        depths = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        return (
            "The privacy audit measures how many words someone who runs the server could "
            f"recover from what this computer sends, at {len(ks)} settings ({depths} layers at "
            f"each end).{local} It uses sample text that comes with Veil, not your chats or "
            f"documents.\n\nIt takes {audit_info.human_duration(seconds)} on this computer, "
            "which is busy meanwhile: replies wait until it ends. You can cancel it at any "
            f"time.\n\n{replaces}"
        )

    def run_audit(self) -> None:
        """Ask first (with a time estimate), run with a Cancel button, say when it is done."""
        if self._audit_task is not None:  # the button reads "Cancel audit"
            self._audit_task.cancel.cancel()
            self.privacy.run_button.setEnabled(False)
            self.privacy.set_audit_status("Cancelling the audit…")
            return
        if not audit_info.audit_runner_available():
            self.chat_view.error.show_error(
                VeilError("the privacy audit is not part of this installation"),
                cause=problems.AUDIT,
            )
            return
        n = self.app.n_layers
        if n is None:
            return
        ks = audit_info.audit_depths(n, self.app.settings.local_layers)
        if not ks:
            self.chat_view.error.show_error(
                VeilError(f"this model has too few layers ({n}) to split, so nothing to audit"),
                cause=problems.AUDIT,
            )
            return
        name = self.app.model_name()
        last = self.app.store.get(f"audit.last:{name}")
        last_t = (float(last[0]), [int(x) for x in last[1]]) if last else None
        est = audit_info.estimate_seconds(ks, self.app.model_params(), last_t)
        if not self.ask_yes("Run the privacy audit?", self.audit_question(ks, est), "Run audit"):
            return
        model = self.app.settings.model
        t0 = time.monotonic()

        def work(ctx: TaskContext) -> object:
            return audit_info.run_blocking(model, ks, ctx.progress, lambda: ctx.cancel.cancelled)

        def end(status: str, color: str) -> None:
            self._audit_task = None
            self.privacy.run_button.setText("Run privacy audit…")
            self.privacy.run_button.setEnabled(True)
            self.privacy.set_audit_status(status, color)
            self.privacy.refresh()
            self._idle_status()

        def done(_: object) -> None:
            took = time.monotonic() - t0
            self.app.store.set(f"audit.last:{name}", [round(took, 1), ks])
            self.app.resolved.emit(problems.AUDIT)
            end(
                f"Audit finished in {audit_info.elapsed_text(took)}. The figures above now come "
                "from it.",
                "ok",
            )

        def failed(err: VeilError) -> None:
            if isinstance(err, Cancelled):
                end("Audit cancelled; the figures above are unchanged.", "muted")
                return
            end("The audit did not finish; the figures above are unchanged.", "bad")
            self.chat_view.error.show_error(err, cause=problems.AUDIT)

        task = Task("audit", work, on_done=done, on_error=failed, on_progress=self.show_progress)
        self._audit_task = task
        self.privacy.run_button.setText("Cancel audit")
        self.privacy.set_audit_status(
            f"Running the privacy audit ({audit_info.human_duration(est)})…"
        )
        self.app.executor.submit(task)

    def _export_chat(self, conv_id: int) -> None:
        self.app.chat.open(conv_id)
        self.chat_view.export()

    def _export_document(self, doc_id: int) -> None:
        self.app.drafting.open(doc_id)
        self.drafting_pane.export()

    # --- persistence --------------------------------------------------------------------------

    def restore_ui(self) -> None:
        store = self.app.store
        geo = store.get("ui.geometry")
        if geo:
            self.restoreGeometry(QByteArray(base64.b64decode(geo)))
        else:
            self.resize(1280, 800)
        self.app.chat.restore_last()
        self.app.drafting.restore_last()
        self.show_pane(str(store.get("ui.pane", "chat")))

    def save_ui(self) -> None:
        store = self.app.store
        store.set("ui.geometry", base64.b64encode(bytes(self.saveGeometry().data())).decode())
        store.set("ui.pane", self.sidebar.pane)

    def closeEvent(self, e: QCloseEvent) -> None:
        self.save_ui()
        self.drafting_pane.save_now()
        self.chat_view.save_draft_now()
        unsaved = dict(self.app.store.unsaved)
        if unsaved and not self.confirm_close_unsaved(unsaved):
            e.ignore()  # keep the window (and the text in it) open
            return
        self._reconnect.stop()
        self._watch_server.stop()
        self._stop()
        if self._audit_task is not None:
            self._audit_task.cancel.cancel()
        shutdown = getattr(self.executor, "shutdown", None)
        if callable(shutdown):
            shutdown()
        # the stopped reply's last text and its end arrive as queued calls: handle them while
        # the database is still open, so a partial reply is saved (marked "Stopped")
        QCoreApplication.sendPostedEvents(None, QEvent.Type.MetaCall)
        self.app.close()
        super().closeEvent(e)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="veil", description="Open the Veil desktop app.")
    p.add_argument("--data-dir", default=None, help="folder for chats, documents and settings")
    p.add_argument("--smoke-test", metavar="OUT.png", default=None)
    p.add_argument("--pane", choices=("chat", "drafting"), default="chat")
    p.add_argument("--model", default=None, help="model for this run (default: the settings')")
    p.add_argument("--theme", choices=("system", "light", "dark"), default=None)
    p.add_argument("--max-tokens", type=int, default=48, help="smoke test reply length")
    return p.parse_args(list(argv))


def create(args: argparse.Namespace, data_dir: str | None) -> tuple[AppController, MainWindow]:
    """The controller, worker and window (the QApplication must exist)."""
    from app.worker import QtExecutor

    executor = QtExecutor()  # its thread starts with the first task (after start-up)
    app = AppController(executor, data_dir)
    if args.model:
        app.settings.model = args.model
        app.host.model = args.model
    if args.theme:
        app.settings.theme = args.theme
    qapp = QApplication.instance()
    assert isinstance(qapp, QApplication)
    Theme.apply(qapp, app.settings.theme, app.settings.font_size)
    window = MainWindow(app, executor)
    return app, window


def _startup_failed(exc: VeilError) -> int:
    """One message (stderr, and a dialog on a real display) and a clean exit."""
    print(f"veil: error: {exc}", file=sys.stderr)
    if QApplication.platformName() not in ("offscreen", "minimal"):
        from PySide6.QtWidgets import QMessageBox

        QMessageBox.critical(None, "Veil cannot start", str(exc))
    return 2


def _show_veil_errors_in(window: MainWindow) -> None:
    """A VeilError that escapes a button's handler (say, a delete on a damaged database)
    becomes the error banner, not a traceback on stderr."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: object) -> None:
        if isinstance(exc, VeilError):
            log.warning("%s", exc)
            window.show_error(exc)
        else:
            previous(kind, exc, tb)  # type: ignore[arg-type]

    sys.excepthook = hook


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    qapp = QApplication.instance() or QApplication([sys.argv[0] if sys.argv else "veil"])
    assert isinstance(qapp, QApplication)
    qapp.setApplicationName("Veil")
    qapp.setWindowIcon(app_icon())
    if args.smoke_test:
        from app.smoke import run_smoke

        return run_smoke(args)
    try:
        app, window = create(args, args.data_dir)
    except VeilError as exc:
        return _startup_failed(exc)
    _show_veil_errors_in(window)
    if not app.settings.first_run_done:
        dlg = FirstRunDialog(window)
        if not run_modal(dlg):
            window.close()
            _dispose(window)
            return 0
        try:
            app.choose_demo() if dlg.choice == DEMO else app.choose_server(dlg.invite)
        except VeilError as exc:
            window.chat_view.error.show_error(exc, cause=problems.SETTINGS)
    window.show()
    app.load_config()
    app.connect_now()
    rc = int(qapp.exec())
    _dispose(window)
    return rc


def _dispose(window: QWidget) -> None:
    """Delete the window (and every dialog under it) while Qt is still running, so nothing is
    left for PySide's clean-up at interpreter exit to delete a second time."""
    window.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
