"""A real ``veil-trunk serve`` child process on this computer, for the app's "Try it on this
computer" demo, ``veil bench`` and tests.

CURVE is on, with ephemeral keys made here and handed to the child over its stdin (never written
to disk). Optionally a :class:`~engine.wan_proxy.WanProxy` sits in front to emulate a WAN.

    with start_local_trunk("smollm2-135m-instruct", rtt_ms=80) as srv:
        trunk = srv.connect(client)      # a RemoteTrunk
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import TransportError
from engine.wan_proxy import WanProxy

if TYPE_CHECKING:
    from engine.split import ClientModel
    from engine.transport import RemoteTrunk

READY_TIMEOUT_S = 120.0
_REPO = Path(__file__).resolve().parent.parent


def trunk_command() -> list[str]:
    """The command that runs ``veil-trunk``: this interpreter with ``-m remote.cli`` or, in the
    frozen app (PyInstaller, no Python on the target), the app's own executable, which acts as
    veil-trunk when its first argument is ``--trunk-child`` (see installer/entry.py)."""
    if getattr(sys, "frozen", False):
        return [sys.executable, "--trunk-child"]
    return [sys.executable, "-m", "remote.cli"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalTrunkServer:
    """One ``veil-trunk serve`` child on 127.0.0.1 (see :func:`start_local_trunk`)."""

    def __init__(
        self,
        model: str,
        *,
        min_local_layers: int = 1,
        rtt_ms: float = 0,
        bandwidth_mbit: float | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        extra_args: Sequence[str] = (),
        ready_timeout_s: float = READY_TIMEOUT_S,
        threads: int | None = None,
        kernel_threads: int | None = None,
    ) -> None:
        import zmq

        self.model = model
        self.min_local_layers = min_local_layers
        self.rtt_ms = rtt_ms
        self.bandwidth_mbit = bandwidth_mbit
        self.device = device
        self.dtype = dtype
        self.extra_args = list(extra_args)
        self.ready_timeout_s = ready_timeout_s
        # The client runs on the same cores: half of them each (torch's default of all cores
        # in both processes oversubscribes the CPU and makes every step ~10x slower).
        self.threads = threads if threads is not None else max(1, (os.cpu_count() or 2) // 2)
        # The client waits while the trunk computes and the other way round, so the matrix
        # kernel (most of either side's time, and no busy-waiting between calls) may use every
        # core; torch's small ops keep their share.
        self.kernel_threads = kernel_threads if kernel_threads is not None else os.cpu_count() or 1
        pub, sec = zmq.curve_keypair()
        self.server_public_key = pub.decode()
        self._server_secret = sec.decode()
        cpub, csec = zmq.curve_keypair()
        self.client_keys = (cpub.decode(), csec.decode())
        self.port = free_port()
        self.direct_address = f"tcp://127.0.0.1:{self.port}"
        self.proxy: WanProxy | None = None
        self.proc: subprocess.Popen[str] | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=200)
        self._ready_line: str | None = None
        self._ready = threading.Event()

    @property
    def address(self) -> str:
        """What a client should connect to: the proxy when there is one, else the server."""
        return self.proxy.address if self.proxy is not None else self.direct_address

    @property
    def stderr_tail(self) -> list[str]:
        return list(self._stderr)

    def start(self) -> LocalTrunkServer:
        self._spawn()
        if self.proxy is None and (self.rtt_ms or self.bandwidth_mbit):
            self.proxy = WanProxy(
                "127.0.0.1", self.port, self.rtt_ms, bandwidth_mbit=self.bandwidth_mbit
            ).start()
        return self

    def _spawn(self) -> None:
        cmd = [
            *trunk_command(),
            "serve",
            "--model",
            self.model,
            "--bind",
            self.direct_address,
            "--min-local-layers",
            str(self.min_local_layers),
            "--device",
            self.device,
            "--dtype",
            self.dtype,
            "--keys-from-stdin",
            "--threads",
            str(self.threads),
            "--kernel-threads",
            str(self.kernel_threads),
            *self.extra_args,
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(_REPO) + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        self._ready.clear()
        self._ready_line = None
        self._stderr.clear()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(_REPO),
        )
        keys = {
            "public": self.server_public_key,
            "secret": self._server_secret,
            "allow": [self.client_keys[0]],
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(keys) + "\n")
        self.proc.stdin.close()
        threading.Thread(target=self._read_stdout, args=(self.proc,), daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                time.sleep(0.1)  # let the stderr reader catch the last lines
                raise TransportError(
                    f"the local trunk server exited with code {self.proc.returncode}: "
                    f"{self._last_error()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise TransportError(
                    f"the local trunk server did not start within {self.ready_timeout_s:g} s: "
                    f"{self._last_error()}"
                )

    def _last_error(self) -> str:
        lines = [ln for ln in self._stderr if ln.strip()]
        for ln in reversed(lines):
            if "error" in ln.lower():
                return ln.strip()
        return lines[-1].strip() if lines else "no output"

    def _read_stdout(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY ") and not self._ready.is_set():
                self._ready_line = line.strip()
                self._ready.set()

    def _read_stderr(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self._stderr.append(line.rstrip("\n"))

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def connect(self, client: ClientModel, **opts: Any) -> RemoteTrunk:
        from engine.transport import connect_trunk

        return connect_trunk(
            self.address,
            client,
            server_key=self.server_public_key,
            client_keys=self.client_keys,
            **opts,
        )

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in ``timeout`` seconds; stops the proxy."""
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None

    def kill(self) -> None:
        """SIGKILL the server (the proxy stays up, as a real network would)."""
        p = self.proc
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(5)

    def restart(self) -> None:
        """Start the server again on the same port, with the same keys."""
        self.kill()
        for _ in range(50):  # the port may take a moment to be free again
            try:
                self._spawn()
                return
            except TransportError as exc:
                if "Address already in use" not in str(exc):
                    raise
                time.sleep(0.1)
        self._spawn()

    def __enter__(self) -> LocalTrunkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_local_trunk(
    model: str,
    *,
    min_local_layers: int = 1,
    rtt_ms: float = 0,
    bandwidth_mbit: float | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    extra_args: Sequence[str] = (),
    threads: int | None = None,
    kernel_threads: int | None = None,
) -> LocalTrunkServer:
    """Spawn a CURVE-secured ``veil-trunk serve`` on 127.0.0.1 and wait until it is ready."""
    return LocalTrunkServer(
        model,
        min_local_layers=min_local_layers,
        rtt_ms=rtt_ms,
        bandwidth_mbit=bandwidth_mbit,
        device=device,
        dtype=dtype,
        extra_args=extra_args,
        threads=threads,
        kernel_threads=kernel_threads,
    ).start()
