"""``veil-trunk serve --ray`` with its private Ray runtime stays on this machine.

A real ``serve --ray`` child on a loopback address, with a replica loaded: every listening socket
of it and of every process under it (Ray's GCS, raylet, agents, the replica's worker with its
inbox, the gateway's result socket) is on loopback; Ray's token and session files are in a
folder of their own (0700, files 0600), nothing lands in the home folder, and the folder is gone
after shutdown. Ray's start-up and the replica's load take seconds on two cores: ``slow``.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.local_server import LocalTrunkServer
from tests.tiny import make_model

pytest.importorskip("ray", reason="needs the veil[cluster] extra (Ray)")

from remote.cluster.local_ray import is_loopback, listening


def test_loopback_addresses() -> None:
    for ip in ("127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(ip), ip
    for ip in ("0.0.0.0", "::", "10.1.2.3", "192.0.2.2", "::ffff:10.0.0.1", "fe80::1%eth0", "x"):
        assert not is_loopback(ip), ip


@pytest.fixture()
def short_tmp() -> Iterator[Path]:
    """A short temp folder: Ray's unix sockets live under it and a socket path has a limit of
    107 bytes, which pytest's own temp paths would pass."""
    d = Path(tempfile.mkdtemp(prefix="vr", dir="/tmp"))
    try:
        yield d
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
def test_the_private_runtime_listens_on_loopback_only_and_keeps_its_files_private(
    tmp_path: Path, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "llama"
    make_model(model, "llama", seed=5)
    home = short_tmp / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # where Ray would put ~/.ray/auth_token
    monkeypatch.setenv("TMPDIR", str(short_tmp))  # where the private runtime's folder goes
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    srv = LocalTrunkServer(
        str(model),
        extra_args=["--ray", "--replicas", "1", "--cpus-per-replica", "1"],
        threads=1,
        kernel_threads=1,
        ready_timeout_s=300,
    )
    srv.start()
    try:
        assert srv.proc is not None
        socks = listening(srv.proc.pid)
        names = {name for _, name, _, _ in socks}
        # the gateway's client port, and Ray's own servers, are all seen
        assert ("127.0.0.1", srv.port) in {(ip, port) for _, _, ip, port in socks}
        assert {"gcs_server", "raylet"} <= names, names
        exposed = [s for s in socks if not is_loopback(s[2])]
        assert not exposed, exposed

        roots = list(short_tmp.glob("veil-ray-*"))
        assert len(roots) == 1, roots
        root = roots[0]
        token = root / "auth_token"
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert token.is_file() and stat.S_IMODE(token.stat().st_mode) == 0o600
        assert not (home / ".ray").exists()
        sessions = [p for p in root.glob("session_*") if not p.is_symlink()]
        assert sessions
        for folder, _, files in os.walk(root):
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder
            for f in files:
                p = Path(folder) / f
                if not p.is_symlink():
                    assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, p
    finally:
        srv.stop(60)
    assert srv.proc is not None and srv.proc.returncode == 0, srv.stderr_tail[-5:]
    assert not list(short_tmp.glob("veil-ray-*"))  # removed at shutdown
