"""Where the app's trunk comes from: layers in this process, the built-in server (a child
process kept alive by a watchdog), or an organisation's server reached by an invite code."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from typing import Any

from app.core.settings import MODE_DEMO, MODE_IN_PROCESS, MODE_SERVER
from engine.errors import TransportError, VeilError
from engine.loading import Progress
from engine.session import parse_dtype
from engine.split import ClientModel, Trunk, load_trunk

log = logging.getLogger("veil.app")

# what a demo server's watchdog reports (EngineHost.server_notice)
RESTARTING = "restarting"
RESTARTED = "restarted"


class TrunkSource(ABC):
    """Where trunk sessions come from (demo server, invite code, or in this process)."""

    label = "trunk"

    @abstractmethod
    def open(self, client: ClientModel, progress: Progress | None) -> Trunk:
        """A new trunk session for ``client``'s current split."""

    def close(self) -> None:  # noqa: B027 - optional hook; most sources hold nothing
        """Release whatever the source holds (e.g. stop a demo server)."""

    def alive(self) -> bool:
        """False when the source knows its server is gone (a dead demo server child)."""
        return True

    def lost(self) -> VeilError | None:
        """The message for a connection lost mid-reply, when the source knows better than the
        transport what happened (None: keep the transport's)."""
        return None


class InProcessSource(TrunkSource):
    """The trunk layers in this process (no network; used when no server module is present)."""

    label = "in this app (no server)"

    def __init__(self, dtype: str, device: str) -> None:
        self.dtype, self.device = dtype, device

    def open(self, client: ClientModel, progress: Progress | None) -> Trunk:
        start, end = client.plan.trunk_range
        return load_trunk(
            client.resolved,
            start,
            end,
            dtype=parse_dtype(self.dtype),
            device=self.device,
            progress=progress,
        )


# Transport timeouts: give up on a lost server after CONNECT_OPTS["reconnect_s"] seconds and
# show an error (the app keeps probing and reconnects by itself when the server is back).
CONNECT_OPTS: dict[str, float] = {"timeout_s": 5.0, "reconnect_s": 15.0, "connect_timeout_s": 10.0}


class DemoServerSource(TrunkSource):
    """'Try it on this computer': a real ``veil-trunk serve`` child process on loopback
    (started on first use, restarted at once by a watchdog thread if it dies, stopped with the
    app). The restarted child listens on the same port with the same keys, so a reply that was
    being written reconnects and continues. Tests may pass a running ``server`` they own
    instead (then nothing here restarts it)."""

    label = "the built-in server on this computer"
    WATCH_EVERY_S = 0.5

    def __init__(
        self,
        model: str,
        dtype: str,
        device: str,
        server: Any = None,
        connect_opts: dict[str, float] | None = None,
    ) -> None:
        self.model, self.dtype, self.device = model, dtype, device
        self.server: Any = server
        self.owned = server is None
        self.connect_opts = dict(CONNECT_OPTS if connect_opts is None else connect_opts)
        self.notice = ""  # RESTARTING while the watchdog restarts the child, then RESTARTED
        self.restarts = 0
        self._lock = threading.Lock()  # one start/restart/stop at a time
        self._closing = threading.Event()
        self._watch: threading.Thread | None = None

    def open(self, client: ClientModel, progress: Progress | None) -> Trunk:
        from engine.local_server import start_local_trunk

        with self._lock:
            if self.server is None:
                if progress:
                    progress("starting the built-in server", 0.0)
                self.server = start_local_trunk(
                    self.model, min_local_layers=1, device=self.device, dtype=self.dtype
                )
            elif self.owned and not self.server.running:
                if progress:
                    progress("restarting the built-in server", 0.0)
                self.server.restart()
                self.restarts += 1
            if self.owned and self._watch is None:
                self._watch = threading.Thread(
                    target=self._watchdog, name="veil-demo-watchdog", daemon=True
                )
                self._watch.start()
        # loopback: activations travel as float32, so replies equal in-process ones bit for bit
        return self.server.connect(  # type: ignore[no-any-return]
            client, wire_dtype="float32", **self.connect_opts
        )

    def _watchdog(self) -> None:
        while not self._closing.wait(self.WATCH_EVERY_S):
            srv = self.server
            if srv is None or srv.running:
                continue
            self.notice = RESTARTING
            log.warning("the built-in server stopped; restarting it")
            try:
                with self._lock:
                    if self._closing.is_set() or self.server is not srv or srv.running:
                        continue
                    srv.restart()
                    self.restarts += 1
            except VeilError as exc:
                log.warning("restarting the built-in server: %s", exc)
                self._closing.wait(5.0)  # try again later (the next reply also tries)
                continue
            self.notice = RESTARTED

    def alive(self) -> bool:
        return self.server is None or bool(self.server.running)

    def lost(self) -> VeilError | None:
        if self.alive() and not self.notice:
            return None  # it runs: the transport's message says what went wrong
        return TransportError(
            "the built-in server on this computer stopped",
            hint="Veil is restarting it; send your message again in a moment",
        )

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            if self.server is not None and self.owned:
                server, self.server = self.server, None
                server.stop()


class InviteSource(TrunkSource):
    """The organization's server, from an invite code (keys live in the OS keyring)."""

    label = "your organization's server"

    def __init__(self, invite: str) -> None:
        self.invite = invite.strip()

    def open(self, client: ClientModel, progress: Progress | None) -> Trunk:
        from engine.transport import connect_trunk

        o = CONNECT_OPTS
        return connect_trunk(
            self.invite,
            client,
            progress=progress,
            timeout_s=o["timeout_s"],
            reconnect_s=o["reconnect_s"],
            connect_timeout_s=o["connect_timeout_s"],
        )


def demo_server_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("engine.local_server") is not None


def make_source(mode: str, model: str, invite: str, dtype: str, device: str) -> TrunkSource:
    if mode == MODE_SERVER:
        return InviteSource(invite)
    if mode == MODE_DEMO and demo_server_available():
        return DemoServerSource(model, dtype, device)
    if mode not in (MODE_DEMO, MODE_IN_PROCESS):
        raise VeilError(f"unknown connection mode '{mode}'")
    return InProcessSource(dtype, device)
