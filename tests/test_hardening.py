"""The client and server against the failures of issue 17: a misbehaving server (a fake trunk
that answers ``internal``, ``unknown_session``, "in flight" forever, NaN, oversized frames),
long prompts through a real server, revocation of a connected client, per-key session caps,
the idle rule, routing-id takeover, damaged invites and keys that start with '-'.

Client-side cases need no model (a :class:`RemoteTrunk` with made-up fingerprints talks to
:class:`tests.fake_trunk.FakeTrunk`); server-side ones run one real ``veil-trunk serve`` with an
allow-list file, shared by the module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from engine import keys
from engine import protocol as P
from engine.errors import AuthError, KeyStoreError, TransportError
from engine.generate import generate
from engine.local_server import free_port
from engine.sampling import SamplingParams
from engine.split import ClientModel, SplitRunner, load_client, load_trunk
from engine.transport import STEP_TIMEOUT_S, RemoteTrunk, connect_trunk
from engine.transport.policy import PREFILL_CHUNK
from remote.allowlist import AllowList
from remote.cli import main as trunk_cli
from tests.fake_trunk import OVERSIZED_BYTES, FakeTrunk, hidden
from tests.fixed_keys import DASH_KEYS, PLAIN_KEYS
from tests.tiny import make_model

REPO = Path(__file__).resolve().parent.parent
FAST = {
    "timeout_s": 1.0,
    "heartbeat_s": 0.1,
    "reconnect_s": 5.0,
    "connect_timeout_s": 5.0,
    "step_timeout_s": 3.0,
}


def fake_client(fake: FakeTrunk, **kw: float) -> RemoteTrunk:
    opts = {**FAST, **kw}
    return RemoteTrunk(
        fake.address,
        server_key=fake.public_key,
        client_keys=PLAIN_KEYS[0],
        start=1,
        end=3,
        hidden_size=64,
        config_fp="fake",
        weights_fp=None,
        wire_dtype="float32",
        **opts,  # type: ignore[arg-type]
    )


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> Iterator[FakeTrunk]:
    with FakeTrunk(request.param) as f:
        yield f


# ----------------------------------------------------------------------------- defect 1


@pytest.mark.parametrize("fake", ["echo"], indirect=True)
def test_fake_echo_server_works_and_long_blocks_go_in_chunks(fake: FakeTrunk) -> None:
    with fake_client(fake) as trunk:
        h = hidden(1300)
        assert torch.equal(trunk.forward(h, torch.arange(1300)), h)
        # 1300 rows as chain steps of at most PREFILL_CHUNK rows each
        assert fake.counts["step"] == -(-1300 // PREFILL_CHUNK)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["internal"], indirect=True)
def test_internal_error_is_a_server_fault_not_a_retry_storm(fake: FakeTrunk) -> None:
    with fake_client(fake) as trunk:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="failed on this step 2 times: CUDA out of"):
            trunk.forward(hidden(4), torch.arange(4))
        assert time.monotonic() - t0 < 10
    # one retry (reopen + the step again), then the error: no storm
    assert fake.counts["open"] <= 2 and fake.counts["step"] <= 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["unknown"], indirect=True)
def test_a_server_that_keeps_losing_the_session_is_given_up(fake: FakeTrunk) -> None:
    lost = "lost this conversation's session 5 times"
    with fake_client(fake) as trunk, pytest.raises(TransportError, match=lost):
        trunk.forward(hidden(4), torch.arange(4))
    assert fake.counts["open"] <= 1 + trunk.max_session_losses
    assert fake.counts["step"] <= 1 + trunk.max_session_losses


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["in_flight", "silent_accept"], indirect=True)
def test_a_step_never_answered_ends_at_the_deadline(fake: FakeTrunk) -> None:
    with fake_client(fake, step_timeout_s=2.0) as trunk:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="did not finish a step within 2 s"):
            trunk.forward(hidden(4), torch.arange(4))
        assert 1.9 < time.monotonic() - t0 < 8
        # the trunk refuses to go on with an unknown server state; a new conversation may
        with pytest.raises(TransportError, match="failed during this conversation"):
            trunk.forward(hidden(1), torch.tensor([4]))
    # "done but no reply": the step is sent again (a retry gets the cached reply), with backoff
    assert (fake.counts["step"] > 1) == (fake.mode == "silent_accept")
    assert fake.counts["step"] < 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["lose_late"], indirect=True)
def test_recovering_a_step_does_not_restart_its_deadline(fake: FakeTrunk) -> None:
    """The session is lost 3 s into a 4 s step, and the new session never finishes it: the step
    still ends at its one deadline (4 s), not a fresh 4 s after each recovery."""
    fake.lose_after_s = 3.0
    with fake_client(fake, step_timeout_s=4.0) as trunk:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="did not finish a step within 4 s"):
            trunk.forward(hidden(4), torch.arange(4))
        assert time.monotonic() - t0 < 6.5
    assert fake.counts["open"] == 2  # one recovery happened


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["nan", "inf"], indirect=True)
def test_non_finite_activations_are_a_server_fault(fake: FakeTrunk) -> None:
    with (
        fake_client(fake) as trunk,
        pytest.raises(TransportError, match="invalid activations"),
    ):
        trunk.forward(hidden(4), torch.arange(4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["oversized"], indirect=True)
def test_an_oversized_reply_is_never_buffered(fake: FakeTrunk) -> None:
    trunk = fake_client(fake, step_timeout_s=2.0)
    assert trunk.max_reply_bytes < OVERSIZED_BYTES
    with pytest.raises(TransportError):
        trunk.forward(hidden(4), torch.arange(4))
    assert fake.counts["step"] >= 1  # the server did send its oversized reply (and more)
    assert trunk.bytes_received < trunk.max_reply_bytes  # ...but none of it was taken in
    trunk.close()


def test_default_limits_end_a_misbehaving_server_within_two_minutes() -> None:
    """The documented worst case with default settings: connecting, then a step's own budget
    (waiting, replays) plus the time allowed to reach a lost server again."""
    import inspect

    d = {
        k: v.default
        for k, v in inspect.signature(RemoteTrunk.__init__).parameters.items()
        if v.default is not inspect.Parameter.empty
    }
    assert d["step_timeout_s"] == STEP_TIMEOUT_S
    assert d["connect_timeout_s"] + d["step_timeout_s"] + d["reconnect_s"] <= 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 layers and an 8k context, so prompts longer than one 4,096-row block fit."""
    f = tmp_path_factory.mktemp("tiny") / "llama8k"
    make_model(f, "llama", seed=5, n_layers=6, max_position_embeddings=8192)
    return f


@pytest.fixture(scope="module")
def client(tiny: Path) -> ClientModel:
    return load_client(str(tiny), 1)


@pytest.fixture
def memory_keyring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VEIL_KEYRING", "memory")
    monkeypatch.setattr(keys, "_backend", None)
    monkeypatch.setattr(keys, "_backend_kind", None)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["internal", "in_flight", "nan"])
def test_veil_generate_against_a_misbehaving_server_is_one_line_and_exit_3(
    tiny: Path, mode: str
) -> None:
    with FakeTrunk(mode) as fake:
        env = dict(os.environ, VEIL_KEYRING="memory", VEIL_STEP_TIMEOUT="3")
        t0 = time.monotonic()
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "app.cli", "generate", "--model", str(tiny)),
                *("--local-layers", "1", "--prompt", "hi", "--max-new-tokens", "4"),
                *("--server", fake.invite),
            ],
            capture_output=True,
            text=True,
            timeout=110,
            cwd=REPO,
            env=env,
        )
        took = time.monotonic() - t0
    lines = proc.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("veil: error:")]
    assert proc.returncode == 3, proc.stderr
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in proc.stderr
    assert took < 60, took


def test_the_app_shows_the_error_and_gives_the_message_back(
    tiny: Path, tmp_path: Path, memory_keyring: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.core.controller import AppController
    from app.core.settings import MODE_SERVER, Settings
    from app.core.tasks import InlineExecutor

    monkeypatch.setenv("VEIL_STEP_TIMEOUT", "3")
    with FakeTrunk("internal") as fake:
        s = Settings(first_run_done=True, mode=MODE_SERVER, invite=fake.invite, model=str(tiny))
        s.local_layers, s.max_tokens = 1, 4
        app = AppController(InlineExecutor(), tmp_path, settings=s)
        failures: list[tuple[str, str]] = []
        app.chat.failed.connect(lambda err, text: failures.append((str(err), text)))
        t0 = time.monotonic()
        assert app.chat.send("please keep this message")
        assert time.monotonic() - t0 < 30
        app.close()
    assert len(failures) == 1
    err, put_back = failures[0]
    assert "failed on this step" in err and "\n" not in err
    assert put_back == "please keep this message"
    assert app.chat.current is not None


# ----------------------------------------------------------------------------- defect 5


def test_an_invite_with_a_malformed_key_is_refused_when_parsed() -> None:
    for bad in ("#" * 40, "~" * 40, "abc"):
        with pytest.raises(ValueError, match="damaged"):
            P.parse_invite(P.make_invite("tcp://127.0.0.1:5", bad))
    good = P.make_invite("tcp://127.0.0.1:5", DASH_KEYS[0][0])
    assert P.parse_invite(good) == ("tcp://127.0.0.1:5", DASH_KEYS[0][0])


@pytest.mark.timeout(60)
def test_socket_errors_close_the_socket_and_do_not_hang() -> None:
    for address, key in (("tcp://127.0.0.1:99999", PLAIN_KEYS[1][0]), ("tcp://x:1", "#" * 40)):
        with pytest.raises(TransportError):
            RemoteTrunk(
                address,
                server_key=key,
                client_keys=PLAIN_KEYS[0],
                start=1,
                end=3,
                hidden_size=64,
                config_fp="c",
                weights_fp=None,
                connect_timeout_s=1,
            )


@pytest.mark.timeout(60)
def test_a_saved_server_key_is_replaced_only_after_a_handshake(
    client: ClientModel, memory_keyring: None, caplog: pytest.LogCaptureFixture
) -> None:
    with FakeTrunk("echo") as fake:
        keys.save_server_key(fake.address, PLAIN_KEYS[1][0])  # pinned before: another key
        wrong = P.make_invite(fake.address, DASH_KEYS[1][0])  # an invite nobody holds
        with pytest.raises(TransportError):
            connect_trunk(wrong, client, connect_timeout_s=1.5)
        assert keys.server_key(fake.address) == PLAIN_KEYS[1][0]  # untouched
        with caplog.at_level("WARNING", logger="veil.transport"):
            connect_trunk(fake.invite, client, connect_timeout_s=5).close()
        assert keys.server_key(fake.address) == fake.public_key
        assert "replaces the old one" in caplog.text


def test_an_insecure_loopback_server_is_reachable_or_named_in_the_error(
    tiny: Path, client: ClientModel, memory_keyring: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main as veil

    with pytest.raises(TransportError, match="add --insecure"):
        connect_trunk("tcp://127.0.0.1:1", client)
    with FakeTrunk("echo", curve=False) as fake:  # like `veil-trunk serve --insecure`
        argv = ["generate", "--model", str(tiny), "--local-layers", "1", "--prompt", "hi"]
        argv += ["--max-new-tokens", "3", "--json", "--server", fake.address, "--insecure"]
        assert veil(argv) == 0
        assert json.loads(capsys.readouterr().out)["round_trips"] >= 1
        assert fake.counts["open"] >= 1 and fake.counts["step"] >= 1


# ----------------------------------------------------------------------------- real server


class KeyedServer:
    """``veil-trunk serve`` with a keys folder and an allow-list file (as an admin runs it)."""

    def __init__(self, model: Path, keys_dir: Path, extra: list[str]) -> None:
        self.keys_dir = keys_dir
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.public_key = (keys_dir / "server.key").read_text().split("=", 1)[1].strip()
        cmd = [sys.executable, "-m", "remote.cli", "serve", "--model", str(model)]
        cmd += ["--keys", str(keys_dir), "--bind", self.address, "--threads", "1", *extra]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
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

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def keyed(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedServer]:
    d = tmp_path_factory.mktemp("trunk-keys")
    assert trunk_cli(["keygen", "--keys", str(d)]) == 0
    for pub, _ in (*DASH_KEYS, *PLAIN_KEYS):  # keys starting with '-', as printed, unquoted
        assert trunk_cli(["allow", pub, "--keys", str(d)]) == 0
    assert trunk_cli(["allow", DASH_KEYS[0][0], "--keys", str(d), "--name", "again"]) == 0
    allowed = (d / "allowed_clients.txt").read_text().split()
    assert all(pub in allowed for pub, _ in (*DASH_KEYS, *PLAIN_KEYS))
    srv = KeyedServer(
        tiny, d, ["--session-ttl", "1.5", "--max-sessions", "6", "--max-sessions-per-client", "2"]
    )
    yield srv
    srv.stop()


def ask(s: zmq.Socket, msg: P.Message, timeout: float = 10.0) -> P.Message:
    s.send_multipart(P.encode(msg))
    assert s.poll(int(timeout * 1000)), "no reply from the server"
    return P.decode(s.recv_multipart())


def open_msg(client: ClientModel) -> P.Open:
    return P.Open(client.config.fingerprint(), None, 1, 5, "float32", 64, 8192)


def local_tokens(client: ClientModel, prompt: list[int], n: int) -> list[int]:
    start, end = client.plan.trunk_range
    runner = SplitRunner(client, load_trunk(client.resolved, start, end))
    return generate(runner, prompt, SamplingParams(max_new_tokens=n)).token_ids


def test_a_prompt_over_4096_tokens_through_the_server_equals_in_process(
    keyed: KeyedServer, client: ClientModel
) -> None:
    prompt = [
        int(x) for x in torch.randint(3, 400, (5000,), generator=torch.Generator().manual_seed(1))
    ]
    want = local_tokens(client, prompt, 5)
    with keyed.connect(client, PLAIN_KEYS[0]) as trunk:
        runner = SplitRunner(client, trunk)
        n = [0]

        def on_text(_: str) -> None:
            n[0] += 1
            if n[0] == 2:  # lose the session: the 5,000-token history is replayed in chunks
                trunk._send(P.Close(trunk.session or ""))

        res = generate(runner, prompt, SamplingParams(max_new_tokens=5), on_text=on_text)
        assert res.token_ids == want
        assert trunk.replays == 1 and trunk.replayed_steps >= -(-5000 // PREFILL_CHUNK)


def test_revoking_a_connected_key_closes_its_sessions_within_seconds(
    keyed: KeyedServer, client: ClientModel
) -> None:
    key = DASH_KEYS[1]
    trunk = keyed.connect(client, key)
    trunk.forward(hidden(3), torch.arange(3))
    raw = keyed.socket(key)
    assert isinstance(ask(raw, P.Ping(1)), P.Pong)  # connected and allowed
    assert trunk_cli(["revoke", key[0], "--keys", str(keyed.keys_dir)]) == 0  # starts with '-'
    t0 = time.monotonic()
    with pytest.raises(AuthError, match="no longer accepts this computer's key"):
        trunk.forward(hidden(1), torch.tensor([3]))
    assert time.monotonic() - t0 < 5
    r = ask(raw, open_msg(client))  # the open connection can no longer open sessions either
    assert isinstance(r, P.Error) and r.code == P.E_DENIED
    deadline = time.monotonic() + 5
    while not any("its key was revoked" in ln for ln in keyed.stderr):
        assert time.monotonic() < deadline, keyed.stderr[-5:]
        time.sleep(0.1)
    raw.close(0)
    trunk.close()


def test_the_allow_list_reloads_on_content_not_timestamps(tmp_path: Path) -> None:
    path = tmp_path / "allowed_clients.txt"
    path.write_text(PLAIN_KEYS[0][0] + "\n")
    allowed = AllowList(path, interval_s=0.2)
    assert allowed(PLAIN_KEYS[0][0]) and not allowed(PLAIN_KEYS[1][0])
    st = path.stat()
    with open(path, "r+") as f:  # same size, same inode, and the old timestamp put back
        f.write(PLAIN_KEYS[1][0] + "\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    time.sleep(0.25)
    assert allowed(PLAIN_KEYS[1][0]) and not allowed(PLAIN_KEYS[0][0])


def test_one_key_cannot_hold_more_than_its_share(keyed: KeyedServer, client: ClientModel) -> None:
    a1 = keyed.socket(DASH_KEYS[0])
    first, second = (ask(a1, open_msg(client)) for _ in range(2))
    assert isinstance(first, P.Opened) and isinstance(second, P.Opened)
    third = ask(a1, open_msg(client))
    assert isinstance(third, P.Error) and third.code == P.E_BUSY
    assert "per-client limit is 2" in third.message
    b = keyed.socket(PLAIN_KEYS[1])  # ...while another key still gets in
    assert isinstance(ask(b, open_msg(client)), P.Opened)
    # The same key on a new connection (a client back after a lost connection) takes over its
    # own least recently used idle session instead of being locked out: still 2 in all.
    a2 = keyed.socket(DASH_KEYS[0])
    assert isinstance(ask(a2, open_msg(client)), P.Opened)
    gone = ask(a1, P.Ping(2, first.session))
    assert isinstance(gone, P.Pong) and not gone.known
    kept = ask(a1, P.Ping(3, second.session))
    assert isinstance(kept, P.Pong) and kept.known
    assert isinstance(ask(a2, open_msg(client)), P.Opened)  # evicts a1's other one
    again = ask(a2, open_msg(client))
    assert isinstance(again, P.Error) and again.code == P.E_BUSY
    for s in (a1, a2, b):
        s.close(0)


def test_pings_alone_do_not_keep_a_session(keyed: KeyedServer, client: ClientModel) -> None:
    s = keyed.socket(PLAIN_KEYS[1])
    opened = ask(s, open_msg(client))
    assert isinstance(opened, P.Opened)
    deadline = time.monotonic() + 6
    known = True
    while known and time.monotonic() < deadline:  # the TTL is 1.5 s
        pong = ask(s, P.Ping(1, opened.session))
        assert isinstance(pong, P.Pong)
        known = pong.known
        time.sleep(0.2)
    assert not known, "a session with pings but no steps must expire"
    s.close(0)


def test_another_key_cannot_take_over_a_routing_id(keyed: KeyedServer, client: ClientModel) -> None:
    """A client that picks its own routing id (old clients did; a hostile one may) keeps it: a
    second connection presenting the same id — here with another allowed key — is not attached
    in its place (no ROUTER handover), so it receives nothing of the first one's session."""
    ident = b"v-victim-routing"
    victim = keyed.socket(PLAIN_KEYS[0], ident)
    opened = ask(victim, open_msg(client))
    assert isinstance(opened, P.Opened)
    block = torch.randn(4096, 64)  # [B, H]: seconds of work for the server
    victim.send_multipart(
        P.encode(P.Step(opened.session, 0, list(range(4096)), None, None, "float32", block))
    )
    time.sleep(0.2)  # the step is accepted and being computed
    thief = keyed.socket(PLAIN_KEYS[1], ident)  # another allowed key, the same routing id
    got: list[P.Message] = []
    end = time.monotonic() + 8
    result: P.Message | None = None
    while time.monotonic() < end and result is None:
        thief.send_multipart(P.encode(P.Ping(7, opened.session)))
        if thief.poll(100):
            got.append(P.decode(thief.recv_multipart()))
        if victim.poll(100):
            result = P.decode(victim.recv_multipart())
    assert isinstance(result, P.Result) and result.step == 0, result
    assert not any(isinstance(m, P.Result) or (isinstance(m, P.Pong) and m.known) for m in got)
    for s in (victim, thief):
        s.close(0)


def test_another_key_cannot_touch_a_session(keyed: KeyedServer, client: ClientModel) -> None:
    """Knowing a session's id is not enough: steps, closes and pings about it from another
    allowed key are answered as if it did not exist, and the session goes on untouched."""
    h = torch.randn(64, 64)
    with keyed.connect(client, PLAIN_KEYS[0]) as ref:
        want = [ref.forward(h[:32], torch.arange(32)), ref.forward(h[32:], torch.arange(32, 64))]
    with keyed.connect(client, PLAIN_KEYS[0]) as trunk:
        first = trunk.forward(h[:32], torch.arange(32))
        sid = trunk.session
        assert sid
        other = keyed.socket(PLAIN_KEYS[1])
        one = torch.zeros(1, 64)  # [B, H]
        for msg in (
            P.Step(sid, trunk.step_id + 1, [32], None, None, "float32", one),
            P.Step(sid, trunk.step_id, [0], None, None, "float32", one),
            P.Close(sid),
        ):
            r = ask(other, msg)
            assert isinstance(r, P.Error) and r.code == P.E_UNKNOWN_SESSION, r
        pong = ask(other, P.Ping(5, sid))
        assert isinstance(pong, P.Pong) and not pong.known and pong.last_step == -1
        other.close(0)
        rest = trunk.forward(h[32:], torch.arange(32, 64))
        assert trunk.replays == 0
    assert torch.equal(first, want[0]) and torch.equal(rest, want[1])


def test_an_honest_client_survives_takeover_attempts(
    keyed: KeyedServer, client: ClientModel
) -> None:
    """While a long prompt goes through, another allowed key keeps opening connections that ask
    about the honest client's session (whose id it knows) and send steps for it: it never
    receives a result or a live pong, and the honest output is exact."""
    h = torch.randn(1500, 64)
    with keyed.connect(client, PLAIN_KEYS[0]) as ref:
        want = ref.forward(h, torch.arange(1500))
    with keyed.connect(client, PLAIN_KEYS[0]) as trunk:
        stolen: list[P.Message] = []
        stop, answered = threading.Event(), threading.Event()
        one = torch.zeros(1, 64)  # [B, H]

        def attack() -> None:
            while not stop.is_set():
                s = keyed.socket(PLAIN_KEYS[1])
                sid = trunk.session or ""
                s.send_multipart(P.encode(P.Ping(1, sid)))
                s.send_multipart(
                    P.encode(P.Step(sid, trunk.step_id + 1, [0], None, None, "float32", one))
                )
                # the first connection waits for its answers (the attack is live before the
                # honest client starts); later ones give up after 0.15 s
                t_end = time.monotonic() + (0.15 if answered.is_set() else 20.0)
                while time.monotonic() < t_end:
                    if s.poll(20):
                        stolen.append(P.decode(s.recv_multipart()))
                        answered.set()
                        t_end = min(t_end, time.monotonic() + 0.15)
                s.close(0)

        thread = threading.Thread(target=attack, daemon=True)
        thread.start()
        try:
            assert answered.wait(20), "the attacker's connection was never answered"
            got = trunk.forward(h, torch.arange(1500))
        finally:
            stop.set()
            thread.join(5)
    assert torch.equal(got, want)
    assert not any(isinstance(m, P.Result) or (isinstance(m, P.Pong) and m.known) for m in stolen)


# ----------------------------------------------------------------------------- defect 12


@pytest.mark.parametrize("pub", [DASH_KEYS[0][0], PLAIN_KEYS[0][0]])
def test_allow_and_revoke_take_keys_exactly_as_shown(
    pub: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = str(tmp_path)
    assert trunk_cli(["allow", pub, "--keys", d, "--name", "ana"]) == 0
    assert trunk_cli(["allow", "--keys", d, pub]) == 0  # flags before the key
    assert capsys.readouterr().out.splitlines() == [f"allowed {pub}", f"already allowed {pub}"]
    assert trunk_cli(["revoke", pub, "--keys", d]) == 0
    assert trunk_cli(["revoke", pub, "--keys", d]) == 2  # gone
    assert trunk_cli(["allow", pub[:-1] + "~", "--keys", d]) == 2  # not Z85
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(ln.startswith("veil-trunk: error: ") for ln in err)


# ----------------------------------------------------------------------------- defect 13


def test_the_encrypted_key_store_names_its_missing_dependency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VEIL_KEYRING", "encrypted")
    monkeypatch.setattr(keys, "_backend", None)
    for name in ("Crypto", "Cryptodome"):  # as on a machine without pycryptodome
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(KeyStoreError) as ei:
        keys.client_keypair()
    msg = str(ei.value)
    assert "pycryptodome" in msg and "veil[encrypted-keys]" in msg
    assert "No module named" not in msg and "set VEIL_KEYRING=encrypted" not in msg


def test_where_keys_are_kept_is_said_truly_for_each_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(keys, "_backend", None)
    said = {}
    for kind in ("", "memory", "file", "encrypted"):
        monkeypatch.setenv("VEIL_KEYRING", kind)
        monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
        said[kind] = keys.storage_description()
    assert "system keyring" in said[""]
    assert "forgotten when Veil exits" in said["memory"]
    assert "plain, unencrypted file" in said["file"] and str(tmp_path) in said["file"]
    assert "password-protected file" in said["encrypted"]
    assert not any("never in plain files" in s for s in said.values())


@pytest.mark.gui
def test_the_settings_dialog_says_where_keys_are(
    qtbot: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from PySide6.QtWidgets import QLabel

    from app.core.settings import Settings
    from app.views.settings_dialog import SettingsDialog

    monkeypatch.setenv("VEIL_KEYRING", "file")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(keys, "_backend", None)
    dlg = SettingsDialog(Settings())
    qtbot.addWidget(dlg)
    texts = " ".join(w.text() for w in dlg.findChildren(QLabel))
    assert "plain, unencrypted file" in texts and "never in plain files" not in texts
