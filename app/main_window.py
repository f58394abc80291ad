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
from collections.abc import Sequence

from PySide6.QtCore import QByteArray, QCoreApplication, QEvent, Qt, QTimer
from PySide6.QtGui import QCloseEvent, QKeySequence, QResizeEvent, QShortcut
from PySide6.QtWidgets import (
    QApplication,
    QDialog,
    QHBoxLayout,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QStackedWidget,
    QWidget,
)

from app import single_instance
from app.core import logfile, problems
from app.core.controller import AppController
from app.core.demo_model import is_demo_model
from app.core.engine_host import OFFLINE
from app.core.long_message import reading_text
from app.core.paths import data_dir
from app.core.privacy import PrivacyView, welcome_text
from app.core.settings import Settings
from app.core.tasks import Task
from app.progress import Eta
from app.views.about_dialog import AboutDialog
from app.views.audit_flow import AuditFlow
from app.views.chat_view import ChatView
from app.views.download_dialog import STAGE as DOWNLOAD_STAGE
from app.views.download_dialog import DownloadAsker, DownloadDialog
from app.views.drafting_pane import DraftingPane
from app.views.elided_label import ElidedLabel
from app.views.first_run_dialog import DEMO, FirstRunDialog
from app.views.matters_pane import MattersPane
from app.views.server_notice import show_server_notice
from app.views.settings_dialog import SettingsDialog
from app.views.side_panel import PanelLayout, PanelRail, SidePanel
from app.views.sidebar import Sidebar
from app.views.theme import Theme, app_icon, later
from engine.errors import VeilError

log = logging.getLogger("veil.app")
RECONNECT_EVERY_MS = 5000
WATCH_SERVER_MS = 1000


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
        self.sidebar = Sidebar(app.chat, app.drafting, documents=app.documents)
        row.addWidget(self.sidebar)
        self.stack = QStackedWidget()
        self.chat_view = ChatView(app.chat, documents=app.documents)
        self.drafting_pane = DraftingPane(app.drafting, documents=app.documents)
        self.matters_pane = MattersPane(app.documents, app.store)
        self.stack.addWidget(self.chat_view)
        self.stack.addWidget(self.drafting_pane)
        self.stack.addWidget(self.matters_pane)
        row.addWidget(self.stack, 1)
        self.side_scroll = SidePanel(app)
        self.side_panel = self.side_scroll.panel
        self.privacy, self.gauges = self.side_scroll.privacy, self.side_scroll.gauges
        row.addWidget(self.side_scroll)
        self.rail = PanelRail()
        row.addWidget(self.rail)
        self.panels = PanelLayout(self.sidebar, self.stack, self.side_scroll, self.rail)
        self.setCentralWidget(central)

        self.status = ElidedLabel("Starting…")  # plain text: it may quote a server
        self.status.setContentsMargins(10, 2, 0, 2)
        self._eta = Eta()
        self.progress_bar = QProgressBar()
        self.progress_bar.setRange(0, 100)
        self.progress_bar.setFixedWidth(200)
        self.progress_bar.setTextVisible(False)
        self.progress_bar.hide()
        self.statusBar().addWidget(self.status, 1)
        self.statusBar().addPermanentWidget(self.progress_bar)

        self.sidebar.pane_changed.connect(self.show_pane)
        self.sidebar.new_requested.connect(self._new)
        self.sidebar.settings_requested.connect(self.open_settings)
        self.sidebar.about_requested.connect(self.open_about)
        self.sidebar.export_chat.connect(self._export_chat)
        self.sidebar.export_document.connect(self._export_document)
        self.privacy.details_requested.connect(self.open_audit_details)
        self.privacy.audit_requested.connect(self.run_audit)
        self.privacy.view_changed.connect(self._privacy_changed)
        self.chat_view.settings_requested.connect(self.open_settings)
        app.resolved.connect(self._resolved)
        app.chat.failed.connect(lambda _e, _t: self._soon_reconnect())
        self.audit = AuditFlow(self)
        app.chat.progress.connect(self.show_progress)
        app.chat.reading.connect(self._show_reading)
        app.drafting.progress.connect(self.show_progress)
        # the organisation's model from its server: asked before, a dialog while downloading
        self.download_asker = DownloadAsker(self)
        self.download: DownloadDialog | None = None  # while a download runs
        self.download_shown = 0.0  # the last fraction it showed
        app.host.confirm_download = self.download_asker
        app.chat.busy_changed.connect(lambda _: self._idle_status())
        app.drafting.busy_changed.connect(lambda _: self._idle_status())
        app.config_loaded.connect(self._idle_status)
        app.config_loaded.connect(self._sync_demo)
        app.load_failed.connect(self._load_failed)
        app.gauges_changed.connect(lambda _: self._idle_status())
        app.store.failed.connect(self.show_error)  # a full or read-only disk: one line
        self._connect_documents()

        QShortcut(QKeySequence("Ctrl+N"), self, self._new)
        QShortcut(QKeySequence("Ctrl+F"), self, self._search)
        QShortcut(QKeySequence("Ctrl+,"), self, self.open_settings)
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, self._stop)
        QShortcut(QKeySequence("Ctrl+Q"), self, self.close)  # quit, as every desktop app
        QShortcut(QKeySequence(Qt.Key.Key_F1), self, self.open_about)
        self._reconnect = QTimer(self, interval=RECONNECT_EVERY_MS)
        self._reconnect.timeout.connect(self._maybe_reconnect)
        self._reconnect.start()
        self._watch_server = QTimer(self, interval=WATCH_SERVER_MS)
        self._watch_server.timeout.connect(lambda: show_server_notice(self))
        self._watch_server.start()
        self.restore_ui()
        self._privacy_changed(self.app.privacy_view(self.app.settings.local_layers))
        self._sync_demo()

    # --- panes and state ----------------------------------------------------------------------

    def show_pane(self, pane: str) -> None:
        panes = {"chat": self.chat_view, "drafting": self.drafting_pane}
        panes["matters"] = self.matters_pane
        pane = pane if pane in panes else "chat"
        self.stack.setCurrentWidget(panes[pane])
        if self.sidebar.pane != pane:
            self.sidebar.set_pane(pane)
        focus = {"chat": self.chat_view.composer, "drafting": self.drafting_pane.editor}
        focus.get(pane, self.sidebar.matter_list).setFocus()

    def _connect_documents(self) -> None:
        """Files, matters and the API: progress in the status bar, errors in the pane shown."""
        docs = self.app.documents
        docs.progress.connect(self.show_progress)
        docs.indexed.connect(lambda _m, _r: self._idle_status())
        docs.failed.connect(self._documents_failed)
        self.sidebar.matter_chosen.connect(self.matters_pane.show_matter)
        self.matters_pane.chat_opened.connect(lambda _c: self.show_pane("chat"))
        self.app.api_changed.connect(self._api_changed)

    def _documents_failed(self, err: VeilError) -> None:
        self._idle_status()
        pane = self.stack.currentWidget()
        banner = getattr(pane, "error", self.chat_view.error)
        banner.show_error(err, cause=problems.DOCUMENTS)

    def _api_changed(self, err: VeilError | None) -> None:
        self._idle_status()
        if err is not None:
            self.chat_view.error.show_error(
                VeilError(f"other programs cannot use Veil: {err.message}", err.hint),
                "Open Settings",
                self.open_settings,
                problems.SETTINGS,
            )

    def _new(self) -> None:
        """+ New chat / New document and Ctrl+N: focus goes where the user types next."""
        self.sidebar.new_item()
        if self.sidebar.pane == "chat":
            self.chat_view.composer.setFocus()
        else:
            self.drafting_pane.title.setFocus()

    def resizeEvent(self, e: QResizeEvent) -> None:
        super().resizeEvent(e)
        self.panels.apply()  # the side panel folds away where the conversation is cramped

    def _sync_demo(self) -> None:
        """The demo model's line, wherever it writes, while it is the model in use."""
        demo = is_demo_model(self.app.settings.model, self.app.model_name())
        self.chat_view.demo.set_demo(demo)
        self.drafting_pane.demo.set_demo(demo)

    def _show_reading(self, done: int, total: int, seconds_left: float | None) -> None:
        self.status.setText(reading_text(done, total, seconds_left))
        self.progress_bar.show()
        self.progress_bar.setValue(int(100 * done / max(total, 1)))

    def _search(self) -> None:
        self.show_pane("chat")
        self.sidebar.search.setFocus()
        self.sidebar.search.selectAll()

    def _stop(self) -> None:
        self.app.chat.stop()
        self.app.drafting.stop()

    def show_progress(self, stage: str, fraction: float) -> None:
        """The step in words, and a bar with its real progress where the step reports some,
        else a busy indicator (a step that only says when it starts and ends looked stuck)."""
        if stage == DOWNLOAD_STAGE:
            if self.download is None:
                self.download = DownloadDialog(self)
            self.download.update_progress(fraction)
            self.download_shown = fraction
            if fraction >= 1.0:
                self._end_download()
        left = self._eta.text(stage, fraction)  # long stages (a model's one-time conversion)
        self.status.setText(stage[:1].upper() + stage[1:] + "…" + left)
        self.progress_bar.show()
        measured = 0.0 < fraction < 1.0
        self.progress_bar.setRange(0, 100 if measured else 0)  # (0, 0): busy, moves by itself
        self.progress_bar.setValue(int(fraction * 100) if measured else 0)

    def _idle_status(self) -> None:
        busy = self.app.chat.busy or self.app.drafting.busy
        if not busy and not self.app.documents.busy:
            self.progress_bar.hide()
        api = f"  ·  API on {self.app.api.url()}" if self.app.api.running else ""
        self.status.setText(
            ("Writing… (Esc to stop)  ·  " if busy else "") + self.app.connection_text() + api
        )

    def show_error(self, err: VeilError) -> None:
        """One error line in the banner of the pane the user is looking at."""
        pane = self.stack.currentWidget()
        getattr(pane, "error", self.chat_view.error).show_error(err)

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

    def _privacy_changed(self, view: PrivacyView) -> None:
        self.chat_view.set_welcome(welcome_text(view))
        self.rail.set_privacy(view)

    # --- dialogs ------------------------------------------------------------------------------

    def open_settings(self) -> None:
        dlg = SettingsDialog(self.app.settings, self, key_folder=self.app.folder)
        if run_modal(dlg) and dlg.result_settings is not None:
            self.apply_settings(dlg.result_settings, reconnect=True)

    def open_about(self) -> None:
        run_modal(AboutDialog(self.app.folder, logfile.current(), logfile.log_dir(), self))

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
        self.side_scroll.set_font_size(s.font_size)
        self.privacy.refresh()
        self.gauges.refresh()
        self._sync_demo()
        later(0, self, self.panels.apply)  # once the new text size is laid out

    def open_audit_details(self) -> None:
        self.audit.details()

    def ask_yes(self, title: str, text: str, yes: str) -> bool:
        """A question with a ``yes`` button and Cancel (tests replace this)."""
        box = QMessageBox(QMessageBox.Icon.Question, title, text, parent=self)
        go = box.addButton(yes, QMessageBox.ButtonRole.AcceptRole)
        box.addButton(QMessageBox.StandardButton.Cancel)
        box.setDefaultButton(go)
        run_modal(box)
        return box.clickedButton() is go

    def audit_question(self, ks: list[int], seconds: float) -> str:
        return self.audit.question(ks, seconds)

    def run_audit(self) -> None:
        self.audit.run()

    @property
    def _audit_task(self) -> Task | None:
        return self.audit.task

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
        if self.audit.task is not None:
            self.audit.task.cancel.cancel()
        for ex in (self.executor, self.app.documents.executor):
            shutdown = getattr(ex, "shutdown", None)
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
    # files are read on a thread of their own: attaching never waits for a reply
    app = AppController(executor, data_dir, doc_executor=QtExecutor())
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
    logfile.setup()
    qapp = QApplication.instance() or QApplication([sys.argv[0] if sys.argv else "veil"])
    assert isinstance(qapp, QApplication)
    qapp.setApplicationName("Veil")
    qapp.setWindowIcon(app_icon())
    if args.smoke_test:
        from app.smoke import run_smoke

        return run_smoke(args)
    try:  # one Veil per data folder: a second start shows the running one instead
        guard = single_instance.claim(data_dir(args.data_dir))
        if guard is None:
            return 0
        app, window = create(args, str(guard.folder))
    except VeilError as exc:
        return _startup_failed(exc)
    guard.activated.connect(lambda: single_instance.bring_forward(window))
    _show_veil_errors_in(window)
    if not app.settings.first_run_done:
        dlg = FirstRunDialog(window, is_demo_model(app.settings.model))
        if not run_modal(dlg):
            window.close()
            _dispose(window)
            guard.release()
            return 0
        try:
            app.choose_demo() if dlg.choice == DEMO else app.choose_server(dlg.invite)
        except VeilError as exc:
            window.chat_view.error.show_error(exc, cause=problems.SETTINGS)
    window.show()
    app.load_config()
    app.connect_now()
    app.sync_api()  # "Let other programs use Veil", when switched on
    rc = int(qapp.exec())
    _dispose(window)
    guard.release()
    return rc


def _dispose(window: QWidget) -> None:
    """Delete the window (and every dialog under it) while Qt is still running, so nothing is
    left for PySide's clean-up at interpreter exit to delete a second time."""
    window.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
