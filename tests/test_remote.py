"""The trunk service end to end: real `veil-trunk serve` processes on loopback with CURVE on,
real ZeroMQ sockets, no mocks. Tiny random-weight models keep it fast."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from engine import protocol as P
from engine.errors import AuthError, FingerprintMismatch, ServerBusy, SplitError, TransportError
from engine.generate import available_decoders, generate
from engine.loading import load_config
from engine.local_server import LocalTrunkServer, start_local_trunk
from engine.sampling import SamplingParams
from engine.split import ClientModel, LocalTrunk, SplitRunner, load_client, load_trunk
from engine.transport import connect_trunk
from tests.fixed_keys import DASH_KEYS, PLAIN_KEYS
from tests.tiny import make_model

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47]
GREEDY = SamplingParams(max_new_tokens=16)
FAST = {"timeout_s": 1.0, "heartbeat_s": 0.2, "reconnect_s": 40.0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("tiny") / "llama6"
    make_model(f, "llama", seed=3, n_layers=6)
    return f


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[LocalTrunkServer]:
    # one raw socket opens 4 sessions in test_pings_are_answered_while_the_worker_computes
    with start_local_trunk(str(folder), extra_args=["--max-sessions-per-client", "4"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(folder: Path) -> ClientModel:
    return load_client(str(folder), 1)


def local_runner(client: ClientModel) -> SplitRunner:
    start, end = client.plan.trunk_range
    return SplitRunner(client, load_trunk(client.resolved, start, end))


def tokens(runner: SplitRunner, decoder: str = "sequential", **kw: object) -> list[int]:
    return generate(runner, PROMPT, GREEDY, decoder=decoder, **kw).token_ids  # type: ignore[arg-type]


class RoundedTrunk(LocalTrunk):
    """In-process reference with the wire's rounding applied to what goes in and comes out."""

    def __init__(self, inner: LocalTrunk, dtype: torch.dtype) -> None:
        super().__init__(inner.stack)
        self.dtype = dtype

    def forward(self, hidden, positions, parents=None, keep=None):  # type: ignore[no-untyped-def]
        h = hidden.to(self.dtype).float()  # [B, H]
        return super().forward(h, positions, parents, keep).to(self.dtype).float()


# ----------------------------------------------------------------------------- equality


@pytest.mark.parametrize("local_layers", [1, 2])
def test_greedy_through_server_equals_in_process(
    server: LocalTrunkServer, folder: Path, local_layers: int
) -> None:
    client = load_client(str(folder), local_layers)
    want = tokens(local_runner(client))
    decoders = sorted(available_decoders())
    with server.connect(client, wire_dtype="float32") as trunk:
        runner = SplitRunner(client, trunk)
        for dec in decoders:  # every decoder (tree blocks + compaction when speculative)
            assert tokens(runner, dec) == want, dec
        st = trunk.json_stats()
    assert st["round_trips"] >= len(want) * len(decoders) // 2
    assert st["bytes_sent"] > 0 and st["bytes_received"] > 0 and st["replays"] == 0
    assert st["rtt_ms"] > 0 and st["server_ms"] > 0


def test_fp16_wire_equals_the_same_rounding_in_process(
    server: LocalTrunkServer, client: ClientModel
) -> None:
    start, end = client.plan.trunk_range
    ref = SplitRunner(client, RoundedTrunk(load_trunk(client.resolved, start, end), torch.float16))
    want = tokens(ref)
    with server.connect(client) as trunk:  # fp16 is the default
        assert trunk.wire_dtype == "float16"
        assert tokens(SplitRunner(client, trunk)) == want


def test_retried_step_returns_cached_reply_without_double_append(
    server: LocalTrunkServer, client: ClientModel
) -> None:
    with server.connect(client) as trunk:
        assert trunk.sock is not None
        h = torch.randn(3, client.config.hidden_size)  # [B, H]
        a = trunk.forward(h, torch.arange(3))
        # resend step 0 by hand: the server must answer from its cache
        step = P.Step(trunk.session or "", 0, [0, 1, 2], None, None, "float16", h.half())
        trunk.sock.send_multipart(P.encode(step))
        r = trunk._recv(5.0)
        assert isinstance(r, P.Result) and r.hidden is not None
        assert torch.equal(r.hidden.float(), a)
        # the next real step still sees exactly 3 cached tokens (same result as a fresh run)
        b = trunk.forward(h[:1], torch.tensor([3]))
    with server.connect(client) as fresh:
        fresh.forward(h, torch.arange(3))
        assert torch.equal(fresh.forward(h[:1], torch.tensor([3])), b)


# ----------------------------------------------------------------------------- security


def raw_socket(srv: LocalTrunkServer, keys: tuple[str, str] | None = None) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    pub, sec = keys or srv.client_keys
    s.curve_serverkey = srv.server_public_key.encode()
    s.curve_publickey = pub.encode()
    s.curve_secretkey = sec.encode()
    s.connect(srv.address)
    return s


def ask(s: zmq.Socket, frames: list[bytes] | list[P.Frame], timeout: float = 10.0) -> P.Message:
    s.send_multipart(frames)
    assert s.poll(int(timeout * 1000)), "no reply from the server"
    return P.decode(s.recv_multipart())


def test_wrong_client_key_is_refused(server: LocalTrunkServer, client: ClientModel) -> None:
    stranger = tuple(k.decode() for k in zmq.curve_keypair())
    t0 = time.monotonic()
    with pytest.raises(AuthError, match="refused this computer's key"):
        connect_trunk(
            server.address,
            client,
            server_key=server.server_public_key,
            client_keys=stranger,  # type: ignore[arg-type]
            connect_timeout_s=10,
        )
    assert time.monotonic() - t0 < 5  # refused at the handshake, not after a timeout
    # and a raw socket with that key learns nothing at all
    s = raw_socket(server, stranger)  # type: ignore[arg-type]
    s.send_multipart(P.encode(P.Ping(1)))
    assert s.poll(1000) == 0
    s.close(0)


def test_wrong_server_key_fails_cleanly(server: LocalTrunkServer, client: ClientModel) -> None:
    bogus = zmq.curve_keypair()[0].decode()
    with pytest.raises(TransportError):
        connect_trunk(
            server.address,
            client,
            server_key=bogus,
            client_keys=server.client_keys,
            connect_timeout_s=2,
        )


def test_a_session_follows_its_key_to_a_new_connection(
    server: LocalTrunkServer, client: ClientModel
) -> None:
    """A session belongs to the key that opened it, not to one connection: a message about it
    from another connection of that key (a client that reconnected after a network drop) moves
    its replies there, and the next step from the first connection moves them back. (Another
    key is refused: tests/test_server_access.py.)"""
    want = tokens(local_runner(client))
    with server.connect(client, wire_dtype="float32") as trunk:
        runner = SplitRunner(client, trunk)
        runner.reset()
        runner.forward(PROMPT[:4], range(4))
        sid = trunk.session
        assert sid
        b = raw_socket(server)  # same key, another connection
        pong = ask(b, P.encode(P.Ping(5, sid)))
        assert isinstance(pong, P.Pong) and pong.known and pong.last_step == trunk.step_id
        # A's session goes on where it was: the whole generation still matches, no replay
        assert tokens(runner) == want and trunk.replays == 0
        assert b.poll(300) == 0  # and none of A's replies went to B
        b.close(0)


def test_a_network_drop_keeps_the_session(folder: Path, client: ClientModel) -> None:
    """The proxy cuts every connection twice mid-generation: the client's socket reconnects, its
    next message tells the server where the session's replies go now, and nothing is replayed."""
    want = tokens(local_runner(client))
    with start_local_trunk(str(folder), rtt_ms=10) as srv:
        assert srv.proxy is not None
        proxy = srv.proxy
        with srv.connect(client, wire_dtype="float32", **FAST) as trunk:
            dropped: list[int] = []

            def on_text(delta: str) -> None:
                if len(dropped) < 2:
                    dropped.append(proxy.drop_connections())

            assert tokens(SplitRunner(client, trunk), on_text=on_text) == want
            assert dropped == [1, 1]
            assert trunk.replays == 0 and trunk.reconnects == 0


def test_fingerprint_mismatch(server: LocalTrunkServer, folder: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    make_model(other, "llama", seed=99, n_layers=6)  # same config, different weights
    c = load_client(str(other), 1)
    with pytest.raises(FingerprintMismatch, match="trunk weights") as err:
        server.connect(c)
    # the client is told which model the server serves and what to do, never where it lives
    assert f"serves {folder.name} (model fingerprint " in str(err.value)
    assert str(folder.parent) not in str(err.value) and "Settings" in str(err.value)
    qwen = tmp_path / "qwen"
    make_model(qwen, "qwen2", seed=98, n_layers=6)  # another config
    with pytest.raises(FingerprintMismatch, match="another one") as err:
        server.connect(load_client(str(qwen), 1))
    assert str(folder.parent) not in str(err.value)
    assert load_config(folder).fingerprint() in str(err.value)
    s = raw_socket(server)
    r = ask(s, P.encode(P.Open("0123456789abcdef", None, 1, 5, "float16", 64, 512)))
    assert isinstance(r, P.Error) and r.code == P.E_FINGERPRINT
    s.close(0)


def test_range_not_served(folder: Path, tmp_path: Path) -> None:
    with start_local_trunk(str(folder), min_local_layers=2) as srv:
        c = load_client(str(folder), 1)  # wants [1, 5) but the server holds [2, 4)
        with pytest.raises(SplitError, match="serves layers"):
            srv.connect(c)


def test_client_without_trunk_tensors_is_accepted(
    server: LocalTrunkServer, folder: Path, tmp_path: Path, client: ClientModel
) -> None:
    """A client checkpoint holding only its own tensors sends no weight hash; still served."""
    from safetensors.torch import load_file, save_file

    slim = tmp_path / "slim"
    slim.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (slim / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(next(folder.glob("*.safetensors"))))
    keep = {k: v for k, v in sd.items() if not any(f"layers.{i}." in k for i in range(1, 5))}
    save_file(keep, str(slim / "model.safetensors"))
    c = load_client(str(slim), 1)
    want = tokens(local_runner(client))
    with server.connect(c, wire_dtype="float32") as trunk:
        assert trunk.weights_fp is None
        assert tokens(SplitRunner(c, trunk)) == want


# ----------------------------------------------------------------------------- bad input


def _fuzz_messages(rng: random.Random, sid: str, h: int) -> Iterator[list[bytes]]:
    """Random and malformed messages, each of which must get exactly one error reply."""

    def hdr(**kw: object) -> bytes:
        d: dict[str, object] = {"v": P.VERSION}
        d.update(kw)
        return msgpack.packb(d)

    def tensor(b: int, width: int, dt: torch.dtype = torch.float16) -> bytes:
        return bytes(P.tensor_frame(torch.randn(b, width).to(dt)))

    kinds = [
        lambda: [rng.randbytes(rng.randint(0, 64))],
        lambda: [rng.randbytes(rng.randint(1, 64)), rng.randbytes(rng.randint(0, 64))],
        lambda: [rng.randbytes(8)] * 3,
        lambda: [msgpack.packb({"v": rng.choice([0, 2, 7, "1"]), "t": "ping", "nonce": 1})],
        lambda: [hdr(t=rng.choice(["result", "opened", "pong", "closed", "error", "x"]))],
        lambda: [
            hdr(
                t="step",
                session="nope" + str(rng.random()),
                step=0,
                positions=[0],
                dtype="float16",
                shape=[1, h],
            ),
            tensor(1, h),
        ],
        lambda: [
            hdr(
                t="step",
                session=sid,
                step=rng.randint(5, 99),
                positions=[0],
                dtype="float16",
                shape=[1, h],
            ),
            tensor(1, h),
        ],
        lambda: [
            hdr(
                t="step", session=sid, step=0, positions=[0, 1], dtype="float16", shape=[2, h // 2]
            ),
            tensor(2, h // 2),
        ],
        lambda: [
            hdr(t="step", session=sid, step=0, positions=[0], dtype="float32", shape=[1, h]),
            tensor(1, h, torch.float32),
        ],
        lambda: [
            hdr(t="step", session=sid, step=0, positions=[0], dtype="float16", shape=[1, h]),
            tensor(1, h)[:-1],
        ],
        lambda: [
            hdr(t="step", session=sid, step=0, positions=[0], dtype="int8", shape=[1, h]),
            tensor(1, h),
        ],
        lambda: [
            hdr(
                t="step",
                session=sid,
                step=0,
                positions=[0],
                dtype="float16",
                shape=[1, h],
                keep=[3],
            ),
            tensor(1, h),
        ],
        lambda: [
            hdr(t="step", session=sid, step=0, positions=[10**9], dtype="float16", shape=[1, h]),
            tensor(1, h),
        ],
        lambda: [
            hdr(
                t="step",
                session=sid,
                step=0,
                positions=[1, 2, 3],
                parents=[-1, 2, 0],
                dtype="float16",
                shape=[3, h],
            ),
            tensor(3, h),
        ],
        lambda: [hdr(t="close", session="x" * 70)],
        lambda: [
            hdr(
                t="open",
                config_fp="c",
                start=1,
                end=5,
                dtype="float16",
                hidden_size=h,
                max_context="big",
            )
        ],
        lambda: [msgpack.packb({"v": 1, "t": "step", rng.randbytes(3): 1}, use_bin_type=True)],
    ]
    while True:
        yield rng.choice(kinds)()


def test_a_thousand_bad_frames_then_a_normal_session(
    server: LocalTrunkServer, client: ClientModel
) -> None:
    want = tokens(local_runner(client))
    h = client.config.hidden_size
    s = raw_socket(server)
    opened = ask(s, P.encode(P.Open(client.config.fingerprint(), None, 1, 5, "float16", h, 512)))
    assert isinstance(opened, P.Opened)
    rng = random.Random(1234)
    gen = _fuzz_messages(rng, opened.session, h)
    sent = 0
    codes: dict[str, int] = {}
    while sent < 1100:
        batch = [next(gen) for _ in range(50)]
        for frames in batch:
            s.send_multipart(frames)
        for _ in batch:
            assert s.poll(10000), f"the server stopped answering after {sent} bad messages"
            r = P.decode(s.recv_multipart())
            assert isinstance(r, P.Error), r
            codes[r.code] = codes.get(r.code, 0) + 1
        sent += len(batch)
    assert sent >= 1000 and server.running
    assert {P.E_BAD_MESSAGE, P.E_VERSION, P.E_UNKNOWN_SESSION, P.E_SHAPE, P.E_BAD_STEP} <= set(
        codes
    )
    # the fuzzed session itself still works: step 0 is still expected
    ok = ask(
        s,
        P.encode(P.Step(opened.session, 0, [0], None, None, "float16", torch.zeros(1, h).half())),
    )
    assert isinstance(ok, P.Result) and ok.step == 0
    # an oversize message: the server drops that connection, nothing else
    big = raw_socket(server)
    big.send_multipart([b"x" * (P.MAX_HEADER_BYTES * 64)])
    assert big.poll(500) == 0
    big.close(0)
    s.close(0)
    assert server.running
    with server.connect(client, wire_dtype="float32") as trunk:
        assert tokens(SplitRunner(client, trunk)) == want


def test_pings_are_answered_while_the_worker_computes(
    server: LocalTrunkServer, client: ClientModel
) -> None:
    """Tensor work runs off the socket thread: another client's ping is answered while
    several big blocks are still queued or running."""
    h = client.config.hidden_size
    fp = client.config.fingerprint()
    a = raw_socket(server)
    sids = []
    for _ in range(4):
        r = ask(a, P.encode(P.Open(fp, None, 1, 5, "float32", h, 512)))
        assert isinstance(r, P.Opened)
        sids.append(r.session)
    b = raw_socket(server)
    assert isinstance(ask(b, P.encode(P.Ping(1))), P.Pong)  # b's handshake is done
    block = torch.randn(500, h)  # [B, H]
    for sid in sids:
        a.send_multipart(P.encode(P.Step(sid, 0, list(range(500)), None, None, "float32", block)))
    b.send_multipart(P.encode(P.Ping(2)))
    poller = zmq.Poller()
    poller.register(a, zmq.POLLIN)
    poller.register(b, zmq.POLLIN)
    arrivals: list[tuple[str, P.Message]] = []  # in arrival order
    deadline = time.monotonic() + 60
    while len(arrivals) < len(sids) + 1 and time.monotonic() < deadline:
        for sock in dict(poller.poll(1000)):
            arrivals.append(("a" if sock is a else "b", P.decode(sock.recv_multipart())))
    assert len(arrivals) == len(sids) + 1
    assert all(isinstance(m, P.Result) for who, m in arrivals if who == "a")
    order = [who for who, _ in arrivals]
    assert isinstance(arrivals[order.index("b")][1], P.Pong)
    assert order[-1] == "a", order  # the pong did not wait for the queued blocks
    for sid in sids:
        assert isinstance(ask(a, P.encode(P.Close(sid))), P.Closed)
    a.close(0)
    b.close(0)


# ----------------------------------------------------------------------------- reliability


def test_sigkill_mid_generation_then_restart_gives_identical_output(
    folder: Path, client: ClientModel
) -> None:
    want = generate(local_runner(client), PROMPT, GREEDY).text
    with start_local_trunk(str(folder)) as srv:
        trunk = srv.connect(client, wire_dtype="float32", **FAST)
        runner = SplitRunner(client, trunk)
        chunks: list[str] = []
        restarter: list[threading.Thread] = []

        def on_text(delta: str) -> None:
            chunks.append(delta)
            if len(chunks) == 5:
                srv.kill()  # SIGKILL
                t = threading.Thread(target=srv.restart)
                t.start()
                restarter.append(t)

        res = generate(runner, PROMPT, GREEDY, on_text=on_text)
        for t in restarter:
            t.join(60)
        st = trunk.json_stats()
        trunk.close()
        assert restarter, "the server was never killed"
    assert res.text == want and "".join(chunks) == want
    assert st["replays"] >= 1 and st["replayed_steps"] >= 5


def test_through_the_wan_emulator(folder: Path, client: ClientModel) -> None:
    """CURVE + ZeroMQ through the delay proxy: same tokens, and the measured RTT shows it."""
    want = tokens(local_runner(client))
    with start_local_trunk(str(folder), rtt_ms=40) as srv:
        assert srv.proxy is not None and srv.address == srv.proxy.address
        with srv.connect(client, wire_dtype="float32") as trunk:
            assert tokens(SplitRunner(client, trunk)) == want
            st = trunk.json_stats()
    assert 40 <= st["rtt_ms"] < 200 and st["ping_ms"] >= 40


@pytest.fixture(scope="module")
def small_server(folder: Path) -> Iterator[LocalTrunkServer]:
    # 1 s TTL; ~210 kB of KV cache = 128 slots of this model's trunk, not 256; 2 sessions (and a
    # per-client cap above that, so one key can reach the global cap).
    args = ["--session-ttl", "1", "--max-cache-gb", "0.0002", "--max-sessions", "2"]
    args += ["--max-sessions-per-client", "3"]
    with start_local_trunk(str(folder), extra_args=args) as srv:
        yield srv


def test_session_ttl_expiry_is_replayed(
    small_server: LocalTrunkServer, client: ClientModel
) -> None:
    want = tokens(local_runner(client))
    with small_server.connect(client, wire_dtype="float32", **FAST) as trunk:
        n = [0]

        def on_text(delta: str) -> None:
            n[0] += 1
            if n[0] == 4:
                time.sleep(2.0)  # idle past the TTL: the server drops the session

        assert tokens(SplitRunner(client, trunk), on_text=on_text) == want
        assert trunk.replays == 1
    assert any("expired after 1 s idle" in ln for ln in small_server.stderr_tail)


def test_memory_and_session_caps_answer_server_busy(
    small_server: LocalTrunkServer, client: ClientModel
) -> None:
    h = client.config.hidden_size
    with small_server.connect(client) as trunk:
        with pytest.raises(ServerBusy, match="memory cap"):
            trunk.forward(torch.randn(150, h), torch.arange(150))  # needs 256 slots
        # refused before any change: a block that fits still works on the same session
        out = trunk.forward(torch.randn(100, h), torch.arange(100))
        assert out.shape == (100, h)
        with small_server.connect(client), pytest.raises(ServerBusy, match="sessions open"):
            small_server.connect(client)
    assert small_server.running


# ----------------------------------------------------------------------------- CLI


def _run_cli(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "remote.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
        **kw,  # type: ignore[arg-type]
    )


def test_cli_key_management(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from remote.cli import main

    d = tmp_path / "keys"
    assert main(["keygen", "--keys", str(d)]) == 0
    assert (d / "server.key_secret").stat().st_mode & 0o777 == 0o600
    assert main(["keygen", "--keys", str(d)]) == 2  # no silent overwrite
    pub = PLAIN_KEYS[1][0]  # fixed: a random key starts with '-' once in 85 (test_server_access)
    assert main(["allow", pub, "--keys", str(d), "--name", "alice"]) == 0
    assert pub in (d / "allowed_clients.txt").read_text()
    assert main(["allow", "too-short", "--keys", str(d)]) == 2
    assert main(["invite", "--address", "tcp://10.1.2.3:5757", "--keys", str(d)]) == 0
    out = capsys.readouterr()
    invite = out.out.strip().splitlines()[-1]
    server_pub = (d / "server.key").read_text().split("=", 1)[1].strip()
    assert P.parse_invite(invite) == ("tcp://10.1.2.3:5757", server_pub)
    assert main(["revoke", pub, "--keys", str(d)]) == 0
    assert pub not in (d / "allowed_clients.txt").read_text()
    assert main(["revoke", pub, "--keys", str(d)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(ln.startswith("veil-trunk: error: ") for ln in err)
    # plain TCP is refused off loopback, in one line, before any model is loaded
    assert main(["serve", "--model", "x", "--insecure", "--bind", "tcp://0.0.0.0:5999"]) == 2
    assert "loopback" in capsys.readouterr().err
    for flag in ("--threads", "--kernel-threads"):
        argv = ["serve", "--model", "x", "--insecure", "--bind", "tcp://127.0.0.1:5999", flag]
        assert main([*argv, "-1"]) == 2
        assert f"{flag} must be >= 0" in capsys.readouterr().err


def test_two_terminal_flow_with_veil_generate(
    folder: Path,
    tmp_path: Path,
    client: ClientModel,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """README flow: keygen, allow the client's key, serve, invite, `veil generate --server`.

    Two fixed client keys, one starting with '-' (which argparse would take for an option) and
    one not, both allowed exactly as `veil --client-key` prints them."""
    from app.cli import main as veil
    from engine import keys
    from engine.local_server import free_port
    from remote.cli import main as trunk_cli

    monkeypatch.setenv("VEIL_KEYRING", "memory")
    monkeypatch.setenv("VEIL_WIRE_DTYPE", "float32")
    monkeypatch.setattr(keys, "_backend", None)

    def use_key(pair: tuple[str, str]) -> None:
        keys.backend().set_password(keys.SERVICE, keys.CLIENT_PUBLIC, pair[0])
        keys.backend().set_password(keys.SERVICE, keys.CLIENT_SECRET, pair[1])

    use_key(DASH_KEYS[0])
    assert veil(["--client-key"]) == 0
    shown = capsys.readouterr().out.strip()
    assert shown == DASH_KEYS[0][0]
    d = tmp_path / "keys"
    assert trunk_cli(["keygen", "--keys", str(d)]) == 0
    for pub in (shown, PLAIN_KEYS[0][0]):
        assert trunk_cli(["allow", pub, "--keys", str(d)]) == 0
    addr = f"tcp://127.0.0.1:{free_port()}"
    assert trunk_cli(["invite", "--address", addr, "--keys", str(d)]) == 0
    invite = capsys.readouterr().out.strip().splitlines()[-1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "remote.cli",
            "serve",
            "--model",
            str(folder),
            "--keys",
            str(d),
            "--bind",
            addr,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"READY {addr} "), line
        common = [
            "generate",
            "--model",
            str(folder),
            "--local-layers",
            "1",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "10",
            "--decoder",
            "sequential",
            "--json",
        ]
        assert veil(common) == 0
        local = json.loads(capsys.readouterr().out)
        assert veil([*common, "--server", invite]) == 0
        remote = json.loads(capsys.readouterr().out)
        assert remote["text"] == local["text"] and remote["token_ids"] == local["token_ids"]
        for k in ("round_trips", "bytes_sent", "bytes_received", "rtt_ms", "replays"):
            assert k in remote
        assert remote["replays"] == 0 and remote["bytes_sent"] > 0
        # the server key was saved: the bare address works now (here with the other client key)
        use_key(PLAIN_KEYS[0])
        assert veil([*common, "--server", addr]) == 0
        assert json.loads(capsys.readouterr().out)["text"] == local["text"]
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0  # clean shutdown on SIGTERM
    assert "stopped" in (proc.stderr.read() if proc.stderr else "")


def test_unknown_address_key_is_a_clear_error(
    client: ClientModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VEIL_KEYRING", "memory")
    with pytest.raises(TransportError, match="no key is saved"):
        connect_trunk("tcp://127.0.0.1:1", client)
    with pytest.raises(TransportError, match="neither"):
        connect_trunk("example.com:5757", client)
    with pytest.raises(TransportError, match="loopback"):
        connect_trunk("tcp://10.0.0.1:5757", client, insecure=True)


def test_server_death_without_restart_is_one_clear_error(folder: Path, client: ClientModel) -> None:
    with start_local_trunk(str(folder)) as srv:
        trunk = srv.connect(client, timeout_s=0.5, heartbeat_s=0.1, reconnect_s=2.0)
        trunk.forward(torch.randn(2, client.config.hidden_size), torch.arange(2))
        srv.kill()
        with pytest.raises(TransportError, match="could not get it back"):
            trunk.forward(torch.randn(1, client.config.hidden_size), torch.tensor([2]))
        trunk.close()


def test_local_server_reports_a_dying_child(tmp_path: Path) -> None:
    with pytest.raises(TransportError, match="exited with code"):
        start_local_trunk(str(tmp_path / "no-such-model"))
