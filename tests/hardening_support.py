"""What the hardening tests share: quick client timeouts, the 8k-context tiny model and a
``veil-trunk serve`` child process."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from engine.local_server import free_port
from engine.split import ClientModel
from engine.transport import RemoteTrunk, connect_trunk
from tests.tiny import make_model

REPO = Path(__file__).resolve().parent.parent
FAST = {
    "timeout_s": 1.0,
    "heartbeat_s": 0.1,
    "reconnect_s": 5.0,
    "connect_timeout_s": 5.0,
    "step_timeout_s": 3.0,
}


def make_tiny_8k(folder: Path) -> Path:
    """6 layers and an 8k context, so prompts longer than one 4,096-row block fit."""
    make_model(folder, "llama", seed=5, n_layers=6, max_position_embeddings=8192)
    return folder


class TrunkProcess:
    """``veil-trunk serve`` as a child process on a free loopback port, its stderr kept (in
    ``stderr``, line by line). ``args`` come after ``--model``/``--bind``; ``popen`` goes to
    ``subprocess.Popen`` (``preexec_fn=`` for a resource limit)."""

    def __init__(self, model: Path, args: list[str], **popen: Any) -> None:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "remote.cli", "serve", "--model", str(model)]
        cmd += ["--bind", self.address, "--threads", "1", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, **popen
        )
        self.stderr: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._drain, daemon=True).start()
        line = self.proc.stdout.readline()
        assert line.startswith("READY "), (line, self.stderr)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip("\n"))

    def line(self, text: str, timeout_s: float = 10.0) -> str:
        """The first stderr line containing ``text`` (waiting for it to be read)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [ln for ln in self.stderr if text in ln]
            if found or time.monotonic() > deadline:
                assert found, (text, self.stderr[-5:])
                return found[0]
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM, and wait until it has exited and its last log line is read."""
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        deadline = time.monotonic() + 5
        while not any(ln.endswith(" stopped") for ln in self.stderr[-3:]):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)


class KeyedServer(TrunkProcess):
    """``veil-trunk serve`` with a keys folder and an allow-list file (as an admin runs it)."""

    def __init__(self, model: Path, keys_dir: Path, extra: list[str], **popen: Any) -> None:
        self.keys_dir = keys_dir
        self.public_key = (keys_dir / "server.key").read_text().split("=", 1)[1].strip()
        super().__init__(model, ["--keys", str(keys_dir), *extra], **popen)

    def socket(self, keypair: tuple[str, str], ident: bytes | None = None) -> zmq.Socket:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if ident is not None:
            s.setsockopt(zmq.ROUTING_ID, ident)
            s.setsockopt(zmq.RECONNECT_IVL, -1)  # a kicked-out connection stays out
        s.curve_serverkey = self.public_key.encode()
        s.curve_publickey = keypair[0].encode()
        s.curve_secretkey = keypair[1].encode()
        s.connect(self.address)
        return s

    def connect(self, client: ClientModel, keypair: tuple[str, str], **kw: float) -> RemoteTrunk:
        opts = {**FAST, "step_timeout_s": 30.0, **kw}
        return connect_trunk(
            self.address,
            client,
            server_key=self.public_key,
            client_keys=keypair,
            wire_dtype="float32",
            **opts,  # type: ignore[arg-type]
        )
