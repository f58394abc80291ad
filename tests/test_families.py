"""Qwen3 and Gemma 2/3 beyond the float path (which tests/test_engine_split.py and
tests/test_speculative.py hold to transformers): their configs as the hub and GGUF files write
them, GGUF files kept quantized, int8/int4 clients, the batching trunk, and the fingerprints of
the older families left as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.errors import UnsupportedArchitecture
from engine.generate import generate
from engine.loading import load_config
from engine.quant import QuantWeight
from engine.quant.load import GGUFWeights
from engine.sampling import SamplingParams
from engine.split import ClientModel, SplitPlan, SplitRunner, load_client, load_trunk
from tests.test_batching import SESSIONS, Harness, open_all, run_alone, run_together, same
from tests.test_quant_model import _check_spec_equals_seq, dequantized_folder, gguf_resolved
from tests.tiny import make_model

NEW = ("qwen3", "gemma3", "gemma2")
ARCH = {"qwen3": "qwen3", "gemma3": "gemma3", "gemma2": "gemma2"}  # GGUF architecture names


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Wide enough for 256-value K-quant blocks in every matrix (head_dim 64: nh * hd = 256)."""
    root = tmp_path_factory.mktemp("wide-families")
    out = {}
    for seed, fam in enumerate(NEW):
        kw = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
        make_model(root / fam, fam, seed=60 + seed, **kw)  # type: ignore[arg-type]
        out[fam] = root / fam
    return out


def test_gemma3_hub_config_layout(tmp_path: Path) -> None:
    """A transformers-4 style Gemma 3 config.json (rope_local_base_freq, sliding_window_pattern,
    no layer_types): every 6th layer global with the global base, the rest local."""
    raw = {
        "model_type": "gemma3_text",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_config(tmp_path)
    assert cfg.layer_windows == tuple(None if i % 6 == 5 else 512 for i in range(12))
    assert [cfg.layer_rope(i) for i in (0, 5, 6, 11)] == ["local", "global", "local", "global"]
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert cfg.query_scale is None and cfg.final_softcap is None  # 16 = head_dim: the default
    assert cfg.embed_scale == 8.0 and cfg.norm_plus_one and cfg.qk_norm and not cfg.plain_layers
    (tmp_path / "config.json").write_text(json.dumps({**raw, "use_bidirectional_attention": True}))
    with pytest.raises(UnsupportedArchitecture, match="bidirectional"):
        load_config(tmp_path)


def test_older_families_keep_their_fingerprints(default_model_folder: Path) -> None:
    """The fields added for newer families leave older configs' fingerprints (shipped draft
    heads, private overlays and servers are keyed by them) as they were."""
    cfg = load_config(default_model_folder)
    assert cfg.plain_layers
    assert cfg.fingerprint() == "38c0d02e14e4794e"  # SmolLM2-135M before Qwen3 / Gemma
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.fingerprint() == cfg.fingerprint()
    gemma = ModelConfig.from_dict({**cfg.to_dict(), "norm_plus_one": True})
    assert gemma.fingerprint() != cfg.fingerprint()


@pytest.mark.usefixtures("exact_float")  # the dequantized model's arithmetic, to float rounding
@pytest.mark.parametrize("family", NEW)
def test_gguf_kept_quantized_is_the_dequantized_model(
    wide: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """llama.cpp's tensor names and Gemma's stored 1 + w norms read back as the checkpoint's;
    the file's blocks kept quantized compute the dequantized model (no one-call layer: these
    layers run piece by piece, each product through the quantized kernels)."""
    res = gguf_resolved(wide[family], tmp_path, "q8_0", ARCH[family])
    cfg = load_config(res.folder)
    names = set(GGUFWeights(res.source, cfg).names())
    assert set(wide_names(cfg)) <= names
    plan = SplitPlan.symmetric(cfg.n_layers, cfg.n_layers // 2)
    quant = ClientModel(res, plan, client_quant="auto")
    assert isinstance(quant.head.layers[0].wo, QuantWeight) and quant.head._fused is None
    ref = ClientModel(dequantized_folder(res, tmp_path / "deq"), plan, client_quant="none")
    rq, rf = SplitRunner(quant, None), SplitRunner(ref, None)
    ids = [5, 17, 99, 23, 7, 64] * 3  # past the window of 8
    lq, lf = rq.forward(ids, range(len(ids))), rf.forward(ids, range(len(ids)))
    assert torch.allclose(lq, lf, atol=2e-4 * lf.abs().max().item(), rtol=1e-4)
    # and the dequantized GGUF is the float checkpoint to the quantization's error
    exact = SplitRunner(load_client(str(wide[family]), cfg.n_layers // 2), None)
    le = exact.forward(ids, range(len(ids)))
    assert (lf - le).abs().max() < 0.05 * le.abs().max()
    params = SamplingParams(max_new_tokens=10)
    rq.reset()
    rf.reset()
    assert generate(rq, ids, params).token_ids == generate(rf, ids, params).token_ids
    # split, the trunk kept quantized too: speculative output is sequential output
    client = ClientModel(res, SplitPlan.symmetric(cfg.n_layers, 1), client_quant="auto")
    s, e = client.plan.trunk_range
    _check_spec_equals_seq(SplitRunner(client, load_trunk(res, s, e)))


def wide_names(cfg: ModelConfig) -> list[str]:
    from engine.model import layer_tensor_names

    return [n for i in range(cfg.n_layers) for n in layer_tensor_names(cfg, i)]


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_int_quantized_clients_speculative_equals_sequential(
    tiny_models: dict[str, Path], quant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VEIL_CACHE_DIR", str(tmp_path / "cache"))
    for fam in NEW:
        client = load_client(str(tiny_models[fam]), 1, client_quant=quant)
        assert client.head._fused is None  # explicitly the piece-by-piece layer
        assert isinstance(client.head.layers[0].wgu, QuantWeight)
        s, e = client.plan.trunk_range
        _check_spec_equals_seq(SplitRunner(client, load_trunk(str(tiny_models[fam]), s, e)))


def test_batched_gemma3_trunk_is_bit_identical(tmp_path: Path) -> None:
    """The batching worker with local and global layers (their own rotary bases and windows):
    sessions over different sub-ranges — some with local layers only — get the bits they get
    alone, and the engine's own layers to rounding."""
    folder = tmp_path / "gemma6"
    make_model(folder, "gemma3", seed=9, n_layers=6)
    cfg = load_config(folder)
    assert [cfg.layer_rope(i) for i in range(6)] == ["local", "global", "local"] * 2
    sids = list(SESSIONS)
    h = Harness(folder, max_batch_rows=40, prefill_chunk=16)
    try:
        assert h.worker.bit_identical
        alone = run_alone(h, open_all(h, sids))
        h.forget(sids)
        together = run_together(h, open_all(h, sids))
    finally:
        h.close()
    same(alone, together)


def test_tools_with_their_own_llama_layer_refuse_in_one_line(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """`veil train-draft`'s batched generator and `veil privatize`'s checkpoint writer copy the
    Llama layer: for the new families they say so instead of computing another model."""
    from engine.audit.privatize import privatize
    from engine.drafts.selfgen import BatchModel
    from engine.loading import resolve

    for fam in NEW:
        res = resolve(str(tiny_models[fam]))
        with pytest.raises(UnsupportedArchitecture, match="train-draft does not support"):
            BatchModel(res, (1, 2, 4))
        with pytest.raises(UnsupportedArchitecture, match="privatize does not support"):
            privatize(str(tiny_models[fam]), 1, 1, tmp_path / "p.safetensors")
    BatchModel(resolve(str(tiny_models["qwen2"])), (1, 2, 4))  # the older families still run


def test_audit_replays_the_rows_the_first_layer_sees(tiny_models: dict[str, Path]) -> None:
    """The audit's attacker feeds candidate tokens through the public layers: for Gemma those
    are the embedding rows scaled by sqrt(H), as the client computes them."""
    from engine.audit.collect import AuditModel
    from engine.loading import resolve

    am = AuditModel(resolve(str(tiny_models["gemma3"])))
    ids = torch.tensor([3, 7, 11])
    assert torch.equal(am.embed_weight[ids], am.client.embed(ids))
    assert not torch.equal(am.embed_weight[ids], am.client.embed_weight[ids])
