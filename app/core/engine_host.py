"""The engine as the app uses it: one client model, one trunk connection, re-split on demand.

Methods named ``*_blocking`` run on the worker thread (they load, connect, generate); the rest
are cheap and called from the GUI thread. The slider only records the wanted split; the next
task applies it, so a re-split never interrupts a reply and never loses the conversation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from app.core.gauges import local_weight_bytes, max_local_layers, process_memory_bytes
from app.core.long_message import READ_CHUNK
from app.core.settings import MODE_DEMO, MODE_SERVER, SERVER_MODEL
from app.core.trunk_sources import (
    CONNECT_OPTS,
    DemoServerSource,
    InProcessSource,
    InviteSource,
    TrunkSource,
    make_source,
)
from engine.config import ModelConfig
from engine.errors import FingerprintMismatch, TransportError, VeilError
from engine.generate import CancelToken, GenerationResult, Prefill, available_decoders, generate
from engine.loading import Progress, ResolvedModel, load_config, resolve
from engine.sampling import SamplingParams
from engine.session import parse_dtype
from engine.split import ClientModel, SplitPlan, SplitRunner, load_client

log = logging.getLogger("veil.app")

# connection states shown to the user
IDLE = "Not started"
LOADING = "Loading the model"
CONNECTING = "Connecting"
CONNECTED = "Connected"
LOCAL = "Fully on this computer"
OFFLINE = "Server unreachable"
NEEDS_SETUP = "Not connected"  # the settings cannot work (a damaged invite code): no retrying


class _CountingRunner:
    """Delegates to a runner and counts its forward calls and started blocks (= round trips)
    while generating."""

    def __init__(self, runner: SplitRunner) -> None:
        self._runner = runner
        self.wrapped = runner  # speculative decoding keeps what it learned with this runner
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._runner.forward(*args, **kwargs)

    def forward_states(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._runner.forward_states(*args, **kwargs)

    def hidden(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._runner.hidden(*args, **kwargs)

    def start(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._runner.start(*args, **kwargs)


class EngineHost:
    def __init__(
        self,
        model: str,
        mode: str = MODE_DEMO,
        invite: str = "",
        local_layers: int = 2,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> None:
        self.model, self.mode, self.invite = model, mode, invite
        # the app's data folder, where an imported organisation key lives (None: no key)
        self.key_folder: Path | None = None
        self.dtype, self.device = dtype, device
        self.wanted_k = local_layers
        self.runner: SplitRunner | None = None
        self.source: TrunkSource | None = None
        self.config: ModelConfig | None = None
        self.state = IDLE
        self.last_error = ""
        self._lock = threading.RLock()  # held by the worker while it uses the runner
        self.part: Any = None  # the organisation's model from its server (InstalledPart)
        # asked (on the worker thread) before that model is downloaded: (manifest, bytes) -> go?
        self.confirm_download: Callable[[Any, int], bool] | None = None

    # --- cheap, GUI thread ------------------------------------------------------------------

    @property
    def applied_k(self) -> int | None:
        return self.runner.client.plan.head if self.runner else None

    @property
    def max_k(self) -> int | None:
        if not self.config:
            return None
        if self.part is not None:  # the server's part holds local layers up to its k_max
            return min(max_local_layers(self.config), self.part.manifest.k_max)
        return max_local_layers(self.config)

    @property
    def uses_server_model(self) -> bool:
        return self.mode == MODE_SERVER and self.model == SERVER_MODEL

    def _spec(self, progress: Progress | None = None) -> str | ResolvedModel:
        """What the loaders read: the server's part (fetched when needed) or the model."""
        if not self.uses_server_model:
            return self.model
        if self.part is None:
            from engine.delivery.client import fetch_server_part

            self._check_invite()
            o = CONNECT_OPTS
            self.part = fetch_server_part(
                self.invite,
                confirm=self.confirm_download,
                progress=progress,
                timeout_s=o["connect_timeout_s"],
            )
        return self.part.resolved  # type: ignore[no-any-return]

    def request_split(self, k: int) -> None:
        """Use ``k`` local layers per side from the next message on."""
        self.wanted_k = k

    def reconfigure(self, model: str, mode: str, invite: str) -> None:
        """New model or server: everything is reloaded/reconnected by the next task."""
        same_invite = invite == self.invite or (mode != MODE_SERVER and self.mode != MODE_SERVER)
        if (model, mode) != (self.model, self.mode) or not same_invite:
            self.model, self.mode, self.invite = model, mode, invite
            self.shutdown_blocking()
            self.config = None
            self.part = None
            self.state = IDLE

    def memory_for_k(self, k: int) -> int | None:
        """Weights held here for ``k`` local layers, as the client is loaded (a GGUF model's
        matrices in their quantized blocks)."""
        if not self.config:
            return None
        from engine.kernels.cpu import default_dtype
        from engine.quant.sizes import client_weight_bytes

        dtype = self.dtype
        if dtype.lower() == "auto":
            dtype = str(default_dtype(self.device)).removeprefix("torch.")
        try:
            spec = self.part.resolved if self.part is not None else resolve(self.model)
            return client_weight_bytes(spec, self.config, k, "auto", dtype)
        except VeilError:
            return local_weight_bytes(self.config, k, dtype)

    @property
    def tokenizer(self) -> Any:
        """The loaded model's tokenizer (None before the model is loaded)."""
        return self.runner.client.tokenizer if self.runner is not None else None

    def trunk_label(self) -> str:
        """Which server: "the built-in server on this computer" / "your organization's server"
        ("" when none is used or known yet)."""
        if self.runner is not None and not self.runner.remote:
            return ""
        if self.source is not None:
            return self.source.label
        if self.mode == MODE_SERVER:
            return InviteSource.label
        if self.mode == MODE_DEMO:
            return DemoServerSource.label
        return InProcessSource.label

    # --- worker thread ------------------------------------------------------------------------

    def read_config_blocking(self, progress: Progress | None = None) -> ModelConfig:
        if self.config is None:
            spec = self._spec(progress)
            folder = (
                spec.folder if isinstance(spec, ResolvedModel) else resolve(spec, progress).folder
            )
            self.config = load_config(folder)
        return self.config

    def ensure_ready_blocking(
        self, progress: Progress | None = None, *, refetch: bool = True
    ) -> SplitRunner:
        """Load the model, apply the wanted split and connect the trunk, as needed."""
        with self._lock:
            cfg = self.read_config_blocking(progress)
            k = max(1, min(self.wanted_k, self.max_k or max_local_layers(cfg)))
            if self.part is not None:
                k = max(k, self.part.manifest.k_min)
            plan = SplitPlan.symmetric(cfg.n_layers, k)
            if self.runner is None:
                self.state = LOADING
                client = load_client(
                    self._spec(progress),
                    k,
                    dtype=parse_dtype(self.dtype),
                    device=self.device,
                    progress=progress,
                    warm_up=True,
                )
                self.runner = _unchecked_runner(client)  # the trunk is connected below
            runner = self.runner
            if runner.client.plan != plan:
                self._close_trunk()
                runner.client.set_split(plan)
            key = self._org_key()
            if key != runner.client.org_key:  # imported, replaced or removed in Settings
                self._close_trunk()
                runner.client.set_org_key(key)
            if plan.fully_local:
                self._close_trunk()
                self.state = LOCAL
                return runner
            if runner.trunk is not None and self.source is not None and not self.source.alive():
                self._close_trunk()  # the demo server died since the last reply: start afresh
            if runner.trunk is None:
                self.state = CONNECTING
                if self.mode == MODE_SERVER:
                    self._check_invite()
                if self.source is None:
                    self.source = make_source(
                        self.mode, self.model, self.invite, self.dtype, self.device
                    )
                try:
                    runner.trunk = self.source.open(runner.client, progress)
                except FingerprintMismatch:
                    if not (refetch and self.uses_server_model and self.part is not None):
                        raise
                    # the admin changed the server's model: get the new one, once
                    log.info("the server's model changed; fetching the new one")
                    self.runner, self.config, self.part = None, None, None
                    return self.ensure_ready_blocking(progress, refetch=False)
                except VeilError as exc:
                    self.state = OFFLINE
                    self.last_error = str(exc)
                    better = self.source.lost() if isinstance(exc, TransportError) else None
                    if better is not None:
                        raise better from None
                    raise
                runner.check()
            self.state = CONNECTED
            return runner

    def _org_key(self) -> Any:
        """The organisation key for the organisation's server (a demo or in-process trunk runs
        the public model: no key)."""
        if self.mode != MODE_SERVER or self.key_folder is None:
            return None
        from app.core.org_key import installed

        return installed(self.key_folder)

    @property
    def key_id(self) -> str | None:
        """The organisation key id of the keyed model the connected server runs (None: the
        public model, or not connected)."""
        trunk = self.runner.trunk if self.runner is not None else None
        return getattr(trunk, "key_id", None) if trunk is not None else None

    def _check_invite(self) -> None:
        from app.core.invite import invite_problem

        problem = invite_problem(self.invite)
        if problem:
            self.state = NEEDS_SETUP
            self.last_error = problem
            raise VeilError(problem, hint="open Settings and paste the invite code again")

    def server_notice(self) -> str:
        """RESTARTING / RESTARTED while/after the demo server's watchdog restarted it, else ""."""
        return str(getattr(self.source, "notice", "") or "")

    def clear_server_notice(self) -> None:
        if isinstance(self.source, DemoServerSource):
            self.source.notice = ""

    def _close_trunk(self) -> None:
        if self.runner is not None and self.runner.trunk is not None:
            trunk, self.runner.trunk = self.runner.trunk, None
            try:
                trunk.close()
            except Exception as exc:  # a dead connection may fail to close; that is fine
                log.info("closing the trunk: %s", exc)

    def generate_blocking(
        self,
        ids: Sequence[int],
        params: SamplingParams,
        *,
        on_text: Callable[[str], None],
        cancel: CancelToken,
        report: Callable[[dict[str, Any]], None] | None = None,
        progress: Progress | None = None,
        decoder: str | None = None,
        prefill: Prefill | None = None,
    ) -> GenerationResult:
        """One reply; ``report`` gets live gauge values about every 0.3 s; ``prefill`` reads
        the prompt in blocks and says how far it is (``engine.generate.Prefill``). Without
        it the prompt is still read in ``READ_CHUNK`` blocks: a Stop is heard between blocks,
        and through a server the blocks travel several at a time, the client's layers for
        one overlapping the trunk's work on the one before."""
        prefill = prefill or Prefill(chunk=READ_CHUNK)
        runner = self.ensure_ready_blocking(progress)
        with self._lock:
            counting = _CountingRunner(runner)
            t0 = time.perf_counter()
            first = [0.0, 0.0]  # time of the first text, live token count
            last = [0.0]

            def text(delta: str) -> None:
                first[1] += 1
                now = time.perf_counter()
                if not first[0]:
                    first[0] = now
                on_text(delta)
                if report and now - last[0] > 0.3:
                    last[0] = now
                    span = now - first[0]
                    report(
                        self._live(
                            tok_s=(first[1] - 1) / span if span > 0 else None,
                            per_rt=first[1] / max(counting.calls, 1),
                        )
                    )

            dec = decoder or ("speculative" if "speculative" in available_decoders() else None)
            try:
                result = generate(
                    counting,  # type: ignore[arg-type]
                    ids,
                    params,
                    decoder=dec or "sequential",
                    on_text=text,
                    cancel=cancel,
                    prefill=prefill,
                )
            except TransportError as exc:
                self.state = OFFLINE
                self.last_error = str(exc)
                self._close_trunk()
                better = self.source.lost() if self.source is not None else None
                if better is not None:
                    raise better from None
                raise
            except VeilError:
                raise
            except Exception as exc:
                if "zmq" in type(exc).__module__:
                    self.state = OFFLINE
                    self._close_trunk()
                    better = self.source.lost() if self.source is not None else None
                    raise better or TransportError(
                        f"the connection to the server failed ({exc})",
                        hint="Veil reconnects by itself when the server is back",
                    ) from None
                raise
            secs = time.perf_counter() - t0
            log.debug("generated %d tokens in %.2fs", result.stats.new_tokens, secs)
            if report:
                st = result.stats
                report(
                    self._live(
                        tok_s=st.decode_tok_s or None, per_rt=st.tokens_per_round_trip or None
                    )
                )
            return result

    def helper_pids(self) -> list[int]:
        """Processes Veil started for itself that hold memory: the built-in server."""
        server = getattr(self.source, "server", None)
        proc = getattr(server, "proc", None)
        return [proc.pid] if proc is not None and proc.poll() is None else []

    def _live(self, tok_s: float | None, per_rt: float | None) -> dict[str, Any]:
        mem, label = process_memory_bytes(self.device, self.helper_pids())
        out: dict[str, Any] = {
            "tokens_per_s": tok_s,
            "tokens_per_round_trip": per_rt,
            "memory_bytes": mem,
            "memory_label": label,
            "connection": self.state,
            "rtt_ms": None,
        }
        trunk = self.runner.trunk if self.runner else None
        stats = getattr(trunk, "json_stats", None)
        if callable(stats):
            try:
                out["rtt_ms"] = stats().get("rtt_ms")
            except Exception as exc:
                log.debug("json_stats: %s", exc)
        return out

    def probe_blocking(self, progress: Progress | None = None) -> bool:
        """After a failure: try to connect again; True when the trunk is back."""
        try:
            self.ensure_ready_blocking(progress)
        except VeilError as exc:
            self.last_error = str(exc)
            return False
        return True

    def shutdown_blocking(self) -> None:
        with self._lock:
            self._close_trunk()
            self.runner = None
            if self.source is not None:
                self.source.close()
                self.source = None
            self.state = IDLE


def _unchecked_runner(client: ClientModel) -> SplitRunner:
    """A runner whose trunk is connected just after (SplitRunner checks in __init__)."""
    runner = SplitRunner.__new__(SplitRunner)
    runner.client = client
    runner.trunk = None
    return runner
