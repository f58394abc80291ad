"""An organisation-keyed trunk end to end: `veil-trunk keyed-model prepare`, a real (in-process)
trunk server running the keyed layers, and clients with and without the organisation key."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import engine.speculative as spec
from app.cli import main as veil
from engine import protocol as P
from engine.drafts.head import DraftHead, DraftHeadNet, HeadShape, save_head
from engine.drafts.learned import HeadDraft
from engine.drafts.select import client_fingerprint, load_for_client
from engine.errors import SplitError
from engine.generate import available_decoders, generate
from engine.keyed.transform import KeyedError, OrgKey
from engine.keyed.trunk import (
    INFO_FILE,
    layer_file,
    load_keyed_trunk,
    prepare_keyed_trunk,
    public_model_fp,
    read_info,
)
from engine.loading import WeightReader, load_config
from engine.model import layer_tensor_names
from engine.sampling import SamplingParams
from engine.split import ClientModel, SplitRunner, load_client, load_trunk
from engine.transport import connect_trunk
from engine.transport.remote import RemoteTrunk
from remote.cli import main as trunk_cli
from remote.server import ServerOptions, TrunkServer
from tests.fake_trunk import FakeTrunk
from tests.inproc_trunk import CLIENT_KEYS, SERVER_KEYS, trunk_in_thread
from tests.keyed_support import KEY, PROMPT, keyed_trunk, tiny_model
from tests.spec_support import assert_same_head_cache, chain_verified
from tests.tiny import make_model

OTHER = OrgKey(bytes(range(1, 33)))
GREEDY = SamplingParams(max_new_tokens=12)
LONG = SamplingParams(max_new_tokens=24)  # long enough for drafted rounds to be accepted


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory, "keyed")


@pytest.fixture(scope="module")
def keyed_dir(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return keyed_trunk(folder, tmp_path_factory, "keyed-out")


@pytest.fixture(scope="module")
def server(folder: Path, keyed_dir: Path) -> Iterator[TrunkServer]:
    with trunk_in_thread(folder, keyed_trunk=str(keyed_dir), max_sessions_per_client=4) as srv:
        yield srv


def connect(srv: TrunkServer, client: ClientModel, **kw: object) -> RemoteTrunk:
    return connect_trunk(
        srv.address,
        client,
        server_key=SERVER_KEYS[0],
        client_keys=CLIENT_KEYS,
        wire_dtype="float32",
        connect_timeout_s=5.0,
        **kw,  # type: ignore[arg-type]
    )


def plain_runner(folder: Path, k: int) -> SplitRunner:
    """The public model split at ``k``, its trunk in this process."""
    client = load_client(str(folder), k)
    start, end = client.plan.trunk_range
    return SplitRunner(client, load_trunk(client.resolved, start, end))


def plain_tokens(
    folder: Path, k: int, decoder: str = "sequential", prompt: list[int] = PROMPT
) -> list[int]:
    return generate(plain_runner(folder, k), prompt, GREEDY, decoder=decoder).token_ids


# ----------------------------------------------------------------------------- the folder


def test_prepare_writes_checkpoint_tensors_and_a_description(folder: Path, keyed_dir: Path) -> None:
    info = read_info(keyed_dir)
    cfg = load_config(folder)
    assert (info.start, info.end, info.noise, info.key_id) == (1, 5, 0.0, KEY.key_id)
    assert info.config_fp == cfg.fingerprint()
    assert info.model_fp == public_model_fp(WeightReader(folder))
    d = json.loads((keyed_dir / INFO_FILE).read_text())
    assert d["format"] == 1 and d["trunk_fp"] == info.trunk_fp
    with safe_open(str(keyed_dir / layer_file(3)), framework="pt") as sf:
        assert set(sf.keys()) == set(layer_tensor_names(cfg, 3))
        assert torch.all(sf.get_tensor("model.layers.3.input_layernorm.weight") == 1)
        keyed_up = sf.get_tensor("model.layers.3.mlp.up_proj.weight")
    names = set(WeightReader(keyed_dir).names())
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert not any(n.startswith(("model.layers.0.", "model.layers.5.")) for n in names)
    assert "model.embed_tokens.weight" not in names
    assert sorted(p.name for p in keyed_dir.glob("*.safetensors")) == [
        layer_file(i) for i in range(1, 5)
    ]
    plain_up = WeightReader(folder).read(["model.layers.3.mlp.up_proj.weight"])
    assert not torch.allclose(keyed_up, plain_up["model.layers.3.mlp.up_proj.weight"], atol=1e-3)


def test_prepare_refuses_bad_input_in_one_line(
    tiny_models: dict[str, Path], folder: Path, keyed_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(KeyedError, match="already exists and is not empty"):
        prepare_keyed_trunk(str(folder), KEY, 1, keyed_dir)
    with pytest.raises(KeyedError, match="between 1 and 2 for this model"):
        prepare_keyed_trunk(str(folder), KEY, 3, tmp_path / "a")
    with pytest.raises(KeyedError, match="not available for this model family"):
        prepare_keyed_trunk(str(tiny_models["gemma3"]), KEY, 1, tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ----------------------------------------------------------------------------- equality


def test_the_keyed_split_through_the_server_gives_the_plain_models_tokens(
    server: TrunkServer, folder: Path
) -> None:
    client = load_client(str(folder), 1, org_key=KEY)
    with connect(server, client) as trunk:
        assert trunk.key_id == KEY.key_id  # the server announced its key id
        runner = SplitRunner(client, trunk)
        for dec in sorted(available_decoders()):  # speculative == sequential inside the split
            got = generate(runner, PROMPT, GREEDY, decoder=dec).token_ids
            assert got == plain_tokens(folder, 1, dec), dec
    assert server.public_stats()["key_id"] == KEY.key_id
    from remote.status import format_status

    assert f"keyed to organisation key {KEY.key_id}" in format_status(server.public_stats(), "x")


def test_a_client_keeping_more_layers_runs_a_sub_range_of_the_keyed_trunk(
    server: TrunkServer, folder: Path
) -> None:
    client = load_client(str(folder), 2, org_key=KEY)
    with connect(server, client) as trunk:
        assert (trunk.start, trunk.end) == (2, 4)
        got = generate(SplitRunner(client, trunk), PROMPT, GREEDY).token_ids
    assert got == plain_tokens(folder, 2)


def test_inside_the_keyed_model_speculative_and_pipelined_equal_sequential(
    server: TrunkServer, folder: Path
) -> None:
    """Against the keyed trunk, every decoder gives exactly the keyed split's own sequential
    tokens, greedy and sampled (the same seed): with the cost model's choices, and with fixed
    trees and rounds always in flight, so drafted trees really are verified by keyed layers."""
    sampled = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=20, seed=5)
    fixed = spec.SpecOptions(fixed_budget=8, pipeline="always")
    client = load_client(str(folder), 1, org_key=KEY)
    with connect(server, client) as trunk:
        runner = SplitRunner(client, trunk)
        for params in (LONG, sampled):
            want = generate(runner, PROMPT, params).token_ids
            for dec in sorted(available_decoders()):
                assert generate(runner, PROMPT, params, decoder=dec).token_ids == want, dec
            spec.forget(runner)  # fixed trees from a drafter that has learned nothing yet
            got = spec.generate_speculative(runner, PROMPT, params, options=fixed)
            assert got.token_ids == want, params
            if params is LONG:  # drafted tokens were accepted, rounds went while one was out
                st = got.stats
                assert st.tree_nodes_sent > st.new_tokens and max(st.accepted_hist) > 1
                assert st.pipelined_rounds > 0 and st.round_trips < len(want)


def hold_until_shared(srv: TrunkServer, mp: pytest.MonkeyPatch) -> list[set[str]]:
    """From now until it has planned a batch with two sessions' steps in it, ``srv``'s worker
    plans only once two sessions have a step waiting (waiting on its own condition, so steps
    still arrive meanwhile; 30 s at most). Returns the sessions of each shared batch planned."""
    w: Any = srv.worker
    plan = w._plan
    shared: list[set[str]] = []

    def waiting() -> int:
        return sum(1 for s in w._sessions.values() if s.queue and not s.busy and not s.closed)

    def _plan() -> Any:  # called under w._cond
        deadline = time.monotonic() + 30
        while not shared and waiting() < 2 and time.monotonic() < deadline:
            w._cond.wait(0.05)
        b = plan()
        sids = {t.job.sid for t in b.tasks} if b is not None else set()
        if len(sids) > 1:
            shared.append(sids)
        return b

    mp.setattr(w, "_plan", _plan)
    return shared


def test_two_keyed_sessions_share_batches_and_each_gets_the_plain_models_tokens(
    server: TrunkServer, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two keyed clients (k = 1 and k = 2: trunk [1, 5) and its sub-range [2, 4)) generate at
    the same time through one keyed server, one sequential and one speculative. Until their
    work has shared a batch the worker waits for both (``hold_until_shared``), so that they
    share one does not depend on timing."""
    prompts = [PROMPT, [1, 50, 9, 9, 60, 61, 62, 63, 64, 7]]
    decoders = ["sequential", "speculative"]
    shared = hold_until_shared(server, monkeypatch)
    before = server.worker.stats()["shared_batches"]
    out: list[list[int]] = [[], []]
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(i: int) -> None:
        try:
            client = load_client(str(folder), 1 + i, org_key=KEY)
            with connect(server, client) as trunk:
                start.wait(30)  # both sessions open before either steps
                runner = SplitRunner(client, trunk)
                out[i] = generate(runner, prompts[i], GREEDY, decoder=decoders[i]).token_ids
        except BaseException as exc:
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert shared and len(shared[0]) == 2  # one batch held both sessions' steps
    assert server.worker.stats()["shared_batches"] > before
    for i in range(2):
        assert out[i] == plain_tokens(folder, 1 + i, prompt=prompts[i]), i


def test_a_learned_draft_head_drafts_for_a_keyed_client(
    server: TrunkServer, folder: Path, tmp_path: Path
) -> None:
    """A draft head file made for the public model fits the keyed client (the same model
    fingerprint) and drafts through the keyed server: the tokens stay the keyed split's
    sequential tokens, nodes the head drafted were verified, and what the head read is the
    plain-basis features (its cache equals the one the public model's features give). A random
    head (fixed seed), so nothing depends on training; GenerationStats counts no drafts per
    source, the drafter's calibration does (as in test_draft_head)."""
    public = plain_runner(folder, 1)
    net = DraftHeadNet(HeadShape.for_model(public.client.config))
    net.reset_parameters(torch.Generator().manual_seed(5))
    with torch.no_grad():  # a bigger residual branch than the init, so rows differ visibly
        net.wo.mul_(10)
        net.wdown.mul_(10)
    net.requires_grad_(False)
    cf, wf = client_fingerprint(public.client)
    made = DraftHead(net, "tiny", cf, wf, public.client.tap_layers(), None)
    path = save_head(made, tmp_path / "head.safetensors")
    client = load_client(str(folder), 1, org_key=KEY)
    head = load_for_client(path, client)  # refused if the keyed client's fingerprint differed
    with connect(server, client) as trunk:
        runner = SplitRunner(client, trunk)
        want = generate(runner, PROMPT, LONG).token_ids
        spec.use_draft_head(runner, head)
        assert spec.draft_head_of(runner) is head
        opts = spec.SpecOptions(fixed_budget=16)
        got = spec.generate_speculative(runner, PROMPT, LONG, options=opts)
    assert got.token_ids == want
    state = spec.runner_state(runner)
    drafted = sum(
        n for (name, _), (_, n) in state.drafter.calibrator.stats.items() if name == "head"
    )
    assert drafted > 0 and got.stats.tree_nodes_sent > got.stats.new_tokens
    src = state.head
    assert src is not None
    text = [*PROMPT, *got.token_ids]
    n = src.cache.length  # rows for every position before the last root
    assert n > len(PROMPT)  # it observed the prompt and the rounds after it
    states = public.forward_states(text[:n], range(n))
    fresh = HeadDraft(head, public.client)
    fresh.observe(chain_verified(text, n, states, public.client))
    assert fresh.cache.length == n
    assert_same_head_cache(src, fresh, n)


def test_what_the_server_receives_is_not_the_head_output(server: TrunkServer, folder: Path) -> None:
    client = load_client(str(folder), 1, org_key=KEY)
    sent: list[torch.Tensor] = []
    with connect(server, client) as trunk:
        inner = trunk._entries  # every block becomes protocol steps here, before the wire

        def spy(hidden, positions, parents=None, keep=None):  # type: ignore[no-untyped-def]
            sent.append(hidden.clone())
            return inner(hidden, positions, parents, keep)

        trunk._entries = spy  # type: ignore[method-assign]
        runner = SplitRunner(client, trunk)
        states = runner.forward_states(PROMPT, list(range(len(PROMPT))))
    assert len(sent) == 1
    h = states.head  # [B, H]: the plain head output, kept for draft heads
    assert (sent[0] - h).abs().max() > 0.1
    # the same lengths (a rotation), but no coordinate of what travels is a head coordinate
    torch.testing.assert_close(sent[0].norm(dim=-1), h.norm(dim=-1), atol=1e-4, rtol=1e-4)
    # the trunk state the client keeps is in the plain basis: the plain trunk's answer
    plain = load_trunk(client.resolved, 1, 5).forward(h, torch.arange(len(PROMPT)))
    torch.testing.assert_close(states.trunk, plain, atol=1e-4, rtol=1e-4)


def test_a_keyed_trunk_in_this_process_needs_the_key(folder: Path, keyed_dir: Path) -> None:
    cfg = load_config(folder)
    fp = public_model_fp(WeightReader(folder))
    trunk = load_keyed_trunk(keyed_dir, cfg, fp, 1, 5)
    client = load_client(str(folder), 1, org_key=KEY)
    got = generate(SplitRunner(client, trunk), PROMPT, GREEDY).token_ids
    assert got == plain_tokens(folder, 1)
    with pytest.raises(KeyedError, match="add your organisation's key"):
        SplitRunner(load_client(str(folder), 1), trunk)
    with pytest.raises(KeyedError, match=f"this computer's key is {OTHER.key_id}"):
        SplitRunner(load_client(str(folder), 1, org_key=OTHER), trunk)


# ----------------------------------------------------------------------------- refusals


def test_a_client_without_the_key_or_with_another_is_refused_in_one_line(
    server: TrunkServer, folder: Path
) -> None:
    msg = f"keyed to an organisation key \\(id {KEY.key_id}\\): add your organisation's key"
    with pytest.raises(KeyedError, match=msg):
        connect(server, load_client(str(folder), 1))
    with pytest.raises(KeyedError) as e:
        connect(server, load_client(str(folder), 1, org_key=OTHER))
    assert KEY.key_id in str(e.value) and OTHER.key_id in str(e.value)
    assert "\n" not in str(e.value)


def test_a_keyed_client_and_a_plain_server_refuse_each_other(folder: Path) -> None:
    client = load_client(str(folder), 1, org_key=KEY)
    with trunk_in_thread(folder) as plain, pytest.raises(KeyedError) as e:
        connect(plain, client)
    assert KEY.key_id in str(e.value) and "public model" in str(e.value)
    # a server from before keyed models ignores the key: the client checks the answer itself
    with FakeTrunk("echo") as old, pytest.raises(KeyedError, match="runs the public model"):
        connect_trunk(
            old.address,
            client,
            server_key=old.public_key,
            client_keys=CLIENT_KEYS,
            connect_timeout_s=5.0,
        )


def test_a_k_outside_the_keyed_range_is_refused(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "k2"
    prepare_keyed_trunk(str(folder), KEY, 2, out)
    with trunk_in_thread(folder, keyed_trunk=str(out)) as srv:
        assert srv.public_stats()["layers"] == [2, 4]
        with pytest.raises(SplitError, match="keep more layers on this computer"):
            connect(srv, load_client(str(folder), 1, org_key=KEY))


def test_a_keyed_trunk_for_another_model_or_a_damaged_one_is_refused(
    tiny_models: dict[str, Path], folder: Path, keyed_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    make_model(other, "llama", seed=4, n_layers=6)  # same config, other weights
    with pytest.raises(KeyedError, match="prepared for another model"):
        TrunkServer(ServerOptions(model=str(other), insecure=True, keyed_trunk=str(keyed_dir)))
    with pytest.raises(KeyedError, match="not a keyed trunk folder"):
        TrunkServer(ServerOptions(model=str(folder), insecure=True, keyed_trunk=str(tmp_path)))
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(keyed_dir, bad)
    torn = bad / layer_file(2)
    with safe_open(str(torn), framework="pt") as sf:
        t = {n: sf.get_tensor(n) for n in sf.keys()}  # noqa: SIM118
    t["model.layers.2.mlp.up_proj.weight"][0, 0] += 1.0  # a changed first row
    from safetensors.torch import save_file

    save_file(t, str(torn))
    with pytest.raises(KeyedError, match="is damaged: its weights do not match"):
        TrunkServer(ServerOptions(model=str(folder), insecure=True, keyed_trunk=str(bad)))


def test_open_and_opened_carry_the_key_id() -> None:
    o = P.Open("c", "w", 1, 5, "float32", 64, 128, None, "0123456789abcdef")
    assert P.decode(P.encode(o)) == o
    r = P.Opened("sid", 1, 5, 128, "float32", "0123456789abcdef")
    assert P.decode(P.encode(r)) == r
    assert P.decode(P.encode(P.Opened("sid", 1, 5, 128, "float32"))).key_id is None  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- command lines


def test_trunk_cli_new_key_prepare_serve_errors_are_one_line(
    tiny_models: dict[str, Path],
    folder: Path,
    keyed_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    key = tmp_path / "org.key"
    assert trunk_cli(["keyed-model", "new-key", "--out", str(key)]) == 0
    assert key.stat().st_mode & 0o777 == 0o600
    key_id = OrgKey.load(key).key_id
    assert key_id in capsys.readouterr().out
    out = tmp_path / "t"
    argv = ["keyed-model", "prepare", "--model", str(folder), "--org-key", str(key)]
    assert trunk_cli([*argv, "--local-layers", "1", "--out", str(out)]) == 0
    assert read_info(out).key_id == key_id and "keyed to" in capsys.readouterr().out
    bad = tmp_path / "bad.key"
    bad.write_text("hello")
    gemma = ["keyed-model", "prepare", "--model", str(tiny_models["gemma3"])]
    cases = [
        (["keyed-model", "new-key", "--out", str(key)], "already exists"),
        ([*argv, "--local-layers", "1", "--out", str(out)], "not empty"),
        ([*argv, "--local-layers", "9", "--out", str(tmp_path / "u")], "between 1 and 2"),
        (
            [*gemma, "--org-key", str(key), "--local-layers", "1", "--out", str(tmp_path / "g")],
            "not available for this model family",
        ),
        (
            [
                "keyed-model",
                "prepare",
                "--model",
                str(folder),
                "--org-key",
                str(tmp_path / "no"),
                "--local-layers",
                "1",
                "--out",
                str(tmp_path / "v"),
            ],
            "cannot read the organisation key",
        ),
        (
            [
                "keyed-model",
                "prepare",
                "--model",
                str(folder),
                "--org-key",
                str(bad),
                "--local-layers",
                "1",
                "--out",
                str(tmp_path / "w"),
            ],
            "not a Veil organisation key",
        ),
        (
            [
                "serve",
                "--model",
                str(tiny_models["llama"]),
                "--insecure",
                "--keyed-trunk",
                str(keyed_dir),
            ],
            "prepared for another model",
        ),
    ]
    for args, msg in cases:
        assert trunk_cli(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert msg in err and err.count("\n") == 0 and "Traceback" not in err, err


def test_veil_generate_with_the_org_key_through_a_keyed_server(
    folder: Path, keyed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "org.key"
    KEY.save(key)
    base = ["generate", "--model", str(folder), "--local-layers", "1", "--prompt", "hello"]
    base += ["--max-new-tokens", "6", "--json", "--decoder", "sequential", "--dtype", "float32"]
    assert veil(base) == 0  # fully local: the public model
    want = json.loads(capsys.readouterr().out)["text"]
    with trunk_in_thread(folder, insecure=True, keyed_trunk=str(keyed_dir)) as srv:
        remote = [*base, "--server", srv.address, "--insecure"]
        assert veil([*remote, "--org-key", str(key)]) == 0
        assert json.loads(capsys.readouterr().out)["text"] == want
        assert veil(remote) == 2
        errors = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
        assert len(errors) == 1 and "add your organisation's key" in errors[0], errors


def test_a_ray_replica_loads_the_keyed_layers(folder: Path, tmp_path: Path) -> None:
    """``--ray``: the gateway passes the folder on, and each replica runs the keyed layers (the
    replica side alone, without Ray: its CURVE inbox and a stand-in gateway)."""
    import zmq

    pytest.importorskip("ray")  # the optional veil[cluster] extra
    from remote.cluster import wire
    from remote.cluster.gateway import replica_spec
    from remote.cluster.options import ClusterOptions
    from remote.cluster.replica import ReplicaCore
    from tests.inproc_trunk import fixed_keypair

    out = tmp_path / "k2"
    prepare_keyed_trunk(str(folder), KEY, 2, out)
    opts = ServerOptions(model=str(folder), keyed_trunk=str(out))
    spec = replica_spec(opts, ClusterOptions(), 128)
    assert spec.keyed_trunk == str(out)
    gw_pub, gw_sec = fixed_keypair(21)
    ctx = zmq.Context()
    results = ctx.socket(zmq.PULL)
    results.curve_server = True
    results.curve_publickey, results.curve_secretkey = gw_pub.encode(), gw_sec.encode()
    port = results.bind_to_random_port("tcp://127.0.0.1")
    core = ReplicaCore(spec, "127.0.0.1", f"tcp://127.0.0.1:{port}", gw_pub)
    push = ctx.socket(zmq.PUSH)
    push.curve_serverkey = core.public_key.encode()
    push.curve_publickey, push.curve_secretkey = gw_pub.encode(), gw_sec.encode()
    push.connect(core.address)
    try:
        assert core.info()["layers"] == [2, 4]
        h = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))  # [B, H]
        push.send_multipart(wire.open_msg("a", 2, 4, 64))
        push.send_multipart(wire.step_msg("a", 0, [0, 1, 2], None, None, h, True, torch.float32))
        assert results.poll(30000), "no answer from the replica"
        d = wire.parse(results.recv_multipart())
        assert d.header["err"] is None and d.tensor is not None
        cfg = load_config(folder)
        ref = load_keyed_trunk(out, cfg, public_model_fp(WeightReader(folder)), 2, 4)
        torch.testing.assert_close(d.tensor.float(), ref.forward(h, torch.arange(3)))
    finally:
        core.stop()
        ctx.destroy(0)


def test_the_part_a_keyed_server_ships_is_public_and_works_with_the_key(
    folder: Path, keyed_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only an invite and the key: the server's client part (public weights, its manifest's
    model fingerprint) gives the client the same rotation as IT's prepare."""
    from engine.session import RunnerOptions, open_runner
    from tests.delivery_support import invite, laptop, shipping_server

    laptop(monkeypatch, tmp_path / "cache")
    key = tmp_path / "org.key"
    KEY.save(key)
    with shipping_server(folder, tmp_path / "parts", keyed_trunk=str(keyed_dir)) as srv:
        opts = RunnerOptions(model=None, server=invite(srv), local_layers=1, org_key=str(key))
        runner = open_runner(opts, None)
        try:
            assert runner.keyed is not None and getattr(runner.trunk, "key_id", None) == KEY.key_id
            got = generate(runner, PROMPT, GREEDY).token_ids
        finally:
            assert runner.trunk is not None
            runner.trunk.close()
    part = opts.fetched
    assert part is not None and part.manifest.k_min == 1
    # the shipped weights are the public model's: the same tensors as the model file
    with safe_open(str(next(part.folder.glob("*.safetensors"))), framework="pt") as sf:
        name = "model.layers.0.mlp.up_proj.weight"
        assert torch.equal(sf.get_tensor(name), WeightReader(folder).read([name])[name])
    assert got == plain_tokens(folder, 1)


def test_veil_bench_measures_the_keyed_split(
    folder: Path, keyed_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine import kernels

    key = tmp_path / "org.key"
    KEY.save(key)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "code", "prompt": "def f(x):"}) + "\n")
    argv = ["bench", "--prompts", str(prompts), "--model", str(folder), "--local-layers", "1"]
    argv += ["--rtt-ms", "0", "--sweep-rtt", "0", "--max-new-tokens", "4", "--threads", "1"]
    argv += ["--kernel-threads", "1", "--out", str(tmp_path / "out")]
    try:
        assert veil([*argv, "--org-key", str(key)]) == 2
        assert "go together" in capsys.readouterr().err
        assert veil([*argv, "--org-key", str(key), "--keyed-trunk", str(keyed_dir)]) == 0
    finally:
        kernels.set_threads(None)  # the bench sets the process-wide kernel threads
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert res["key_id"] == KEY.key_id and res["prompts"][0]["identical"]


def test_a_keyed_trunk_can_be_held_as_int8_on_a_cpu(folder: Path, keyed_dir: Path) -> None:
    cfg = load_config(folder)
    ref = load_keyed_trunk(keyed_dir, cfg, public_model_fp(WeightReader(folder)), 1, 5)
    h = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))  # [B, H]
    want = ref.forward(h, torch.arange(5))
    with trunk_in_thread(folder, keyed_trunk=str(keyed_dir), quant="int8") as srv:
        flt = sum(w.nbytes() for w in ref.stack.layers)  # the same layers as float32
        assert srv.weight_bytes < flt / 2  # quantized at load
        client = load_client(str(folder), 1, org_key=KEY)
        with connect(srv, client) as trunk:
            got = trunk.forward(h, torch.arange(5))
    assert (got - want).norm() / want.norm() < 0.05  # int8 rounding of the keyed weights only


def test_prepare_equals_keying_the_whole_range_noise_included(folder: Path, tmp_path: Path) -> None:
    """Layer by layer on disk is the same as ``key_layers`` over [K, L-K) (the noise drawn from
    the key per layer), so IT's folder and the audit's keyed model agree."""
    from engine.keyed.transform import derive, key_layers
    from engine.split import read_layers

    out = tmp_path / "noisy"
    info = prepare_keyed_trunk(str(folder), KEY, 1, out, noise=0.01)
    assert info.noise == 0.01
    cfg = load_config(folder)
    fp = public_model_fp(WeightReader(folder))
    t = derive(KEY, cfg, fp, 1, 5, 0.01)
    want = key_layers(load_trunk(str(folder), 1, 5, quant="none").stack.layers, cfg, t, KEY, fp)
    got = read_layers(WeightReader(out), cfg, range(1, 5), torch.float32, "cpu")
    for j, w in enumerate(want):
        assert torch.equal(w.wqkv, got[1 + j].wqkv) and torch.equal(w.wdown, got[1 + j].wdown)
