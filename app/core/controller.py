"""The app as one Qt-free object: store + settings + engine host + chat + drafting.

The widgets wrap an :class:`AppController`; tests drive it directly with an
:class:`~app.core.tasks.InlineExecutor`.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from app.core import audit_info, problems
from app.core.api_host import ApiService
from app.core.chat import ChatController
from app.core.documents.controller import DocumentsController
from app.core.documents.index import DocIndex
from app.core.drafting import DraftingController
from app.core.engine_host import (
    CONNECTED,
    CONNECTING,
    IDLE,
    LOADING,
    LOCAL,
    NEEDS_SETUP,
    OFFLINE,
    EngineHost,
)
from app.core.gauges import GaugeState, human_bytes, local_weight_bytes, max_local_layers
from app.core.paths import data_dir
from app.core.privacy import PrivacyView, describe, fully_local, setting_words
from app.core.settings import MODE_DEMO, MODE_SERVER, SERVER_MODEL, Settings
from app.core.storage import Store
from app.core.tasks import Event, Executor, Task, TaskContext
from engine.errors import VeilError
from engine.loading import DEFAULT_MODEL


def _where(model: str, mode: str, invite: str) -> tuple[str, str, str]:
    """What a connection depends on (the invite only matters for the organization's server)."""
    return model, mode, invite if mode == MODE_SERVER else ""


# a good reply or suggestion shows these problems are gone
REPLY_FIXES = (
    problems.REPLY,
    problems.CONNECTION,
    problems.MODEL,
    problems.INVITE,
    problems.SETTINGS,
)


class AppController:
    def __init__(
        self,
        executor: Executor,
        folder: str | os.PathLike[str] | None = None,
        settings: Settings | None = None,
        doc_executor: Executor | None = None,
    ) -> None:
        self.folder: Path = data_dir(folder)
        # the audit store reads VEIL_DATA_DIR; keep it pointing at the same folder
        os.environ["VEIL_DATA_DIR"] = str(self.folder)
        self.store = Store.open(self.folder)
        self.settings = settings if settings is not None else Settings.load(self.store)
        s = self.settings
        self.host = EngineHost(s.model, s.mode, s.invite, s.local_layers, s.dtype, s.device)
        self.host.key_folder = self.folder  # an imported organisation key (app/core/org_key.py)
        self.executor = executor
        self.chat = ChatController(self.store, self.host, executor, s)
        self.drafting = DraftingController(self.store, self.host, executor, s)
        # files read on their own thread (doc_executor), so attaching never waits for a reply
        self.documents = DocumentsController(
            DocIndex.open(self.folder), self.chat, doc_executor or executor
        )
        self.documents.indexed.connect(
            lambda _m, report: None if report.failed else self._resolve(problems.DOCUMENTS)
        )
        self.api = ApiService(self.host, s)
        self.api_changed = Event()  # (VeilError | None) the API started, stopped or failed
        self.gauge_state = GaugeState()
        self.gauges_changed = Event()  # (GaugeState)
        self.config_loaded = Event()  # ()  n_layers known: the slider can be set up
        self.load_failed = Event()  # (VeilError)
        self.model_unavailable = False  # the selected model failed to load: none is in use
        self.split_changed = Event()  # (k)
        self._shown_key_id: str | None = None  # the keyed audit the privacy panel shows
        self.resolved = Event()  # (cause) a problem of this cause is gone: clear its banners
        for ev in (self.chat.gauges, self.drafting.gauges):
            ev.connect(self._on_gauges)
        self.chat.state_changed.connect(self._on_state)
        self.chat.busy_changed.connect(self._on_busy)
        self.drafting.busy_changed.connect(self._on_busy)
        self.drafting.busy_changed.connect(lambda b: self._on_state(self.host.state))
        self.chat.finished.connect(lambda _r: self._resolve(*REPLY_FIXES))
        self.drafting.suggestion_finished.connect(
            lambda sg: None if sg.error else self._resolve(*REPLY_FIXES)
        )

    # --- settings -----------------------------------------------------------------------------

    def save_settings(self) -> None:
        self.settings.save(self.store)

    def apply_settings(self, new: Settings, reconnect: bool = False) -> None:
        """Validate and apply. A new model or server is used from the next task on; with
        ``reconnect`` (Settings → Save) Veil connects at once instead of on the next message,
        and tries an unreachable server again at once."""
        new.validate()
        s = self.settings
        for name, value in vars(new).items():
            setattr(s, name, value)
        self.save_settings()
        self._resolve(problems.INVITE, problems.SETTINGS)
        self.sync_api()
        host = self.host
        if _where(s.model, s.mode, s.invite) == _where(host.model, host.mode, host.invite):
            if reconnect and host.state == OFFLINE:
                self.chat.reconnect()
            return
        # stop any reply, then switch on the worker thread (after the stopped task ends)
        self.chat.stop()
        self.drafting.stop()
        model_changed = s.model != host.model

        def switched(_: Any) -> None:
            if model_changed:
                host.request_split(s.local_layers)
                self.load_config()
            self._on_state(host.state)
            if reconnect:
                self.connect_now()

        self.executor.submit(
            Task(
                "reconfigure",
                lambda ctx: host.reconfigure(s.model, s.mode, s.invite),
                on_done=switched,
                on_error=self._load_error,
            )
        )

    def choose_demo(self) -> None:
        new = copy.copy(self.settings)
        new.first_run_done, new.mode = True, MODE_DEMO
        if new.model == SERVER_MODEL:
            new.model = DEFAULT_MODEL
        self.apply_settings(new)

    def choose_server(self, invite: str) -> None:
        """First start with an invite code; a damaged code is refused and nothing changes."""
        invite = invite.strip()
        if not invite:
            raise VeilError("paste the invite code first", hint="your IT department has it")
        new = copy.copy(self.settings)
        new.first_run_done, new.mode, new.invite = True, MODE_SERVER, invite
        new.model = SERVER_MODEL  # staff never handle model files: it comes from the server
        self.apply_settings(new)

    def sync_api(self) -> None:
        """Start or stop "Let other programs use Veil" as the settings say."""
        try:
            self.api.sync()
        except VeilError as exc:
            self.api_changed.emit(exc)
            return
        self.api_changed.emit(None)

    # --- split / privacy ----------------------------------------------------------------------

    def load_config(self) -> None:
        """Read the model's config in the background (first run may convert the model)."""

        def done(_: Any) -> None:
            cfg = self.host.config
            self.model_unavailable = cfg is None
            if cfg is not None:
                k = max(1, min(self.settings.local_layers, (cfg.n_layers + 1) // 2))
                self.settings.local_layers = k
                self.host.request_split(k)
                self._resolve(problems.MODEL)
            self.config_loaded.emit()

        self.executor.submit(
            Task(
                "config",
                lambda ctx: self.host.read_config_blocking(ctx.progress),
                on_done=done,
                on_error=self._load_error,
                on_progress=lambda st, f: self.chat.progress.emit(st, f),
            )
        )

    def _load_error(self, err: VeilError) -> None:
        """Loading failed: without a config no model is in use (a switch to a model that
        cannot be opened leaves none), and the panel must not show the previous one's."""
        self.model_unavailable = self.host.config is None
        self.load_failed.emit(err)

    def connect_now(self) -> None:
        """Load the model and connect in the background, so the first message is quick."""

        def done(_: Any) -> None:
            self._on_state(self.host.state)

        def failed(err: VeilError) -> None:
            self._on_state(self.host.state)
            self._load_error(err)

        def work(ctx: TaskContext) -> None:
            self.host.ensure_ready_blocking(ctx.progress)

        self._on_state(LOADING)
        self.executor.submit(
            Task(
                "connect",
                work,
                on_done=done,
                on_error=failed,
                on_progress=lambda st, f: self.chat.progress.emit(st, f),
            )
        )

    def set_local_layers(self, k: int) -> None:
        """Slider moved: re-split from the next message on (the conversation stays)."""
        self.settings.local_layers = k
        self.save_settings()
        self.host.request_split(k)
        self.split_changed.emit(k)

    @property
    def n_layers(self) -> int | None:
        return self.host.config.n_layers if self.host.config else None

    @property
    def max_k(self) -> int | None:
        return self.host.max_k

    def memory_text(self, k: int) -> str:
        """The model's weights on this computer at split ``k`` ("Model memory needed here"),
        always from :meth:`EngineHost.memory_for_k` (one function, so a quantized client only
        changes that one)."""
        b = self.host.memory_for_k(k)
        return human_bytes(b) if b is not None else "-"

    def model_params(self) -> float | None:
        """Parameters of the whole model (for the audit time estimate)."""
        cfg = self.host.config
        if cfg is None:
            return None
        return local_weight_bytes(cfg, max_local_layers(cfg), "float32") / 4

    def model_name(self) -> str:
        if self.host.runner is not None:
            return str(self.host.runner.client.name)
        if self.host.part is not None:  # the organisation's model, from its server
            return self.host.part.manifest.model
        spec = self.settings.model.strip()
        return spec if "/" in spec else spec.lower()

    def is_fully_local(self, k: int) -> bool:
        n = self.n_layers
        return n is not None and fully_local(n, k)

    def keyed_audit_name(self) -> str | None:
        """The name a keyed audit for the key in use is stored under (None: no keyed server)."""
        key_id = self.host.key_id
        if key_id is None:
            return None
        from engine.keyed import audit_name

        return audit_name(self.model_name(), key_id)

    def audit_model_name(self) -> str:
        """The name of the audit the details show: the model's, or with a keyed server in use
        and a keyed audit stored for its key (`veil audit --org-key`), that keyed audit's."""
        keyed = self.keyed_audit_name()
        if keyed is not None and audit_info.latest(keyed) is not None:
            return keyed
        return self.model_name()

    def shown_audit(self, k: int) -> tuple[str, audit_info.AuditFigure, bool]:
        """(stored name, figure, measured with the key) of the audit the panel shows at ``k``.

        With a keyed server in use: the keyed audit's figure where one measured ``k``, else the
        plain audit's (the server's or this computer's). Our measurements found the key does not
        lower what the server reads (docs/privacy.md, "Verdict on the keyed split"), so the
        plain figure stands for the keyed split; a lower keyed figure is shown only when a
        keyed audit measured it."""
        name = self.model_name()
        plain = audit_info.figure(name, k)
        keyed = self.keyed_audit_name()
        if keyed is None:
            return name, plain, False
        fig = audit_info.figure(keyed, k)
        if fig.top1 is not None or (plain.top1 is None and fig.date):
            return keyed, fig, True
        return name, plain, False

    def audit_figure(self, k: int) -> audit_info.AuditFigure:
        return self.shown_audit(k)[1]

    def privacy_view(self, k: int) -> PrivacyView:
        """The one word, sentence and figure beside the slider (no audit figure when k runs
        fully on this computer). With a keyed server in use, a keyed audit's figures labelled
        as measured with the organisation's key, else the plain audit's, labelled as measured
        without it (see :meth:`shown_audit`)."""
        n = self.n_layers
        if n is not None and fully_local(n, k):
            return describe(n, k, None)
        name, fig, with_key = self.shown_audit(k)
        reply = audit_info.reply_share(name, k)
        keyed = self.host.key_id is not None
        return describe(n, k, fig, reply, keyed=keyed, key_measured=with_key)

    def split_summary(self, k: int) -> str:
        n = self.n_layers
        if n is None:
            if self.model_unavailable:
                return "No model is loaded: the one in Settings could not be opened."
            return "Loading the model..."
        local = min(2 * k, n)
        if local >= n:
            return f"All {n} layers run on this computer. Nothing is sent to a server."
        here = setting_words(n, k)  # the same words as the audit details and its question
        return f"{here[:1].upper()}{here[1:]}; {n - local} on the server."

    # --- gauges / state -----------------------------------------------------------------------

    def _on_gauges(self, values: dict[str, Any]) -> None:
        g = self.gauge_state
        if values.get("tokens_per_s") is not None:
            g.record(float(values["tokens_per_s"]))
        if values.get("tokens_per_round_trip") is not None:
            g.tokens_per_round_trip = float(values["tokens_per_round_trip"])
        g.rtt_ms = values.get("rtt_ms")
        if values.get("memory_bytes") is not None:
            g.memory_bytes = int(values["memory_bytes"])
            g.memory_label = str(values.get("memory_label", g.memory_label))
        self.gauges_changed.emit(g)

    def _on_state(self, state: str) -> None:
        key_id = self.host.key_id
        if key_id != self._shown_key_id:  # a keyed server connected (or gone): other figures
            self._shown_key_id = key_id
            self.split_changed.emit(self.settings.local_layers)
        g = self.gauge_state
        g.connection = state
        if state == LOCAL:
            g.rtt_ms = None
        if state in (CONNECTED, LOCAL):
            self._resolve(problems.CONNECTION, problems.INVITE, problems.SETTINGS)
        self.gauges_changed.emit(g)

    def _on_busy(self, busy: bool) -> None:
        self.gauge_state.generating = busy
        if busy:
            self.gauge_state.begin_run()
        else:
            self.gauge_state.connection = self.host.state
        self.gauges_changed.emit(self.gauge_state)

    def _resolve(self, *causes: str) -> None:
        for cause in causes:
            self.resolved.emit(cause)

    def runs_fully_local(self) -> bool:
        """True when replies are written with no server (the applied split, or the wanted one
        before the first reply)."""
        if self.host.state == LOCAL:
            return True
        applied = self.host.applied_k
        return self.is_fully_local(applied if applied is not None else self.settings.local_layers)

    def connection_text(self) -> str:
        """One line for the status bar and the performance panel, without jargon."""
        state, where = self.host.state, self.host.trunk_label()
        if self.host.server_notice() == "restarting":
            return f"Restarting {where}"
        if state == IDLE:
            connecting = self.gauge_state.connection == LOADING
            return "Connecting…" if connecting else "Not connected yet"
        if state == LOCAL:
            return "Running fully on this computer (no server)"
        if state == CONNECTED:
            return f"Connected to {where}"
        if state == CONNECTING:
            return f"Connecting to {where}"
        if state == OFFLINE:
            return f"Cannot reach {where}"
        if state == NEEDS_SETUP:
            return "Not connected: check the invite code in Settings"
        return str(state)

    # --- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop work, stop the demo server, close the database."""
        self.chat.stop()
        self.drafting.stop()
        self.api.stop()
        self.host.shutdown_blocking()
        self.documents.index.close()
        self.store.close()
