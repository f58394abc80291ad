"""The trunk server's memory true to the file: a GGUF's matrices stay in their quantized blocks
by default, the weight memory is logged at start, matrices held as float are summed up in one
line that names the cause, and batches of quantized layers stay bit-identical to a session
alone."""

from __future__ import annotations

import json
import logging
import re
import shutil

import numpy as np
import pytest
import torch

from engine.loading import ResolvedModel, load_config
from engine.quant import QuantWeight
from engine.quant.gguf import GGUFFile
from engine.quant.load import GGUFWeights
from remote.server import ServerOptions, TrunkServer
from tests.test_batching import SESSIONS, Harness, open_all, run_alone, run_together, same
from tests.test_quant_model import gguf_resolved
from tests.tiny import make_model


@pytest.fixture(scope="module")
def q4k(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    """A 6-layer llama-layout model wide enough for Q4_K, as a GGUF file."""
    root = tmp_path_factory.mktemp("trunk-memory")
    make_model(root / "m", "llama", seed=21, n_layers=6, hidden_size=256, intermediate_size=512)
    res = gguf_resolved(root / "m", root, "q4_k", "llama")
    # a conversion folder as resolve() makes it: config and tokenizer, the weights in the file
    conv = root / "converted"
    conv.mkdir()
    for f in (root / "m").iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, conv / f.name)
    marker = {"source": str(res.source), "weights": "gguf"}
    (conv / "veil-converted.json").write_text(json.dumps(marker))
    return ResolvedModel(res.name, conv, res.source)


def server_for(res: ResolvedModel, monkeypatch: pytest.MonkeyPatch, **opts: object) -> TrunkServer:
    monkeypatch.setattr("remote.server.resolve", lambda spec, progress=None: res)
    options = ServerOptions(model=str(res.source), bind="tcp://127.0.0.1:1", insecure=True)
    for k, v in opts.items():
        setattr(options, k, v)
    return TrunkServer(options)


def served_share(res: ResolvedModel, lo: int, hi: int) -> int:
    f = GGUFFile(res.source)
    try:
        return sum(
            t.nbytes
            for n, t in f.tensors.items()
            if (m := re.match(r"blk\.(\d+)\.", n)) and lo <= int(m.group(1)) < hi
        )
    finally:
        f.close()


def test_gguf_trunk_keeps_the_file_quantized_by_default(
    q4k: ResolvedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="veil")
    srv = server_for(q4k, monkeypatch)
    try:
        layer = srv.stages[0].layers[1]
        assert all(isinstance(m, QuantWeight) for m in (layer.wqkv, layer.wo, layer.wgu))
        share = served_share(q4k, srv.lo, srv.hi)
        # the file's blocks, plus float norms (the tiny model's share of those is large)
        assert share <= srv.weight_bytes <= 1.2 * share
        lines = [r.getMessage() for r in caplog.records]
        mem = [m for m in lines if m.startswith("trunk weights:")]
        assert len(mem) == 1 and "kept quantized" in mem[0] and "layers [1, 5)" in mem[0]
        assert not [m for m in lines if "held as" in m]
        assert srv.worker.stats()["bit_identical"]
    finally:
        srv.worker.stop()
        srv.ctx.term()


def test_quant_none_says_why_in_one_line(
    q4k: ResolvedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="veil")
    srv = server_for(q4k, monkeypatch, quant="none")
    try:
        assert isinstance(srv.stages[0].layers[1].wo, torch.Tensor)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        held = [m for m in warnings if "held as" in m]
        assert len(held) == 1, warnings
        assert held[0].startswith("28 quantized matrices of the file (28 q4_k) are held as float32")
        assert "--quant none" in held[0] and "--quant auto" in held[0]
        assert srv.weight_bytes > 4 * served_share(q4k, srv.lo, srv.hi)
    finally:
        srv.worker.stop()
        srv.ctx.term()


def test_quantized_batches_are_bit_identical_to_sessions_alone(q4k: ResolvedModel) -> None:
    """The worker over a GGUF's blocks kept quantized: the quantized kernels compute each row
    alone, so a session's bits do not depend on who shares its batch."""
    cfg = load_config(q4k.folder)
    h = Harness(q4k.folder, reader=GGUFWeights(q4k.source, cfg), max_batch_rows=40)
    sids = list(SESSIONS)
    try:
        assert isinstance(h.stages[0].layers[2].wgu, QuantWeight)
        assert h.worker.bit_identical
        alone = run_alone(h, open_all(h, sids))
        h.forget(sids)
        together = run_together(h, open_all(h, sids))
    finally:
        h.close()
    same(alone, together)


def test_fused_matrices_are_not_held_twice(q4k: ResolvedModel) -> None:
    """gate|up (and q|k|v in one format) are concatenated at load: their parts are read into
    memory rather than through the file's map, whose pages would otherwise stay resident
    beside the fused copy; matrices used as stored stay views of the map."""
    cfg = load_config(q4k.folder)
    reader = GGUFWeights(q4k.source, cfg)
    from engine.model import layer_tensor_names

    t = reader.read(layer_tensor_names(cfg, 2))
    mapped = reader.file._array
    for name, w in t.items():
        if isinstance(w, QuantWeight):
            shared = np.shares_memory(w.data, mapped)
            assert shared == name.endswith(("o_proj.weight", "down_proj.weight")), name
