"""The real ``veil-trunk serve`` against the failures of issue 17: prompts over 4,096 tokens,
revocation of a connected client, allow-list reloads, per-key session caps, the idle rule and
session takeover by another key or connection. One server with an allow-list file (keys that
start with '-' included), shared by the module."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from engine import protocol as P
from engine.errors import AuthError
from engine.generate import generate
from engine.sampling import SamplingParams
from engine.split import ClientModel, SplitRunner, load_client, load_trunk
from engine.transport.policy import PREFILL_CHUNK
from remote.allowlist import AllowList
from remote.cli import main as trunk_cli
from tests.fake_trunk import hidden
from tests.fixed_keys import DASH_KEYS, PLAIN_KEYS
from tests.hardening_support import KeyedServer, make_tiny_8k


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_8k(tmp_path_factory.mktemp("tiny") / "llama8k")


@pytest.fixture(scope="module")
def client(tiny: Path) -> ClientModel:
    return load_client(str(tiny), 1)


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
