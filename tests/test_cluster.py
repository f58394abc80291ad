"""Trunk replicas on Ray behind the gateway (``veil-trunk serve --ray``).

The placement policy, the internal wire and the CLI checks are pure and fast. The rest runs a real
local Ray runtime (2 CPUs, no dashboard, its temp dir under pytest's) shared by the module, one
gateway with 2 CPU replicas of a tiny model, real CURVE sockets and real clients: sessions spread
over both replicas and give the same tokens as a single-process server; another connection cannot
touch a session on either replica; a replica killed mid-generation costs its clients one replay
(same text) and comes back into rotation. Ray start-up and replica loading take seconds on two
cores, so those tests are ``slow``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.utils.z85

import engine.speculative as spec
from engine import protocol as P
from engine.drafts import DraftTree
from engine.generate import Prefill, generate
from engine.local_server import free_port
from engine.sampling import SamplingParams
from engine.split import ClientModel, SplitRunner, load_client
from engine.transport import RemoteTrunk, connect_trunk
from remote.cluster import wire
from remote.cluster.options import ClusterOptions
from remote.cluster.placement import Load, add_counts, choose_replica, slot_bytes_for
from remote.server import ServerOptions, TrunkServer
from tests.raw_zmtp import RawClient
from tests.tiny import make_model

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47]
GREEDY = SamplingParams(max_new_tokens=16)
FAST = {"timeout_s": 1.0, "heartbeat_s": 0.2, "reconnect_s": 60.0}


def fixed_keypair(seed: int) -> tuple[str, str]:
    """(public, secret) z85 CURVE keys derived from ``seed`` (the same every run)."""
    secret = zmq.utils.z85.encode(bytes((seed * 37 + j * 11) % 256 for j in range(32)))
    return zmq.curve_public(secret).decode(), secret.decode()


SERVER_KEYS = fixed_keypair(11)
CLIENT_KEYS = fixed_keypair(12)
OTHER_KEYS = fixed_keypair(13)  # a second allowed user


# ----------------------------------------------------------------------------- pure parts


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("cluster") / "llama6"
    make_model(f, "llama", seed=3, n_layers=6)
    return f


def test_placement_least_loaded_then_fewest_sessions_then_lowest_index() -> None:
    mb = 1 << 20
    loads = [Load(0, True, 1, 4 * mb), Load(1, True, 3, 2 * mb), Load(2, True, 2, 2 * mb)]
    assert choose_replica(loads, mb, 8, 16 * mb) == (2, "")  # most free memory, fewer sessions
    tie = [Load(0, True, 0, 0), Load(1, True, 0, 0)]
    assert choose_replica(tie, mb, 8, 16 * mb) == (0, "")
    # a full or not-ready replica is skipped; busy only when none can take it
    loads = [Load(0, True, 2, 0), Load(1, False, 0, 0), Load(2, True, 0, 15 * mb)]
    assert choose_replica(loads, mb, 2, 16 * mb) == (2, "")
    assert choose_replica(loads, 2 * mb, 2, 16 * mb)[0] is None
    index, why = choose_replica([Load(0, True, 2, 0), Load(1, True, 2, 0)], mb, 2, 16 * mb)
    assert index is None and "4 sessions open (2 per replica, 2 ready)" in why
    index, why = choose_replica([Load(0, False, 0, 0)], mb, 2, 16 * mb)
    assert index is None and "no trunk replica is ready" in why


def test_slot_bytes_match_the_worker(folder: Path) -> None:
    from engine.loading import WeightReader, load_config
    from remote.stages import load_stages, split_layers
    from remote.worker import TrunkWorker

    cfg = load_config(folder)
    cpu = torch.device("cpu")
    stages = load_stages(
        WeightReader(folder), cfg, split_layers(1, 5, [cpu, cpu], [1, 3]), torch.float32
    )
    # only the fields slot_bytes reads (constructing a worker compiles its kernels: seconds)
    w = object.__new__(TrunkWorker)
    w.config, w.stages, w.dtype = cfg, stages, torch.float32
    ranges = [(s.lo, s.hi) for s in stages]
    for start, end in ((1, 5), (1, 2), (2, 5), (3, 4)):
        assert slot_bytes_for(cfg, torch.float32, ranges, start, end) == w.slot_bytes(start, end)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_wire_round_trip(dtype: torch.dtype) -> None:
    h = torch.randn(5, 16, generator=torch.Generator().manual_seed(1)).to(dtype)  # [B, H]
    m = wire.parse(
        wire.step_msg("s1", 7, [3, 4, 4, 5, 6], [-1, 0, 0, 1, 3], [0, 2], h, False, dtype)
    )
    assert m.kind == wire.STEP and m.tensor is not None and torch.equal(m.tensor, h)
    assert m.header["pos"] == [3, 4, 4, 5, 6] and m.header["keep"] == [0, 2]
    assert m.header["want"] is False and m.header["out"] == P.dtype_name(dtype)
    d = wire.parse(wire.done_msg("inc", "s1", 7, h, 1.5, 12, None))
    assert d.kind == wire.DONE and d.tensor is not None and torch.equal(d.tensor, h)
    assert "load" not in d.header  # a replica from before the load report
    e = wire.parse(wire.done_msg("inc", "s1", 8, None, 0.0, 0, ("internal", "boom")))
    assert e.tensor is None and e.header["err"] == ["internal", "boom"]
    load = P.Load(2.0, 1.5, 0.5, 20.0)
    d = wire.parse(wire.done_msg("inc", "s1", 9, None, 1.0, 3, None, load))
    assert wire.parse_load(d.header["load"]) == load  # what the gateway's reply carries on
    assert wire.parse_load([1.0, float("nan"), 0.5, 2.0]) is None  # a bad one is dropped
    assert wire.parse_load(None) is None
    with pytest.raises(wire.WireError):
        wire.parse([b"x", b"\x80"])


def test_counters_add_up_across_replicas() -> None:
    total: dict[str, Any] = {}
    add_counts(total, {"steps": 3, "batches": 2, "busy_s": 0.5, "batch_rows_hist": {"4": 2}})
    add_counts(total, {"steps": 1, "batches": 1, "busy_s": 0.25, "batch_rows_hist": {"4": 1}})
    add_counts(total, {})  # a replica that has not answered yet
    assert total["steps"] == 4 and total["batches"] == 3 and total["busy_s"] == 0.75
    assert total["batch_rows_hist"] == {"4": 3}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "2"], "--replicas and --gpus-per-replica need --ray"),
        (["--ray", "--replicas", "0"], "--replicas must be between 1 and 64"),
        (["--ray", "--cpus-per-replica", "-1"], "cannot be negative"),
    ],
)
def test_bad_cluster_flags_are_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from remote.cli import main

    assert main(["serve", "--model", "nowhere", "--insecure", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0]


# ----------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def ray_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One local Ray runtime for the module: 2 CPUs, no dashboard, temp files under pytest's."""
    import ray

    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # no token file in the home directory
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        namespace="veil-test",
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def _serve(srv: TrunkServer) -> threading.Thread:
    t = threading.Thread(target=srv.serve, name="test-trunk", daemon=True)
    t.start()
    assert srv.ready.wait(30), "the server did not start"
    return t


def _options(folder: Path) -> ServerOptions:
    # the tests' clients share one key: the per-key cap must not be what limits them
    return ServerOptions(
        model=str(folder), bind=f"tcp://127.0.0.1:{free_port()}", max_sessions_per_client=8
    )


def _allowed(key: str) -> bool:
    return key in (CLIENT_KEYS[0], OTHER_KEYS[0])


@pytest.fixture(scope="module")
def gateway(folder: Path, ray_runtime: None) -> Iterator[Any]:
    from remote.cluster.gateway import GatewayServer

    gw = GatewayServer(
        _options(folder),
        ClusterOptions(replicas=2, cpus_per_replica=1, ready_timeout_s=180),
        secret_key=SERVER_KEYS[1].encode(),
        public_key=SERVER_KEYS[0].encode(),
        allowed=_allowed,
    )
    t = _serve(gw)
    try:
        yield gw
    finally:
        gw.stop()
        t.join(30)


@pytest.fixture(scope="module")
def reference(folder: Path) -> dict[str, list[int]]:
    """Greedy tokens per decoder through a single-process server (CURVE, same keys)."""
    srv = TrunkServer(
        _options(folder),
        secret_key=SERVER_KEYS[1].encode(),
        public_key=SERVER_KEYS[0].encode(),
        allowed=_allowed,
    )
    t = _serve(srv)
    try:
        client = load_client(str(folder), 1)
        with _connect(srv.address, client) as trunk:
            runner = SplitRunner(client, trunk)
            ref = {d: _generate(runner, d).token_ids for d in DECODERS}
            ref["pipelined"] = _generate(runner, "pipelined", text=ref["sequential"]).token_ids
            ref["blocks"] = _generate(runner, "blocks").token_ids
            return ref
    finally:
        srv.stop()
        t.join(30)


DECODERS = ("sequential", "speculative")
# the four clients of _run_four; "pipelined": rounds in flight on every drafted round;
# "blocks": sequential, the prompt read in 3-row blocks, several in flight (as the app reads)
CLIENT_DECODERS = ("sequential", "speculative", "blocks", "pipelined")


class _Oracle:
    """Drafts the next ``len(text) - len(context)`` tokens of ``text`` as one chain (a random
    model's own context gives the usual drafters nothing to go on): with 4 nodes sent a round,
    the bet on its outcome is right, and round r+1 always goes while round r is in flight."""

    needs_all_logits = False

    def __init__(self, text: list[int]) -> None:
        self.text = text

    def propose(self, context: Any, budget: int) -> DraftTree:
        tree = DraftTree()
        n = len(context)
        if list(context) == self.text[:n]:
            for i, t in enumerate(self.text[n : n + budget]):
                tree.add(t, i - 1, 0.9)
        return tree

    def observe(self, verified: Any) -> None:
        pass

    def reset(self) -> None:
        pass


def _generate(runner: SplitRunner, decoder: str, on_text: Any = None, text: Any = None) -> Any:
    if decoder == "blocks":
        pf = Prefill(3)
        return generate(runner, PROMPT, GREEDY, decoder="sequential", on_text=on_text, prefill=pf)
    if decoder != "pipelined":
        return generate(runner, PROMPT, GREEDY, decoder=decoder, on_text=on_text)
    opts = spec.SpecOptions(fixed_budget=4, pipeline="always")
    oracle = _Oracle([*PROMPT, *text]) if text is not None else None
    return spec.generate_speculative(
        runner,
        PROMPT,
        GREEDY,
        on_text=on_text,
        options=opts,
        drafter=oracle,  # type: ignore[arg-type]
    )


def _connect(address: str, client: ClientModel, keys: tuple[str, str] = CLIENT_KEYS) -> RemoteTrunk:
    return connect_trunk(
        address,
        client,
        server_key=SERVER_KEYS[0],
        client_keys=keys,
        wire_dtype="float32",
        **FAST,  # type: ignore[arg-type]
    )


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _run_four(
    gw: Any, folder: Path, at_first_token: Any, reference: dict[str, list[int]]
) -> tuple[dict[int, list[int]], dict[int, dict[str, Any]], dict[int, int]]:
    """Four clients generating at once (CLIENT_DECODERS). When every one has its first token
    (so all four sessions are open), ``at_first_token(sessions)`` runs, then they go on.
    Returns tokens, json stats and the replica each session was on at that moment."""
    n = 4
    clients = [load_client(str(folder), 1) for _ in range(n)]
    trunks = [_connect(gw.address, c) for c in clients]
    barrier = threading.Barrier(n + 1, timeout=120)
    go = threading.Event()
    tokens: dict[int, list[int]] = {}
    stats: dict[int, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        seen = [False]

        def on_text(delta: str) -> None:
            if not seen[0]:
                seen[0] = True
                barrier.wait()
                assert go.wait(120)

        try:
            runner = SplitRunner(clients[i], trunks[i])
            res = _generate(runner, CLIENT_DECODERS[i], on_text, reference["sequential"])
            tokens[i] = res.token_ids
            stats[i] = trunks[i].json_stats()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    try:
        barrier.wait()
        where = {i: gw.router.replica_of(trunks[i].session or "") for i in range(n)}
        at_first_token(where)
    finally:
        go.set()
        for t in threads:
            t.join(180)
        for tr in trunks:
            tr.close()
    assert not errors, errors
    return tokens, stats, where


@pytest.mark.slow
def test_sessions_spread_over_replicas_and_match_one_server(
    gateway: Any, folder: Path, reference: dict[str, list[int]], tmp_path: Path
) -> None:
    seen: dict[str, Any] = {}

    def check(where: dict[int, int]) -> None:
        seen["stats"] = gateway.public_stats()

    tokens, stats, where = _run_four(gateway, folder, check, reference)
    assert sorted(where.values()) == [0, 0, 1, 1], where  # two sessions on each replica
    assert seen["stats"]["replica_sessions"] == [2, 2]
    assert seen["stats"]["replica_state"] == ["up", "up"]
    for i in range(4):
        assert tokens[i] == reference[CLIENT_DECODERS[i]], i
        assert stats[i]["replays"] == 0
    assert stats[3]["overlapped_steps"] > 0  # the pipelined client had two steps in flight
    assert stats[2]["overlapped_steps"] >= 2  # and the blocks of a prompt went 3 at a time
    assert reference["pipelined"] == reference["sequential"]
    # both replicas computed steps; the merged counters are their sum
    st = gateway.public_stats()
    assert all(s > 0 for s in st["replica_steps"]) and st["steps"] == sum(st["replica_steps"])
    # a client key reads only its own counters, merged from the replicas (issue 29)
    mine, other = gateway.stats_for(CLIENT_KEYS[0]), gateway.stats_for(OTHER_KEYS[0])
    assert mine["scope"] == "own" and mine["steps"] > 0
    assert mine["steps"] == sum(mine["replica_steps"]) and sum(mine["replica_opened"]) >= 4
    assert other["steps"] == 0 and other["replica_steps"] == [0, 0] and other["sessions"] == 0
    assert other["batch_rows_hist"] == {} and other["replica_state"] == ["up", "up"]
    # `veil-trunk status` shows the replicas through the same encrypted front
    from remote.cli import main

    keys = tmp_path / "client.json"
    keys.write_text(json.dumps({"public": CLIENT_KEYS[0], "secret": CLIENT_KEYS[1]}))
    args = ["--server", gateway.address, "--server-key", SERVER_KEYS[0], "--client-keys"]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", *args, str(keys)]) == 0
    text = out.getvalue()
    assert "replicas: 2 of 2 up" in text and "#0" in text and "#1" in text


@pytest.mark.slow
def test_another_key_cannot_touch_a_session_on_any_replica(
    gateway: Any, folder: Path, reference: dict[str, list[int]]
) -> None:
    client_a = load_client(str(folder), 1)
    client_a2 = load_client(str(folder), 1)
    h = torch.zeros(1, client_a.config.hidden_size)  # [B, H]
    with _connect(gateway.address, client_a) as a1, _connect(gateway.address, client_a2) as a2:
        runners = [SplitRunner(client_a, a1), SplitRunner(client_a2, a2)]
        for r in runners:
            r.reset()
            r.forward(PROMPT[:4], range(4))
        sids = [a1.session or "", a2.session or ""]
        assert sorted(gateway.router.replica_of(s) for s in sids) == [0, 1]
        ctx = zmq.Context()
        try:
            for keys in (OTHER_KEYS,):  # another user (the same key may: a reconnect)
                b = ctx.socket(zmq.DEALER)
                b.setsockopt(zmq.LINGER, 0)
                b.curve_serverkey = SERVER_KEYS[0].encode()
                b.curve_publickey, b.curve_secretkey = keys[0].encode(), keys[1].encode()
                b.connect(gateway.address)
                for sid, trunk in zip(sids, (a1, a2), strict=True):
                    for msg in (
                        P.Step(sid, trunk.step_id + 1, [4], None, None, "float32", h),
                        P.Step(sid, 0, [0], None, None, "float32", h),
                        P.Close(sid),
                    ):
                        b.send_multipart(P.encode(msg))
                        assert b.poll(10000), "no answer from the gateway"
                        r = P.decode(b.recv_multipart())
                        assert isinstance(r, P.Error) and r.code == P.E_UNKNOWN_SESSION
                    b.send_multipart(P.encode(P.Ping(5, sid)))
                    assert b.poll(10000)
                    pong = P.decode(b.recv_multipart())
                    assert isinstance(pong, P.Pong) and not pong.known and pong.last_step == -1
                b.close(0)
        finally:
            ctx.term()
        # A's sessions are untouched: their generations still match one server's
        for r, trunk in zip(runners, (a1, a2), strict=True):
            assert generate(r, PROMPT, GREEDY).token_ids == reference["sequential"]
            assert trunk.replays == 0


@pytest.mark.slow
def test_the_gateway_cuts_off_a_message_that_never_ends(gateway: Any, folder: Path) -> None:
    """The gateway is the server's socket code: an allowed key's multipart message that never
    ends is cut off past the largest valid message, and the gateway goes on serving."""
    w = RawClient(gateway.address, SERVER_KEYS[0], CLIENT_KEYS)
    pushed = 0
    with pytest.raises(ConnectionResetError):
        while pushed < 64 << 20:  # the largest valid message here is ~1 MiB
            wire_bytes = w.frame(bytes(256 << 10), more=True)
            w.send(wire_bytes)
            pushed += len(wire_bytes)
    w.close()
    with _connect(gateway.address, load_client(str(folder), 1)) as trunk:
        assert trunk.forward(torch.zeros(2, trunk.hidden_size), torch.arange(2)).shape == (2, 64)


@pytest.mark.slow
def test_killed_replica_costs_its_clients_one_replay_and_comes_back(
    gateway: Any, folder: Path, reference: dict[str, list[int]]
) -> None:
    import ray

    victim = gateway.router.replicas[0]
    before = victim.incarnation

    def kill(where: dict[int, int]) -> None:
        # the clients go on at once: a next step may reach the dead replica before the gateway
        # knows (answered when Ray fails the watch call) or after (answered at once)
        ray.kill(victim.handle, no_restart=False)  # Ray restarts it (max_restarts=-1)

    tokens, stats, where = _run_four(gateway, folder, kill, reference)
    hit = [i for i, r in where.items() if r == 0]
    assert len(hit) == 2
    for i in range(4):
        assert tokens[i] == reference[CLIENT_DECODERS[i]], i  # the same text, killed or not
        if i in hit:
            assert stats[i]["replays"] >= 1 and stats[i]["replayed_steps"] >= 1
        else:
            assert stats[i]["replays"] == 0
    # Ray restarts it; the gateway takes it back once it answers, under a new incarnation
    _wait(lambda: victim.state == "up", 120, "the replica did not come back")
    assert victim.incarnation != before and victim.losses == 1
    client = load_client(str(folder), 1)
    with _connect(gateway.address, client) as trunk:
        runner = SplitRunner(client, trunk)
        runner.reset()
        runner.forward(PROMPT[:4], range(4))
        # both replicas empty: the tie goes to replica 0, the one that came back
        assert gateway.router.replica_of(trunk.session or "") == 0
        assert generate(runner, PROMPT, GREEDY).token_ids == reference["sequential"]
        assert trunk.replays == 0
    assert gateway.public_stats()["replica_lost"] == [1, 0]


@pytest.mark.slow
def test_a_replica_ray_gave_up_on_is_replaced(
    gateway: Any, folder: Path, reference: dict[str, list[int]]
) -> None:
    import ray

    victim = gateway.router.replicas[1]
    old = victim.handle
    ray.kill(old)  # no_restart: Ray will not bring this actor back
    _wait(lambda: victim.handle is not old, 60, "the gateway did not replace the dead replica")
    _wait(lambda: victim.state == "up", 120, "the new replica did not come up")
    assert gateway.public_stats()["replica_lost"][1] == 1
    client = load_client(str(folder), 1)
    with _connect(gateway.address, client) as trunk:
        runner = SplitRunner(client, trunk)
        assert generate(runner, PROMPT, GREEDY).token_ids == reference["sequential"]


@pytest.mark.slow
def test_loadtest_reports_sessions_per_replica(gateway: Any) -> None:
    from remote.loadtest import LoadOptions, Target, run_load

    _wait(lambda: gateway.public_stats()["sessions"] == 0, 10, "sessions left open")
    target = Target(gateway.address, SERVER_KEYS[0], CLIENT_KEYS, "")
    opts = LoadOptions(clients=[2], block_rows=[4], steps=3, think_ms=0.0, prompt_rows=8)
    report = run_load([target], opts)
    assert report["server"]["replicas"] == 2
    assert report["runs"][0]["replica_sessions"] == [1, 1] and report["runs"][0]["errors"] == 0


@pytest.mark.slow
def test_a_keyed_trunk_behind_the_gateway_gives_the_plain_models_tokens(
    folder: Path, ray_runtime: None, reference: dict[str, list[int]], tmp_path: Path
) -> None:
    """``serve --ray --keyed-trunk``: a gateway with one replica running the keyed layers
    announces the key id; a client with the organisation key gets the plain model's tokens
    through it, one without is refused. The replica reserves no CPU, so it starts beside the
    module's gateway on the two-CPU runtime."""
    import dataclasses

    from engine.keyed.transform import KeyedError
    from engine.keyed.trunk import prepare_keyed_trunk
    from remote.cluster.gateway import GatewayServer
    from tests.keyed_support import KEY

    keyed = tmp_path / "keyed"
    prepare_keyed_trunk(str(folder), KEY, 1, keyed)
    gw = GatewayServer(
        dataclasses.replace(_options(folder), keyed_trunk=str(keyed)),
        ClusterOptions(replicas=1, cpus_per_replica=0, threads=1, ready_timeout_s=180),
        secret_key=SERVER_KEYS[1].encode(),
        public_key=SERVER_KEYS[0].encode(),
        allowed=_allowed,
    )
    t = _serve(gw)
    try:
        assert gw.public_stats()["key_id"] == KEY.key_id
        client = load_client(str(folder), 1, org_key=KEY)
        with _connect(gw.address, client) as trunk:
            assert trunk.key_id == KEY.key_id
            got = generate(SplitRunner(client, trunk), PROMPT, GREEDY).token_ids
            assert gw.router.replica_of(trunk.session or "") == 0
        assert got == reference["sequential"]
        with pytest.raises(KeyedError, match="add your organisation's key"):
            _connect(gw.address, load_client(str(folder), 1))
    finally:
        gw.stop()
        t.join(30)


def test_replica_core_serves_the_wire_without_ray(folder: Path) -> None:
    """The replica side alone (no Ray): open, a step, reset, and a step of a forgotten session,
    through its CURVE inbox, answered on a PUSH to a stand-in gateway."""
    from remote.cluster.replica import ReplicaCore, ReplicaSpec

    gw_pub, gw_sec = fixed_keypair(21)
    ctx = zmq.Context()
    results = ctx.socket(zmq.PULL)
    results.curve_server = True
    results.curve_publickey, results.curve_secretkey = gw_pub.encode(), gw_sec.encode()
    port = results.bind_to_random_port("tcp://127.0.0.1")
    core = ReplicaCore(
        ReplicaSpec(model=str(folder)), "127.0.0.1", f"tcp://127.0.0.1:{port}", gw_pub
    )
    out = ctx.socket(zmq.PUSH)
    out.curve_serverkey = core.public_key.encode()
    out.curve_publickey, out.curve_secretkey = gw_pub.encode(), gw_sec.encode()
    out.connect(core.address)
    stranger = ctx.socket(zmq.PUSH)  # any other key is refused by the inbox's ZAP handler
    pub, sec = fixed_keypair(22)
    stranger.curve_serverkey = core.public_key.encode()
    stranger.curve_publickey, stranger.curve_secretkey = pub.encode(), sec.encode()
    stranger.connect(core.address)
    try:
        info = core.info()
        assert info["layers"] == [1, 5] and info["stages"] == [[1, 5]]
        h = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))  # [B, H]

        def step(sid: str, k: int) -> wire.Message:
            frames = wire.step_msg(sid, k, [0, 1, 2], None, None, h, True, torch.float32)
            out.send_multipart(frames)
            assert results.poll(30000), "no answer from the replica"
            return wire.parse(results.recv_multipart())

        stranger.send_multipart(wire.open_msg("x", 1, 5, 64))
        out.send_multipart(wire.open_msg("a", 1, 5, 64))
        d = step("a", 0)
        assert d.header["inc"] == core.incarnation and d.header["err"] is None
        assert len(d.header["load"]) == 4  # the replica's load travels to the gateway
        assert d.tensor is not None and d.tensor.shape == (3, 64)
        assert core.open_sids == {"a"}  # the stranger's open never arrived
        out.send_multipart(wire.reset_msg())
        d = step("a", 1)
        assert d.header["err"][0] == P.E_UNKNOWN_SESSION and core.open_sids == set()
    finally:
        core.stop()
        ctx.destroy(0)
