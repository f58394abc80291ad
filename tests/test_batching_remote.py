"""Batching through a real CURVE server: concurrent clients get their solo tokens, device stages
change nothing, and limits and failures stay with the session that hit them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from engine import protocol as P
from engine.generate import generate
from engine.sampling import SamplingParams
from engine.split import ClientModel, SplitRunner, load_client
from engine.transport import RemoteTrunk, connect_trunk
from remote.server import TrunkServer
from tests.inproc_trunk import CLIENT_KEYS, SERVER_KEYS, trunk_in_thread
from tests.tiny import make_model

GREEDY = SamplingParams(max_new_tokens=12)
PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 9, 9, 60, 61, 62, 63, 64, 7], [1, 7], [1, 99, 98, 97]]
DECODERS = ["sequential", "speculative", "sequential", "speculative"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("batch-remote") / "qwen6"
    make_model(f, "qwen2", seed=6, n_layers=6)  # q/k/v biases take the batched path too
    return f


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[TrunkServer]:
    with trunk_in_thread(folder, max_sessions=8, max_sessions_per_client=8) as srv:
        yield srv


def connect(srv: TrunkServer, client: ClientModel, **kw: object) -> RemoteTrunk:
    return connect_trunk(
        srv.address,
        client,
        server_key=SERVER_KEYS[0],
        client_keys=CLIENT_KEYS,
        **kw,  # type: ignore[arg-type]
    )


def tokens(client: ClientModel, trunk: RemoteTrunk, i: int) -> list[int]:
    runner = SplitRunner(client, trunk)
    return generate(runner, PROMPTS[i], GREEDY, decoder=DECODERS[i]).token_ids


def concurrent_tokens(srv: TrunkServer, clients: list[ClientModel]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in clients]
    errors: list[BaseException] = []
    start = threading.Barrier(len(clients))

    def run(i: int) -> None:
        try:
            with connect(srv, clients[i]) as trunk:
                start.wait(30)
                out[i] = tokens(clients[i], trunk, i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    return out


def test_four_concurrent_clients_get_their_solo_tokens(server: TrunkServer, folder: Path) -> None:
    # clients with different splits: k = 1 uses trunk [1, 5), k = 2 uses [2, 4)
    clients = [load_client(str(folder), 1 + i % 2) for i in range(4)]
    solo = []
    for i, c in enumerate(clients):
        with connect(server, c) as trunk:
            solo.append(tokens(c, trunk, i))
    before = server.worker.stats()["shared_batches"]
    together = concurrent_tokens(server, clients)
    assert together == solo
    assert all(len(t) > 3 for t in solo)
    assert server.worker.stats()["shared_batches"] > before  # they did share batches


def test_each_reply_reports_the_trunks_load(server: TrunkServer, folder: Path) -> None:
    """Issue 32: a Result carries the worker's aggregate load, and the client keeps the latest
    (the speculative cost model reads it; the concurrent test above runs with it on)."""
    client = load_client(str(folder), 1)
    with connect(server, client) as trunk:
        assert trunk.load is None  # nothing heard yet
        tokens(client, trunk, 0)
        load = trunk.load
        assert isinstance(load, P.Load)
        assert load.peers >= 0.0 and load.row_ms > 0.0 and 0.0 <= load.busy <= 1.0
        assert trunk.json_stats()["trunk_load"] == {
            "peers": load.peers,
            "row_ms": load.row_ms,
            "busy": load.busy,
            "fixed_ms": load.fixed_ms,
        }
    assert server.worker.load.batches > 0


def test_device_stages_equal_one_device(folder: Path, server: TrunkServer) -> None:
    client = load_client(str(folder), 1)
    with connect(server, client, wire_dtype="float32") as trunk:
        want = tokens(client, trunk, 1)
    with trunk_in_thread(folder, devices="cpu,cpu", stage_layers=[1, 3]) as split:
        assert split.public_stats()["stages"] == ["cpu:1-2", "cpu:2-5"]
        with connect(split, client, wire_dtype="float32") as trunk:
            assert tokens(client, trunk, 1) == want


def raw(srv: TrunkServer) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.curve_serverkey = SERVER_KEYS[0].encode()
    s.curve_publickey, s.curve_secretkey = (k.encode() for k in CLIENT_KEYS)
    s.connect(srv.address)
    return s


def ask(s: zmq.Socket, msg: P.Message) -> P.Message:
    s.send_multipart(P.encode(msg))
    assert s.poll(30_000), "no reply"
    return P.decode(s.recv_multipart())


def test_refused_and_closed_sessions_leave_the_others_correct(server: TrunkServer) -> None:
    """While three sessions step together, a fourth overflows its context (refused before it
    can enter a batch) and a fifth is closed with its long step in flight."""
    h = server.config.hidden_size
    fp = server.config_fp
    g = torch.Generator().manual_seed(3)
    blocks = [torch.randn(n, h, generator=g) for n in (5, 9, 3)]
    socks = [raw(server) for _ in range(5)]
    sids = []
    for i, s in enumerate(socks):
        r = ask(s, P.Open(fp, None, 1, 5, "float32", h, 16 if i == 3 else 512))
        assert isinstance(r, P.Opened)
        sids.append(r.session)

    def step(i: int, k: int, x: torch.Tensor, first: int) -> P.Step:
        return P.Step(sids[i], k, list(range(first, first + x.shape[0])), None, None, "float32", x)

    def results() -> list[torch.Tensor]:
        out = []
        for i in range(3):
            r0 = ask(socks[i], step(i, 0, blocks[i], 0))
            r1 = ask(socks[i], step(i, 1, blocks[i][:2], blocks[i].shape[0]))
            assert isinstance(r0, P.Result) and isinstance(r1, P.Result), (r0, r1)
            assert r0.hidden is not None and r1.hidden is not None
            out += [r0.hidden.clone(), r1.hidden.clone()]
        return out

    alone = results()  # each session alone (one at a time)
    for i in range(3):
        ask(socks[i], P.Close(sids[i]))
        r = ask(socks[i], P.Open(fp, None, 1, 5, "float32", h, 512))
        assert isinstance(r, P.Opened)
        sids[i] = r.session
    # now all at once: steps of 0-2, an overflow from 3, a long step from 4 then its close
    for i in range(3):
        socks[i].send_multipart(P.encode(step(i, 0, blocks[i], 0)))
    socks[3].send_multipart(P.encode(step(3, 0, torch.randn(20, h), 0)))
    socks[4].send_multipart(P.encode(step(4, 0, torch.randn(400, h), 0)))
    socks[4].send_multipart(P.encode(P.Close(sids[4])))
    got = []
    for i in range(3):
        assert socks[i].poll(30_000)
        r0 = P.decode(socks[i].recv_multipart())
        r1 = ask(socks[i], step(i, 1, blocks[i][:2], blocks[i].shape[0]))
        assert isinstance(r0, P.Result) and isinstance(r1, P.Result)
        assert r0.hidden is not None and r1.hidden is not None
        got += [r0.hidden, r1.hidden]
    overflow = P.decode(socks[3].recv_multipart()) if socks[3].poll(30_000) else None
    assert isinstance(overflow, P.Error) and overflow.code == P.E_CONTEXT
    answers = []
    while socks[4].poll(2000):
        answers.append(P.decode(socks[4].recv_multipart()))
    assert any(isinstance(a, P.Closed) for a in answers)  # the close is answered at once
    assert all(isinstance(a, P.Closed | P.Result | P.Error) for a in answers)
    for x, y in zip(got, alone, strict=True):
        assert torch.equal(x, y)
    for i in (0, 1, 2, 3):
        ask(socks[i], P.Close(sids[i]))
    for s in socks:
        s.close(0)
    assert server.public_stats()["sessions"] == 0


def test_stats_ping_reports_the_batching_settings(folder: Path) -> None:
    with trunk_in_thread(folder, batching=False, max_batch_rows=64) as srv:
        s = raw(srv)
        pong = ask(s, P.Ping(7, stats=True))
        s.close(0)
    assert isinstance(pong, P.Pong) and pong.stats is not None
    st = pong.stats
    assert st["batching"] is False and st["max_batch_rows"] == 64
    assert st["prefill_chunk"] == P.MAX_BLOCK  # no chunks without batching
    assert st["layers"] == [1, 5] and st["hidden_size"] == srv.config.hidden_size
    assert P.check_stats(st) == st
