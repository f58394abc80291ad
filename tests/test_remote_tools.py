"""Client key storage and the WAN emulator (no trunk server needed)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from engine import keys
from engine.errors import KeyStoreError
from engine.wan_proxy import WanProxy


@pytest.fixture(autouse=True)
def _fresh_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(keys, "_backend", None)
    monkeypatch.setattr(keys, "_backend_kind", None)
    yield


def test_memory_keyring_keeps_one_keypair_and_server_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VEIL_KEYRING", "memory")
    pub, sec = keys.client_keypair()
    assert len(pub) == 40 and len(sec) == 40 and pub != sec
    assert keys.client_keypair() == (pub, sec)
    assert keys.server_key("tcp://h:1") is None
    keys.save_server_key("tcp://h:1", "k" * 40)
    assert keys.server_key("tcp://h:1") == "k" * 40
    with pytest.raises(KeyStoreError):
        keys.save_server_key("tcp://h:1", "short")


def test_no_os_keyring_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """keyring would silently pick keyrings.alt's plaintext file here; Veil refuses that."""
    import keyring
    from keyring.backends import fail

    monkeypatch.delenv("VEIL_KEYRING", raising=False)
    for be in (fail.Keyring(), __import__("keyrings.alt.file").alt.file.PlaintextKeyring()):
        monkeypatch.setattr(keyring, "get_keyring", lambda be=be: be)
        monkeypatch.setattr(keys, "_backend", None)
        with pytest.raises(KeyStoreError) as ei:
            keys.client_keypair()
        msg = str(ei.value)
        assert "\n" not in msg and "VEIL_KEYRING=file" in msg and "no OS keyring" in msg


def test_file_fallback_is_opt_in_and_persists(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setenv("VEIL_KEYRING", "file")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    pub, _ = keys.client_keypair()
    monkeypatch.setattr(keys, "_backend", None)  # a new process would read the same file
    assert keys.client_keypair()[0] == pub
    monkeypatch.setenv("VEIL_KEYRING", "bogus")
    with pytest.raises(KeyStoreError, match="not a known key store"):
        keys.client_keypair()


def test_keys_show_prints_the_public_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VEIL_KEYRING", "memory")
    assert keys.main(["show"]) == 0
    assert capsys.readouterr().out.strip() == keys.client_keypair()[0]


# ----------------------------------------------------------------------------- WAN proxy


@pytest.fixture
def echo_server() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield port
    stop.set()
    t.join(2)
    srv.close()


def _echo_time(port: int, payload: bytes) -> float:
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        c.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += c.recv(1 << 16)
        assert got == payload
        return time.perf_counter() - t0


def test_wan_proxy_adds_the_rtt_and_can_change_it(echo_server: int) -> None:
    with WanProxy("127.0.0.1", echo_server, rtt_ms=60) as proxy:
        assert proxy.address == f"tcp://127.0.0.1:{proxy.port}"
        t = min(_echo_time(proxy.port, b"ping") for _ in range(3))
        assert 0.060 <= t < 0.150
        proxy.set_rtt(10)
        t = min(_echo_time(proxy.port, b"ping") for _ in range(3))
        assert 0.010 <= t < 0.060


def test_wan_proxy_caps_bandwidth(echo_server: int) -> None:
    payload = bytes(200_000)  # 1.6 Mbit at 16 Mbit/s: >= 0.1 s (the directions overlap)
    with WanProxy("127.0.0.1", echo_server, rtt_ms=0, bandwidth_mbit=16) as proxy:
        t = _echo_time(proxy.port, payload)
    assert t >= 0.1
    with WanProxy("127.0.0.1", echo_server, rtt_ms=0) as proxy:
        assert _echo_time(proxy.port, payload) < 0.09


def test_wan_proxy_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        WanProxy("127.0.0.1", 1, rtt_ms=-1)
    with pytest.raises(ValueError):
        WanProxy("127.0.0.1", 1, rtt_ms=10, bandwidth_mbit=0)
