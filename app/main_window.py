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

from PySide6.QtCore import QByteArray, Qt, QTimer
from PySide6.QtGui import QCloseEvent, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QApplication,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QProgressBar,
    QScrollArea,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.core import audit_info
from app.core.controller import AppController
from app.core.settings import Settings
from app.core.tasks import Task, TaskContext
from app.views.audit_dialog import AuditDialog
from app.views.chat_view import ChatView
from app.views.drafting_pane import DraftingPane
from app.views.first_run_dialog import DEMO, FirstRunDialog
from app.views.gauges_panel import GaugesPanel
from app.views.privacy_panel import PrivacyPanel
from app.views.settings_dialog import SettingsDialog
from app.views.sidebar import Sidebar
from app.views.theme import Theme, app_icon
from engine.errors import VeilError

log = logging.getLogger("veil.app")
RECONNECT_EVERY_MS = 5000


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
        scroll.setFixedWidth(330)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
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
        app.chat.progress.connect(self.show_progress)
        app.drafting.progress.connect(self.show_progress)
        app.chat.busy_changed.connect(lambda _: self._idle_status())
        app.drafting.busy_changed.connect(lambda _: self._idle_status())
        app.config_loaded.connect(self._idle_status)
        app.load_failed.connect(self._load_failed)
        app.gauges_changed.connect(lambda _: self._idle_status())

        QShortcut(QKeySequence("Ctrl+N"), self, self._new)
        QShortcut(QKeySequence("Ctrl+F"), self, self._search)
        QShortcut(QKeySequence("Ctrl+,"), self, self.open_settings)
        QShortcut(QKeySequence(Qt.Key.Key_Escape), self, self._stop)
        self._reconnect = QTimer(self, interval=RECONNECT_EVERY_MS)
        self._reconnect.timeout.connect(self._maybe_reconnect)
        self._reconnect.start()
        self.restore_ui()

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

    def _load_failed(self, err: VeilError) -> None:
        self._idle_status()
        self.chat_view.error.show_error(err, "Try again", self.app.connect_now)

    def _maybe_reconnect(self) -> None:
        if self.app.chat.needs_reconnect() and not self.app.drafting.busy:
            self.app.chat.reconnect()

    # --- dialogs ------------------------------------------------------------------------------

    def open_settings(self) -> None:
        dlg = SettingsDialog(self.app.settings, self)
        if dlg.exec() and dlg.result_settings is not None:
            self.apply_settings(dlg.result_settings)

    def apply_settings(self, s: Settings) -> None:
        try:
            self.app.apply_settings(s)
        except VeilError as exc:
            self.chat_view.error.show_error(exc)
            return
        app = QApplication.instance()
        if isinstance(app, QApplication):
            Theme.apply(app, s.theme, s.font_size)
        self.privacy.refresh()
        self.gauges.refresh()

    def open_audit_details(self) -> None:
        k = self.app.settings.local_layers
        data = audit_info.latest(self.app.model_name())
        rows = audit_info.rows(self.app.model_name())
        date = str(data.get("date", ""))[:10] if data else ""
        AuditDialog(self.app.model_name(), date, rows, k, self).exec()

    def run_audit(self) -> None:
        if not audit_info.audit_runner_available():
            self.chat_view.error.show_error(
                VeilError("the privacy audit is not part of this installation")
            )
            return
        n = self.app.n_layers
        if n is None:
            return
        ks = audit_info.audit_depths(n, self.app.settings.local_layers)
        model = self.app.settings.model
        self.privacy.run_button.setEnabled(False)

        def work(ctx: TaskContext) -> object:
            return audit_info.run_blocking(model, ks, ctx.progress, lambda: ctx.cancel.cancelled)

        def done(_: object) -> None:
            self.privacy.run_button.setEnabled(True)
            self.privacy.refresh()
            self._idle_status()

        def failed(err: VeilError) -> None:
            done(None)
            self.chat_view.error.show_error(err)

        task = Task("audit", work, on_done=done, on_error=failed, on_progress=self.show_progress)
        self._audit_task = task
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
        self._reconnect.stop()
        self._stop()
        task = getattr(self, "_audit_task", None)
        if task is not None:
            task.cancel.cancel()
        shutdown = getattr(self.executor, "shutdown", None)
        if callable(shutdown):
            shutdown()
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

    executor = QtExecutor()
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
        print(f"veil: error: {exc}", file=sys.stderr)
        return 2
    if not app.settings.first_run_done:
        dlg = FirstRunDialog(window)
        if not dlg.exec():
            window.close()
            return 0
        try:
            app.choose_demo() if dlg.choice == DEMO else app.choose_server(dlg.invite)
        except VeilError as exc:
            window.chat_view.error.show_error(exc)
    window.show()
    app.load_config()
    app.connect_now()
    return int(qapp.exec())
