"""The app as one Qt-free object: store + settings + engine host + chat + drafting.

The widgets wrap an :class:`AppController`; tests drive it directly with an
:class:`~app.core.tasks.InlineExecutor`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from app.core import audit_info
from app.core.chat import ChatController
from app.core.drafting import DraftingController
from app.core.engine_host import IDLE, LOCAL, EngineHost
from app.core.gauges import GaugeState, human_bytes
from app.core.paths import data_dir
from app.core.settings import MODE_DEMO, MODE_SERVER, Settings
from app.core.storage import Store
from app.core.tasks import Event, Executor, Task, TaskContext
from engine.errors import VeilError


class AppController:
    def __init__(
        self,
        executor: Executor,
        folder: str | os.PathLike[str] | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.folder: Path = data_dir(folder)
        # the audit store reads VEIL_DATA_DIR; keep it pointing at the same folder
        os.environ["VEIL_DATA_DIR"] = str(self.folder)
        self.store = Store.open(self.folder)
        self.settings = settings if settings is not None else Settings.load(self.store)
        s = self.settings
        self.host = EngineHost(s.model, s.mode, s.invite, s.local_layers, s.dtype, s.device)
        self.executor = executor
        self.chat = ChatController(self.store, self.host, executor, s)
        self.drafting = DraftingController(self.store, self.host, executor, s)
        self.gauge_state = GaugeState()
        self.gauges_changed = Event()  # (GaugeState)
        self.config_loaded = Event()  # ()  n_layers known: the slider can be set up
        self.load_failed = Event()  # (VeilError)
        self.split_changed = Event()  # (k)
        for ev in (self.chat.gauges, self.drafting.gauges):
            ev.connect(self._on_gauges)
        self.chat.state_changed.connect(self._on_state)
        self.chat.busy_changed.connect(self._on_busy)
        self.drafting.busy_changed.connect(self._on_busy)
        self.drafting.busy_changed.connect(lambda b: self._on_state(self.host.state))

    # --- settings -----------------------------------------------------------------------------

    def save_settings(self) -> None:
        self.settings.save(self.store)

    def apply_settings(self, new: Settings) -> None:
        """Validate and apply; a new model or server reconnects before the next message."""
        new.validate()
        s = self.settings
        for name, value in vars(new).items():
            setattr(s, name, value)
        self.save_settings()
        host = self.host
        if (s.model, s.mode, s.invite) == (host.model, host.mode, host.invite):
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

        self.executor.submit(
            Task(
                "reconfigure",
                lambda ctx: host.reconfigure(s.model, s.mode, s.invite),
                on_done=switched,
                on_error=lambda e: self.load_failed.emit(e),
            )
        )

    def choose_demo(self) -> None:
        self.settings.first_run_done = True
        self.settings.mode = MODE_DEMO
        self.apply_settings(self.settings)

    def choose_server(self, invite: str) -> None:
        invite = invite.strip()
        if not invite:
            raise VeilError("paste the invite code first", hint="your IT department has it")
        self.settings.first_run_done = True
        self.settings.mode = MODE_SERVER
        self.settings.invite = invite
        self.apply_settings(self.settings)

    # --- split / privacy ----------------------------------------------------------------------

    def load_config(self) -> None:
        """Read the model's config in the background (first run may convert the model)."""

        def done(_: Any) -> None:
            cfg = self.host.config
            if cfg is not None:
                k = max(1, min(self.settings.local_layers, (cfg.n_layers + 1) // 2))
                self.settings.local_layers = k
                self.host.request_split(k)
            self.config_loaded.emit()

        self.executor.submit(
            Task(
                "config",
                lambda ctx: self.host.read_config_blocking(ctx.progress),
                on_done=done,
                on_error=lambda e: self.load_failed.emit(e),
                on_progress=lambda st, f: self.chat.progress.emit(st, f),
            )
        )

    def connect_now(self) -> None:
        """Load the model and connect in the background, so the first message is quick."""

        def done(_: Any) -> None:
            self._on_state(self.host.state)

        def failed(err: VeilError) -> None:
            self._on_state(self.host.state)
            self.load_failed.emit(err)

        def work(ctx: TaskContext) -> None:
            self.host.ensure_ready_blocking(ctx.progress)

        self._on_state("Loading the model")
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
        b = self.host.memory_for_k(k)
        return human_bytes(b) if b is not None else "-"

    def model_name(self) -> str:
        if self.host.runner is not None:
            return str(self.host.runner.client.name)
        spec = self.settings.model.strip()
        return spec if "/" in spec else spec.lower()

    def audit_figure(self, k: int) -> audit_info.AuditFigure:
        return audit_info.figure(self.model_name(), k)

    def split_summary(self, k: int) -> str:
        n = self.n_layers
        if n is None:
            return "Loading the model..."
        local = min(2 * k, n)
        if local >= n:
            return f"All {n} layers run on this computer. No server is needed."
        return (
            f"{local} of {n} layers run on this computer ({k} at each end); "
            f"{n - local} on the server."
        )

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
        g = self.gauge_state
        g.connection = state
        if state == LOCAL:
            g.rtt_ms = None
        self.gauges_changed.emit(g)

    def _on_busy(self, busy: bool) -> None:
        self.gauge_state.generating = busy
        if not busy:
            self.gauge_state.connection = self.host.state
        self.gauges_changed.emit(self.gauge_state)

    def connection_text(self) -> str:
        state = self.host.state
        if state == IDLE:
            return "Not connected yet"
        return f"{state} - {self.host.trunk_label()}"

    # --- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop work, stop the demo server, close the database."""
        self.chat.stop()
        self.drafting.stop()
        self.host.shutdown_blocking()
        self.store.close()
