"""Model delivery (issue 35): a laptop with only an invite gets exactly its part of the model
from the trunk server, checked against a signed manifest, resumable and cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from engine import protocol as P
from engine.delivery import manifest as M
from engine.delivery.client import fetch_server_part
from engine.delivery.part import ST_WEIGHTS, client_tensor_names
from engine.errors import Cancelled, FingerprintMismatch, SplitError
from engine.generate import generate
from engine.loading import WeightReader, load_config
from engine.sampling import SamplingParams
from engine.session import RunnerOptions, open_runner
from engine.split import SplitRunner, load_client, load_trunk
from tests.delivery_support import OTHER_SEED, invite, laptop, shipping_server
from tests.tiny import make_model

SMALL_CHUNK = 64 * 1024  # several chunks per weights file of the tiny model


@pytest.fixture(scope="module")
def model6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("m6") / "tiny6"
    make_model(folder, "llama", seed=3, n_layers=6)
    return folder


@pytest.fixture(scope="module")
def other6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("o6") / "tiny6b"
    make_model(folder, "llama", seed=4, n_layers=6)
    return folder


def greedy(runner: SplitRunner, n: int = 12) -> list[int]:
    return generate(runner, [1, 5, 9, 13], SamplingParams(max_new_tokens=n)).token_ids


def test_only_an_invite_fetches_exactly_the_client_part_and_chats_like_a_local_model(
    model6: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    laptop(monkeypatch, tmp_path / "cache")
    with shipping_server(model6, tmp_path / "parts") as srv:
        opts = RunnerOptions(model=None, server=invite(srv), local_layers=2)
        runner = open_runner(opts, None)
        try:
            got = greedy(runner)
        finally:
            assert runner.trunk is not None
            runner.trunk.close()
    part = opts.fetched
    assert part is not None and part.fetched_bytes == part.manifest.total_bytes
    local = load_client(str(model6), 2)
    want = greedy(SplitRunner(local, load_trunk(str(model6), 2, 4)))
    assert got == want
    # exactly the tensors k=2 needs: embedding, layers 0, 1, 4, 5, norm, LM head; no trunk
    config = load_config(model6)
    needed = client_tensor_names(config, 2, WeightReader(model6).has)
    with safe_open(str(part.folder / ST_WEIGHTS), framework="pt") as sf:
        shipped = sorted(sf.keys())
    assert shipped == sorted(needed) == sorted(part.manifest.tensors)
    assert not any(n.startswith(("model.layers.2.", "model.layers.3.")) for n in shipped)
    # the bytes on the wire: the needed tensors (float32 here) plus the small text files
    need = sum(WeightReader(model6).read([n])[n].numel() * 4 for n in needed)
    text = sum(f.size for f in part.manifest.files if f.name != ST_WEIGHTS)
    assert need < part.fetched_bytes <= need + text + 64 * 1024
    assert text < 64 * 1024
    assert part.manifest.model == "tiny6"  # a name, never the server's path


def test_cache_is_used_again_and_a_model_change_is_fetched(
    model6: Path, other6: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    laptop(monkeypatch, tmp_path / "cache")
    with shipping_server(model6, tmp_path / "parts") as srv:
        code, port = invite(srv), int(srv.address.rsplit(":", 1)[1])
        first = fetch_server_part(code)
        again = fetch_server_part(code)
        assert srv.delivery is not None and srv.delivery.stats["chunks"] == len(
            [c for f in first.manifest.files for c in f.chunks]
        )
    assert first.fetched_bytes > 0 and again.fetched_bytes == 0
    assert again.folder == first.folder
    # the admin switches the server to another model: same address, same keys
    with shipping_server(other6, tmp_path / "parts", port=port):
        changed = fetch_server_part(code)
    assert changed.manifest.part_id != first.manifest.part_id
    assert changed.fetched_bytes > 0
    assert changed.manifest.config_fp == first.manifest.config_fp  # same shape, new weights


def test_an_interrupted_fetch_resumes_from_the_verified_chunks(
    model6: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    laptop(monkeypatch, tmp_path / "cache")

    class Unplugged(Exception):
        pass

    seen: list[float] = []

    def unplug(stage: str, fraction: float) -> None:
        if stage.startswith("downloading"):
            seen.append(fraction)
            if fraction > 0.4:
                raise Unplugged

    with shipping_server(model6, tmp_path / "parts", part_chunk=SMALL_CHUNK) as srv:
        code = invite(srv)
        with pytest.raises(Unplugged):
            fetch_server_part(code, progress=unplug)
        asked: list[int] = []
        resumed = fetch_server_part(code, confirm=lambda m, n: asked.append(n) or True)
    total = resumed.manifest.total_bytes
    assert asked == [total - resumed.reused_bytes]  # the size asked about: what is left
    assert 0.4 * total < resumed.reused_bytes < total
    assert resumed.fetched_bytes == total - resumed.reused_bytes
    for f in resumed.manifest.files:  # every byte is the server's
        assert M.hash_file(resumed.folder / f.name, f.chunk_size)[0] == f.sha256


def test_a_declined_download_fetches_nothing(
    model6: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    laptop(monkeypatch, tmp_path / "cache")
    with shipping_server(model6, tmp_path / "parts") as srv:
        with pytest.raises(Cancelled, match="declined"):
            fetch_server_part(invite(srv), confirm=lambda m, n: False)
        assert srv.delivery is not None and srv.delivery.stats["chunks"] == 0


def test_a_tampered_chunk_is_refused_in_one_line(
    model6: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    laptop(monkeypatch, tmp_path / "cache")
    with shipping_server(model6, tmp_path / "parts") as srv:
        assert srv.delivery is not None
        served = srv.delivery.folder / ST_WEIGHTS
        raw = bytearray(served.read_bytes())
        raw[len(raw) // 2] ^= 0x5A  # the file changes on the server after it was signed
        served.write_bytes(bytes(raw))
        with pytest.raises(M.PartError) as err:
            fetch_server_part(invite(srv))
    msg = str(err.value)
    assert "does not match its signed manifest" in msg and "\n" not in msg
    assert not list((tmp_path / "cache").glob("*/complete"))


def test_a_tampered_or_foreign_manifest_is_refused(
    model6: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    laptop(monkeypatch, tmp_path / "cache")
    with shipping_server(model6, tmp_path / "parts") as srv:
        with pytest.raises(M.PartError, match="not signed by this server's key"):
            fetch_server_part(invite(srv, OTHER_SEED))  # an invite with another signing key
        d = srv.delivery
        assert d is not None
        doc = json.loads(d.raw)
        doc["k_max"] = 1  # changed after signing (its id made to match)
        d.raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        d.part_id = M.part_id(d.raw)
        with pytest.raises(M.PartError, match="not signed by this server's key"):
            fetch_server_part(invite(srv))
        assert d.stats["chunks"] == 0
        no_key = P.make_invite(srv.address, P.parse_invite(invite(srv))[1])  # an old invite
        with pytest.raises(M.PartError, match="no model-signing key"):
            fetch_server_part(no_key)


def test_another_local_model_gets_a_clear_mismatch_line_without_server_paths(
    model6: Path, other6: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    laptop(monkeypatch, tmp_path / "cache")
    other = tmp_path / "other"
    make_model(other, "llama", seed=5, n_layers=6, hidden_size=96)
    with shipping_server(model6, tmp_path / "parts") as srv:
        opts = RunnerOptions(model=str(other), server=invite(srv), local_layers=2)
        with pytest.raises(FingerprintMismatch) as err:
            open_runner(opts, None)
    msg = str(err.value)
    assert str(model6) not in msg and str(model6.parent) not in msg
    assert "tiny6" in msg and "leave out --model" in msg and "\n" not in msg


def test_more_local_layers_than_the_server_ships_is_one_clear_line(
    model6: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    laptop(monkeypatch, tmp_path / "cache")
    with shipping_server(model6, tmp_path / "parts", client_layers=1) as srv:
        opts = RunnerOptions(model=None, server=invite(srv), local_layers=2)
        with pytest.raises(SplitError, match="ships 1 to 1 local layers per side"):
            open_runner(opts, None)


def test_chunk_requests_are_bounded_per_key(model6: Path, tmp_path: Path) -> None:
    from engine.delivery.part import build_part
    from engine.loading import resolve
    from remote.delivery import MAX_PER_KEY, DeliveryService
    from tests.delivery_support import SIGN_SEED

    m = build_part(resolve(str(model6)), 2, tmp_path / "part", chunk_size=4096)
    svc = DeliveryService(tmp_path / "part", m, SIGN_SEED)  # not bound: nothing is served
    try:
        ask = [P.ChunkGet(svc.part_id, 0, 0)] * (MAX_PER_KEY + 1)
        answers = [svc.handle(b"id", "alice", a) for a in ask]
        assert answers[:MAX_PER_KEY] == [None] * MAX_PER_KEY  # queued
        last = answers[-1]
        assert isinstance(last, P.Error) and last.code == P.E_BUSY
        assert svc.handle(b"id2", "bob", ask[0]) is None  # another key still gets its turn
        stale = svc.handle(b"id", "alice", P.ChunkGet("0" * 24, 0, 0))
        assert isinstance(stale, P.Error) and stale.code == P.E_PART
    finally:
        svc.stop()


def test_delivery_messages_round_trip_and_bad_ones_are_refused() -> None:
    msgs: list[P.Message] = [
        P.PartGet(),
        P.Part("a" * 24, b'{"x":1}', b"s" * 64),
        P.ChunkGet("a" * 24, 2, 7),
        P.Chunk("a" * 24, 2, 7, b"data"),
    ]
    for msg in msgs:
        assert P.decode(P.encode(msg)) == msg
    with pytest.raises(P.ProtocolError) as e:
        P.decode([P._header(P.PART_GET, dv=2)])
    assert e.value.code == P.E_VERSION
    bad = [
        P.encode(P.Part("a" * 24, b"{}", b"short")),
        [P._header(P.CHUNK, part_id="a" * 24, file=0, chunk=0), b"x" * (P.MAX_CHUNK + 1)],
        [P._header(P.CHUNK_GET, part_id="a" * 24, file=P.MAX_FILES, chunk=0)],
        [P._header(P.CHUNK, part_id="a" * 24, file=0, chunk=0)],  # no data frame
    ]
    for frames in bad:
        with pytest.raises(P.ProtocolError):
            P.decode(frames)


def test_a_gguf_part_keeps_the_files_blocks_and_loads_like_the_whole_file(tmp_path: Path) -> None:
    """The default model (a GGUF): the part is a GGUF with the same metadata and only the
    client's tensors, their quantized blocks byte for byte; a client loaded from it computes
    exactly what one loaded from the whole file does, and its draft head still fits."""
    import torch

    from engine.delivery.fetch import InstalledPart
    from engine.delivery.part import GGUF_WEIGHTS, build_part, part_json, write_json
    from engine.drafts.select import auto_head
    from engine.loading import DEFAULT_MODEL, resolve
    from engine.quant.gguf import GGUFFile
    from engine.quant.load import gguf_name

    full = resolve(DEFAULT_MODEL)
    m = build_part(full, 2, tmp_path / "part")
    config = load_config(full.folder)
    want = [gguf_name(n) for n in client_tensor_names(config, 2, WeightReader(full.folder).has)]
    src, part = GGUFFile(full.source), GGUFFile(tmp_path / "part" / GGUF_WEIGHTS)
    try:
        assert sorted(part.tensors) == sorted(str(w) for w in want) == sorted(m.tensors)
        assert part.metadata == src.metadata
        for name, info in part.tensors.items():
            assert bytes(part.raw(name).tobytes()) == bytes(src.raw(name).tobytes())
            assert info.kind == src.tensors[name].kind
        trunk = [t for t in src.tensors if t.startswith("blk.") and t not in part.tensors]
        assert len(trunk) > 0.8 * len([t for t in src.tensors if t.startswith("blk.")])
        tensors = sum(t.nbytes for t in part.tensors.values())
        header = part.tensors[min(part.tensors, key=lambda n: part.tensors[n].offset)].offset
        size = (tmp_path / "part" / GGUF_WEIGHTS).stat().st_size
        assert size <= header + tensors + 32 * len(part.tensors)  # (alignment padding)
    finally:
        src.close()
        part.close()
    # installed as a fetch leaves it (the marker that points the GGUF reader at the file)
    folder = tmp_path / "part"
    (folder / "manifest.json").write_bytes(m.encode())
    write_json(
        folder / "veil-converted.json", {"weights": "gguf", "source": str(folder / GGUF_WEIGHTS)}
    )
    write_json(folder / "veil-part.json", part_json(m, folder / GGUF_WEIGHTS))
    installed = InstalledPart(folder, m, 0, 0)
    a, b = load_client(installed.resolved, 2), load_client(DEFAULT_MODEL, 2)
    assert a.client_quant == b.client_quant == "gguf"
    ids = [1, 2, 3, 4, 5]
    with torch.inference_mode():
        la = SplitRunner(a, load_trunk(full, 2, config.n_layers - 2)).forward(ids, range(5))
        lb = SplitRunner(b, load_trunk(full, 2, config.n_layers - 2)).forward(ids, range(5))
    assert torch.equal(la, lb)
    # the model's draft head (Veil ships one for it) fits the part's client too: the part
    # lacks the trunk, so the whole model's fingerprint comes from the signed manifest
    ha, hb = auto_head(a), auto_head(b)
    assert ha is not None and hb is not None and ha.path == hb.path


def test_the_app_engine_fetches_the_new_model_when_the_admin_changes_it(
    model6: Path, other6: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.core.engine_host import CONNECTED, EngineHost
    from app.core.settings import MODE_SERVER, SERVER_MODEL

    laptop(monkeypatch, tmp_path / "cache")
    asked: list[int] = []
    with shipping_server(model6, tmp_path / "parts") as srv:
        code, port = invite(srv), int(srv.address.rsplit(":", 1)[1])
        host = EngineHost(SERVER_MODEL, MODE_SERVER, code, local_layers=2)
        host.confirm_download = lambda m, n: asked.append(n) or True
        host.ensure_ready_blocking()
        first = host.part
        assert host.state == CONNECTED and first is not None and host.max_k == 2
        host._close_trunk()  # (a reply fails while the server restarts)
    with shipping_server(other6, tmp_path / "parts", port=port):
        runner = host.ensure_ready_blocking()
        assert host.state == CONNECTED and host.part is not None
        assert host.part.manifest.part_id != first.manifest.part_id
        assert runner.client.resolved.folder == host.part.folder
        assert greedy(runner, 4)  # it chats with the new model
        host.shutdown_blocking()
    assert len(asked) == 2  # asked before each download
