"""The trunk server's network edge against whoever can reach its port (issue 29): a connection
flood under a low open-file limit, an allow-list that cannot be read, a message that never
ends, absurd frame counts, and log floods from refused handshakes. Real ``veil-trunk serve``
children; hand-built ZMTP clients (tests/raw_zmtp.py) where libzmq's own sender would never
misbehave."""

from __future__ import annotations

import errno
import logging
import re
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from engine import protocol as P
from engine.errors import AuthError, TransportError
from engine.split import ClientModel, load_client
from remote.allowlist import AllowList
from remote.cli import main as trunk_cli
from remote.loglimit import LogLimiter
from tests.fixed_keys import PLAIN_KEYS
from tests.hardening_support import KeyedServer, TrunkProcess
from tests.raw_zmtp import RawClient
from tests.tiny import make_model

SOFT_LIMIT = 256  # open files for the plain server (it raises its limit)
HIDDEN = 64  # the tiny model's: its largest valid message is 4096 x 64 x 4 bytes + 64 KiB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama4"
    make_model(folder, "llama", seed=11, n_layers=4)
    return folder


@pytest.fixture(scope="module")
def client(tiny: Path) -> ClientModel:
    return load_client(str(tiny), 1)


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("trunk-keys")
    assert trunk_cli(["keygen", "--keys", str(d)]) == 0
    assert trunk_cli(["allow", PLAIN_KEYS[0][0], "--keys", str(d)]) == 0
    return d


def _soft_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    low = SOFT_LIMIT if hard == resource.RLIM_INFINITY else min(SOFT_LIMIT, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))


@pytest.fixture(scope="module")
def plain(tiny: Path) -> Iterator[TrunkProcess]:
    srv = TrunkProcess(tiny, ["--insecure"], preexec_fn=_soft_limit)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(tiny: Path, keys_dir: Path) -> Iterator[KeyedServer]:
    srv = KeyedServer(tiny, keys_dir, [])
    yield srv
    srv.stop()


def ask(s: zmq.Socket, msg: P.Message, timeout: float = 10.0) -> P.Message:
    s.send_multipart(P.encode(msg))
    assert s.poll(int(timeout * 1000)), "no reply from the server"
    return P.decode(s.recv_multipart())


# ----------------------------------------------------------------------------- the allow-list


def test_an_allow_list_that_cannot_be_read_keeps_the_last_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of file descriptors (or any read error), the list read last stays in force and the
    failure is logged once; the change is applied once the file can be read again."""
    path = tmp_path / "allowed_clients.txt"
    path.write_text(PLAIN_KEYS[0][0] + "\n")
    allowed = AllowList(path, interval_s=0)
    assert allowed(PLAIN_KEYS[0][0])
    read_bytes = Path.read_bytes

    def no_descriptors(self: Path) -> bytes:
        if self == path:
            raise OSError(errno.EMFILE, "Too many open files")
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", no_descriptors)
    path.write_text(PLAIN_KEYS[1][0] + "\n")  # a real change, not readable yet
    with caplog.at_level(logging.INFO, logger="veil.trunk"):
        for _ in range(50):
            assert allowed(PLAIN_KEYS[0][0]) and not allowed(PLAIN_KEYS[1][0])
        monkeypatch.setattr(Path, "read_bytes", read_bytes)
        assert allowed(PLAIN_KEYS[1][0]) and not allowed(PLAIN_KEYS[0][0])
    failed = [r.getMessage() for r in caplog.records if "cannot read the allow-list" in r.message]
    assert len(failed) == 1 and "Too many open files" in failed[0], failed
    assert any("can be read again" in r.getMessage() for r in caplog.records)


def test_a_deleted_allow_list_allows_nobody(tmp_path: Path) -> None:
    path = tmp_path / "allowed_clients.txt"
    path.write_text(PLAIN_KEYS[0][0] + "\n")
    allowed = AllowList(path, interval_s=0)
    assert allowed(PLAIN_KEYS[0][0])
    path.unlink()
    assert not allowed(PLAIN_KEYS[0][0]) and allowed.failing is None


def test_a_server_that_cannot_read_its_allow_list_gives_no_verdict_on_keys(
    tiny: Path, client: ClientModel, tmp_path: Path
) -> None:
    """The handshake is answered "temporary failure", which the client reports as a problem
    on the server, never as its key being refused."""
    d = tmp_path / "keys"
    assert trunk_cli(["keygen", "--keys", str(d)]) == 0
    (d / "allowed_clients.txt").mkdir()  # there, but no file can be read from it
    srv = KeyedServer(tiny, d, [])
    try:
        with pytest.raises(TransportError) as caught:
            srv.connect(client, PLAIN_KEYS[0]).close()
        assert not isinstance(caught.value, AuthError), caught.value
        assert "cannot check keys" in str(caught.value)
    finally:
        srv.stop()
    assert any("cannot read the allow-list" in ln for ln in srv.stderr), srv.stderr[-5:]


# ----------------------------------------------------------------------------- connection flood


def test_the_server_raises_its_open_file_limit_where_it_may(plain: TrunkProcess) -> None:
    """``plain`` started with a soft limit of 256 and the hard limit left as it was."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    said = plain.line("open-file limit")
    if hard != resource.RLIM_INFINITY and hard <= SOFT_LIMIT:
        assert "(the hard limit)" in said, said
    else:
        assert f"(raised from {SOFT_LIMIT})" in said, said


def _flood(address: str, n: int) -> list[socket.socket]:
    """``n`` plain TCP connections that never say a word (connected by the kernel)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex((host, int(port)))
        out.append(s)
    return out


def _closed_by_server(s: socket.socket) -> bool:
    try:
        while s.recv(4096):  # the server's greeting, then the end (or nothing yet)
            pass
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset
    return True


def test_a_connection_flood_at_a_low_file_limit_revokes_nobody(
    tiny: Path, keys_dir: Path, client: ClientModel
) -> None:
    """With 64 file descriptors and hundreds of connections that never handshake, a connected
    client keeps working and is never told its key was revoked: the server shuts connections
    beyond its cap on handshakes in progress, and a failed allow-list read would change
    nothing anyway."""
    limit = 64

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    srv = KeyedServer(tiny, keys_dir, [], preexec_fn=low_limit)
    held: list[socket.socket] = []
    try:
        with srv.connect(client, PLAIN_KEYS[0]) as trunk:
            h = torch.randn(400, HIDDEN)
            trunk.forward(h[:4], torch.arange(4))
            held += _flood(srv.address, 4 * limit)
            # the attacker keeps opening connections for 4 s (the allow-list is re-read every
            # second): every step of the real client is answered
            steps, end = 0, time.monotonic() + 4.0
            while time.monotonic() < end and steps < 300:
                held += _flood(srv.address, 8)
                out = trunk.forward(h[4 + steps : 5 + steps], torch.tensor([4 + steps]))
                assert out.shape == (1, HIDDEN)
                steps += 1
                time.sleep(0.05)
            closed = sum(_closed_by_server(s) for s in held)
    finally:
        for s in held:
            s.close()
        srv.stop()
    assert steps >= 10
    assert not any("revoked" in ln for ln in srv.stderr), srv.stderr[-10:]
    assert any("handshakes already in progress" in ln for ln in srv.stderr), srv.stderr[-10:]
    assert closed >= len(held) // 2, (closed, len(held))  # none before: kept for 30 s


# ----------------------------------------------------------------------------- unfinished messages


def _peak_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for ln in f:
            if ln.startswith("VmHWM:"):
                return int(ln.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("curve", [False, True], ids=["null", "curve"])
def test_a_message_that_never_ends_is_cut_off(
    plain: TrunkProcess, keyed: KeyedServer, curve: bool
) -> None:
    """A writer that sends 256 MiB of frames without ever ending its message is cut off each
    time it is past the largest valid message, and the server's peak memory hardly grows (it
    grew by all 256 MiB before)."""
    srv: TrunkProcess = keyed if curve else plain
    keys = {"server_key": keyed.public_key, "client_keys": PLAIN_KEYS[0]} if curve else {}
    Path(f"/proc/{srv.proc.pid}/clear_refs").write_text("5")  # restart the peak (VmHWM)
    before = _peak_mib(srv.proc.pid)
    pushed, cut, chunk = 0, 0, bytes(256 << 10)
    while pushed < 256 << 20:
        w = RawClient(srv.address, **keys)  # type: ignore[arg-type]
        try:
            while pushed < 256 << 20:
                wire = w.frame(chunk, more=True)  # a new nonce each time with CURVE
                w.send(wire)
                pushed += len(wire)
        except (BrokenPipeError, ConnectionResetError):
            cut += 1
        w.close()
    grew = _peak_mib(srv.proc.pid) - before
    assert cut >= 8 and grew < 64, (cut, grew)
    srv.line("an unfinished message of")
    sock = keyed.socket(PLAIN_KEYS[0]) if curve else zmq.Context.instance().socket(zmq.DEALER)
    if not curve:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(srv.address)
    assert isinstance(ask(sock, P.Ping(1)), P.Pong)  # the server itself is fine
    sock.close(0)


def test_extra_frames_are_refused_and_absurdly_many_end_the_connection(
    plain: TrunkProcess,
) -> None:
    w = RawClient(plain.address)
    w.send(w.frame(b"a", True) + w.frame(b"b", True) + w.frame(b"c", False))
    reply = P.decode([w._read_frame()])
    assert isinstance(reply, P.Error) and reply.code == P.E_BAD_MESSAGE
    assert "got 3" in reply.message
    w.send(b"".join(w.frame(b"x", True) for _ in range(99)) + w.frame(b"x", False))
    with pytest.raises(ConnectionError):  # no reply: the connection is shut
        w._read_frame()
    w.close()


# ----------------------------------------------------------------------------- log floods


def test_refused_handshakes_are_summarised_not_logged_one_by_one(
    tiny: Path, keys_dir: Path
) -> None:
    srv = KeyedServer(tiny, keys_dir, [])
    ctx = zmq.Context()
    try:
        pairs = []
        for _ in range(60):  # 60 keys nobody allowed (each retries after its refusal)
            pub, sec = zmq.curve_keypair()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.curve_serverkey = srv.public_key.encode()
            s.curve_publickey, s.curve_secretkey = pub, sec
            mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            s.connect(srv.address)
            pairs.append((s, mon))
        for s, mon in pairs:
            assert mon.poll(20000), "a handshake was not refused"
            s.disable_monitor()
            mon.close(0)
            s.close(0)
    finally:
        ctx.destroy(0)
        srv.stop()
    lines = [ln for ln in srv.stderr if "refused" in ln]
    assert len(lines) == 2, lines
    assert "refused a client key" in lines[0] and "from 127.0.0.1" in lines[0]
    summary = re.search(r"(\d+) refused handshakes from 127\.0\.0\.1 in the last", lines[1])
    assert summary is not None and int(summary.group(1)) >= 60, lines


def test_the_log_limiter_summarises_per_source_and_bounds_its_sources(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    lim = LogLimiter(logging.getLogger("veil.test"), "refused handshakes", max_sources=4)
    lim.clock = lambda: now[0]
    with caplog.at_level(logging.WARNING, logger="veil.test"):
        for i in range(1000):
            lim.event("10.0.0.1", "refused a key from %s", "10.0.0.1")
            lim.event(f"10.0.1.{i % 50}", "refused a key from %s", f"10.0.1.{i % 50}")
        assert len(caplog.records) == 4  # the first event of 4 sources; the rest are counted
        now[0] = 30.0
        lim.flush()
        assert len(caplog.records) == 4  # nothing before a minute
        now[0] = 60.0
        lim.flush()
        lim.event("10.0.0.1", "refused a key from %s", "10.0.0.1")  # still busy: counted
        now[0] = 120.0
        lim.flush()
        now[0] = 180.0
        lim.flush()  # a quiet minute: forgotten
        lim.event("10.0.0.1", "refused a key from %s", "10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert "1000 refused handshakes from 10.0.0.1 in the last minute" in lines
    assert "940 refused handshakes from other sources in the last minute" in lines
    assert "1 refused handshakes from 10.0.0.1 in the last minute" in lines
    assert lines[-1] == "refused a key from 10.0.0.1" and len(lines) == 4 + 5 + 1 + 1, lines
