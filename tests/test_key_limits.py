"""What one client key may take from a trunk server (issue 29, defects 3, 6, 10 and 11), through a
real batching CURVE server in a thread: keys take turns in the batches and a key's queued rows are
bounded; a closed or vanished client's queued work is dropped, not computed; a re-sent step cannot
fetch more than it sends, nor without limit; a message whose lists disagree with its tensor is
refused before any list is walked, and a key's message checks come out of its own share; and the
statistics a key can read say nothing about other keys' work.

The worker runs a batch only with a token from the test (its ``_run`` waits on a semaphore), and
its ``_plan``/``submit``/``close`` are recorded, so the test decides how far the attacker gets and
every assertion is about which batch ran what — never about time."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from engine import protocol as P
from remote.limits import KeyBuckets
from remote.server import TrunkServer
from remote.status import format_status
from tests.inproc_trunk import CLIENT_KEYS, SERVER_KEYS, fixed_keypair, trunk_in_thread
from tests.tiny import make_model

VICTIM = CLIENT_KEYS
ATTACKER = fixed_keypair(4)
SPY = fixed_keypair(5)
BIG = 4096  # the attack's steps: the protocol's largest


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("keys") / "llama6"
    make_model(f, "llama", seed=8, n_layers=6, max_position_embeddings=8192)
    return f


def dealer(srv: TrunkServer, keys: tuple[str, str]) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_serverkey = SERVER_KEYS[0].encode()
    s.curve_publickey, s.curve_secretkey = (k.encode() for k in keys)
    s.connect(srv.address)
    return s


def recv(s: zmq.Socket, timeout_s: float = 30.0) -> P.Message | None:
    return P.decode(s.recv_multipart()) if s.poll(int(timeout_s * 1000)) else None


def ask(s: zmq.Socket, msg: P.Message) -> P.Message:
    s.send_multipart(P.encode(msg))
    r = recv(s)
    assert r is not None, f"no answer to {type(msg).__name__}"
    return r


def open_session(srv: TrunkServer, s: zmq.Socket) -> str:
    h = srv.config.hidden_size
    r = ask(s, P.Open(srv.config_fp, None, 1, 5, "float32", h, 8192))
    assert isinstance(r, P.Opened), r
    return r.session


def rows(srv: TrunkServer, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, srv.config.hidden_size, generator=g)  # [n, H]


class Recorder:
    """The worker's batches as planned ((session, step) -> rows), when each job was queued and
    each session closed (in batches planned before), and the tokens its batches wait for."""

    def __init__(self, srv: TrunkServer, mp: pytest.MonkeyPatch) -> None:
        w: Any = srv.worker
        self.tokens = threading.Semaphore(0)
        self.planned: list[dict[tuple[str, int], int]] = []
        self.queued: dict[tuple[str, int], int] = {}
        self.closed: dict[str, int] = {}
        plan, submit_many, close, run = w._plan, w.submit_many, w.close, w._run

        def _plan() -> Any:
            b = plan()
            if b is not None:
                self.planned.append({(t.job.sid, t.job.step): t.rows for t in b.tasks})
            return b

        def _submit_many(jobs: Any) -> None:
            with w._cond:  # the planning lock: nothing is planned in between
                for j in jobs:
                    self.queued[(j.sid, j.step)] = len(self.planned)
                submit_many(jobs)

        def _close(sid: str) -> None:
            with w._cond:
                self.closed[sid] = len(self.planned)
                close(sid)

        def _run(batch: Any) -> None:
            assert self.tokens.acquire(timeout=60), "the test gave the worker no token"
            run(batch)

        mp.setattr(w, "_plan", _plan)
        mp.setattr(w, "submit_many", _submit_many)
        mp.setattr(w, "close", _close)
        mp.setattr(w, "_run", _run)

    def wait_queued(self, sid: str, step: int) -> None:
        deadline = time.monotonic() + 30
        while (sid, step) not in self.queued:
            assert time.monotonic() < deadline, f"step {step} of {sid[:8]} never reached the worker"
            time.sleep(0.01)

    def batch_of(self, sid: str, step: int) -> int:
        """Index of the (last) batch that ran a chunk of this step."""
        return max(i for i, b in enumerate(self.planned) if (sid, step) in b)

    def rows_after(self, sid: str, index: int) -> int:
        """Rows of session ``sid`` in batches planned from ``index`` on."""
        return sum(r for b in self.planned[index:] for (s, _), r in b.items() if s == sid)


def wait_for(
    s: zmq.Socket,
    want: Callable[[P.Message], bool],
    keep_alive: Callable[[], None],
    timeout_s: float = 60.0,
) -> P.Message | None:
    """The first message on ``s`` that ``want`` accepts (None: none came), pinging
    (``keep_alive``) meanwhile as a waiting client does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        keep_alive()
        r = recv(s, 0.2)
        if r is not None and want(r):
            return r
    return None


@pytest.fixture
def attacked(folder: Path) -> Iterator[TrunkServer]:
    with trunk_in_thread(
        folder,
        allow=(VICTIM[0], ATTACKER[0]),
        max_batch_rows=64,
        prefill_chunk=64,
        max_sessions_per_client=2,
        silent_s=5.0,
    ) as srv:
        yield srv


def test_one_key_cannot_starve_another_and_its_work_ends_when_it_leaves(
    attacked: TrunkServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 3, scaled to a tiny model: an attacker key with two sessions queueing 4,096-row
    steps (keep=[], again and again) against a victim key's short steps."""
    srv = attacked
    rec = Recorder(srv, monkeypatch)
    v = dealer(srv, VICTIM)
    a = [dealer(srv, ATTACKER), dealer(srv, ATTACKER)]
    vid = open_session(srv, v)
    aid = [open_session(srv, s) for s in a]
    x = rows(srv, BIG)
    # everything the attacker tries is decided before anything runs (the worker has no token)
    for s, sid in zip(a, aid, strict=True):
        s.send_multipart(P.encode(P.Step(sid, 0, list(range(BIG)), None, None, "float32", x)))
        rec.wait_queued(sid, 0)
    for s, sid in zip(a, aid, strict=True):
        s.send_multipart(P.encode(P.Step(sid, 1, list(range(BIG)), None, [], "float32", x)))
    refusals = [recv(s) for s in a]
    for r in refusals:  # 2 x 4,096 rows queued: the key's limit (one full step per session)
        assert isinstance(r, P.Error) and r.code == P.E_BUSY and r.step == 1, r
        assert "per-client limit is 8192" in r.message
    alive = [True, True]

    def pings() -> None:  # as waiting clients do: the victim, and the attacker while it stays
        v.send_multipart(P.encode(P.Ping(1, vid)))
        for i, s in enumerate(a):
            if alive[i]:
                s.send_multipart(P.encode(P.Ping(1, aid[i])))
                while s.poll(0):
                    s.recv_multipart()

    base = 0
    for k in range(6):  # an 8-row prefill, then five one-row steps
        n = 8 if k == 0 else 1
        step = P.Step(vid, k, list(range(base, base + n)), None, None, "float32", rows(srv, n, k))
        base += n
        v.send_multipart(P.encode(step))
        rec.wait_queued(vid, k)
        # one token for the attacker's batch that is waiting, one for the next batch: the
        # victim's step must be in it (it waits for at most the batch that was running)
        rec.tokens.release(2)
        done = lambda m, k=k: isinstance(m, P.Result) and m.step == k  # noqa: E731
        r = wait_for(v, done, pings, 20.0)
        if r is None:  # not in that batch: let the worker run, to show where it went
            rec.tokens.release(10_000)
            r = wait_for(v, done, pings)
        assert isinstance(r, P.Result) and r.hidden is not None and r.hidden.shape[0] == n
        assert rec.batch_of(vid, k) == rec.queued[(vid, k)], (k, rec.planned[-8:])
    assert sum(1 for b in rec.planned if any(s in aid for s, _ in b)) >= 6  # it did compete

    # the attacker closes one session and vanishes with the other (no close, no more pings)
    a[0].send_multipart(P.encode(P.Close(aid[0])))
    assert wait_for(a[0], lambda m: isinstance(m, P.Closed), lambda: None) is not None
    alive[0] = False
    a[1].close(0)
    alive[1] = False
    deadline = time.monotonic() + 30
    while aid[1] in srv.sessions and time.monotonic() < deadline:
        v.send_multipart(P.encode(P.Ping(1, vid)))
        time.sleep(0.1)
    assert aid[1] not in srv.sessions, "a silent client's session with queued work was kept"
    rec.tokens.release(10_000)  # the worker may run whatever is left: nothing of the attacker
    ask(v, P.Close(vid))
    for sid in aid:
        assert rec.rows_after(sid, rec.closed[sid]) == 0
        assert sum(r for b in rec.planned for (s, _), r in b.items() if s == sid) < BIG
    for s in (v, a[0]):
        s.close(0)


def test_a_resent_step_fetches_no_more_than_it_sends_nor_without_limit(
    folder: Path,
) -> None:
    """Defect 6: 1-row re-sends of an answered 1,024-row step, then many full-size re-sends."""
    with trunk_in_thread(folder) as srv:
        s = dealer(srv, VICTIM)
        sid = open_session(srv, s)
        x = rows(srv, 1024)
        step = P.Step(sid, 0, list(range(1024)), None, None, "float32", x)
        first = ask(s, step)
        assert isinstance(first, P.Result) and first.hidden is not None
        reply = sum(len(f) for f in P.encode(first))
        # the client's own retry (the same message) gets the cached reply
        again = ask(s, step)
        assert isinstance(again, P.Result) and torch.equal(again.hidden, first.hidden)
        # a small message cannot fetch the big reply
        tiny = P.Step(sid, 0, [0], None, None, "float32", x[:1])
        r = ask(s, tiny)
        assert isinstance(r, P.Error) and r.code == P.E_SHAPE and r.step == 0, r
        # and full-size re-sends get replies only within the key's budget
        t0 = time.monotonic()
        for _ in range(40):
            s.send_multipart(P.encode(step))
        got = 0
        while (m := recv(s, 2.0)) is not None:
            got += sum(len(f) for f in P.encode(m))
        elapsed = time.monotonic() - t0
        bucket = srv.limits.resends
        assert got <= bucket.capacity + bucket.rate * elapsed + reply, (got, 40 * reply)
        assert got < 40 * reply / 2
        s.close(0)


def test_lists_that_disagree_with_the_tensor_are_refused_before_they_are_walked(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 10: 4,096-entry positions, parents and keep with a one-row tensor."""

    def walked(*args: object) -> None:
        raise AssertionError("a list was walked before its size was checked")

    with trunk_in_thread(folder) as srv:
        s = dealer(srv, VICTIM)
        sid = open_session(srv, s)
        long = list(range(BIG))
        for name in ("check_ints", "check_block", "check_keep"):
            monkeypatch.setattr(P, name, walked, raising=False)
        for positions, parents, code in (
            (long, long, P.E_SHAPE),  # 4,096 positions for one row
            ([0], long, P.E_BAD_MESSAGE),  # 4,096 parents for one node
        ):
            s.send_multipart(
                P.encode(P.Step(sid, 0, positions, parents, long, "float32", rows(srv, 1)))
            )
            r = recv(s)
            assert isinstance(r, P.Error) and r.code == code, r
        monkeypatch.undo()
        ask(s, P.Close(sid))
        s.close(0)


def test_a_key_over_its_share_of_message_checks_is_not_read_others_are(folder: Path) -> None:
    """Defect 10: checking a key's messages is charged to that key."""
    with trunk_in_thread(folder, allow=(VICTIM[0], ATTACKER[0])) as srv:
        srv.limits.checks = KeyBuckets(1e-9, 1e-9)  # any message puts a key in debt for ages
        a, v = dealer(srv, ATTACKER), dealer(srv, VICTIM)
        assert isinstance(ask(a, P.Ping(1)), P.Pong)  # read, and charged
        a.send_multipart(P.encode(P.Ping(2)))
        assert recv(a, 1.0) is None  # in debt: not read
        assert isinstance(ask(v, P.Ping(3)), P.Pong)  # another key is
        a.close(0)
        v.close(0)


def test_a_key_reads_only_its_own_statistics(folder: Path) -> None:
    """Defect 11: a spy key asks for statistics while another key sends a 37-row prompt."""
    with trunk_in_thread(folder, allow=(VICTIM[0], SPY[0]), prefill_chunk=64) as srv:
        v, spy, admin = dealer(srv, VICTIM), dealer(srv, SPY), dealer(srv, SERVER_KEYS)
        sid = open_session(srv, v)
        r = ask(v, P.Step(sid, 0, list(range(37)), None, None, "float32", rows(srv, 37)))
        assert isinstance(r, P.Result)

        def stats(s: zmq.Socket) -> dict[str, Any]:
            pong = ask(s, P.Ping(1, stats=True))
            assert isinstance(pong, P.Pong) and pong.stats is not None
            return P.check_stats(pong.stats)

        seen = stats(spy)
        assert "37" not in repr(seen)
        assert seen["scope"] == "own" and seen["sessions"] == 0 and seen["steps"] == 0
        assert seen["batch_rows_hist"] == {} and seen["busy_s"] == 0
        assert seen["model"] == srv.model_label and seen["max_batch_rows"] == 256  # settings
        mine = stats(v)  # the victim sees its own work
        assert mine["batch_rows_hist"] == {"37": 1} and mine["sessions"] == 1
        everyone = stats(admin)  # the server's own key: the admin's view
        assert everyone["scope"] == "all" and everyone["batch_rows_hist"] == {"37": 1}
        assert everyone["sessions"] == 1
        ask(v, P.Close(sid))
        for s in (v, spy, admin):
            s.close(0)


def test_status_shows_a_client_key_its_own_work_and_the_admin_everyones(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`veil-trunk status`: a client key's own view; the server's key folder, everyone's."""
    from remote.cli import main

    keydir = tmp_path / "keys"  # the server's --keys folder, as `veil-trunk keygen` writes it
    keydir.mkdir(mode=0o700)
    secret = keydir / "server.key_secret"
    secret.write_text(f"public-key = {SERVER_KEYS[0]}\nsecret-key = {SERVER_KEYS[1]}\n")
    secret.chmod(0o600)
    spy = tmp_path / "spy.json"
    spy.write_text(f'{{"public": "{SPY[0]}", "secret": "{SPY[1]}"}}')
    with trunk_in_thread(folder, allow=(VICTIM[0], SPY[0])) as srv:
        v = dealer(srv, VICTIM)
        sid = open_session(srv, v)
        assert isinstance(
            ask(v, P.Step(sid, 0, [0, 1, 2], None, None, "float32", rows(srv, 3))), P.Result
        )
        base = ["status", "--server", srv.address, "--json", "--client-keys"]
        assert main([*base, str(spy), "--server-key", SERVER_KEYS[0]]) == 0
        own = json.loads(capsys.readouterr().out)
        assert main([*base, str(keydir)]) == 0  # the server's key: no --server-key needed
        everyone = json.loads(capsys.readouterr().out)
        ask(v, P.Close(sid))
        v.close(0)
    assert own["scope"] == "own" and own["sessions"] == 0 and own["steps"] == 0
    assert everyone["scope"] == "all" and everyone["sessions"] == 1 and everyone["steps"] == 1
    text = format_status(own, "x")
    assert "by this key" in text and "--client-keys" in text
    assert "by this key" not in format_status(everyone, "x")
