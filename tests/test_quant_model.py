"""Quantized clients end to end: a GGUF file's blocks kept quantized compute the model of its
dequantized weights; speculative output equals sequential output with every client quant type;
the client holds only its own tensors, quantized; int8/int4 quantization is cached."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import kernels
from engine.generate import generate
from engine.loading import ResolvedModel, load_config
from engine.model import LayerStack
from engine.quant import QuantWeight, weight_bytes
from engine.quant.gguf import GGUFFile
from engine.quant.load import GGUFWeights
from engine.quant.sizes import client_weight_bytes
from engine.sampling import SamplingParams
from engine.speculative import SpecOptions, generate_speculative
from engine.split import ClientModel, SplitPlan, SplitRunner, load_client, load_trunk
from tests.tiny import make_model
from tests.tiny_quant import write_gguf

GGUF_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
PROMPTS = ([5, 17, 99, 23, 7, 64], [300, 12, 12, 12, 12, 41, 8], [3, 250, 250, 3, 250, 250, 3])


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny models wide enough for the 256-value K-quant blocks (llama: q/k permuted in GGUF;
    qwen2: q/k/v biases, tied embedding)."""
    root = tmp_path_factory.mktemp("wide")
    out = {}
    for seed, fam in enumerate(("llama", "qwen2")):
        make_model(root / fam, fam, seed=seed, hidden_size=256, intermediate_size=512)
        out[fam] = root / fam
    return out


def gguf_resolved(folder: Path, tmp: Path, fmt: str, arch: str) -> ResolvedModel:
    path = tmp / f"{folder.name}-{fmt}.gguf"
    if not path.exists():
        write_gguf(folder, path, fmt, arch)
    return ResolvedModel(str(path), folder, path)


def dequantized_folder(res: ResolvedModel, out: Path) -> ResolvedModel:
    """The same model with the GGUF's weights dequantized into a float checkpoint."""
    from safetensors.torch import save_file

    cfg = load_config(res.folder)
    reader = GGUFWeights(res.source, cfg, keep_quantized=False)
    shutil.copytree(res.folder, out, dirs_exist_ok=True)
    tensors = reader.read(reader.names())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return ResolvedModel(str(out), out, out)


@pytest.mark.usefixtures("exact_float")  # the dequantized model's arithmetic, to float rounding
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_gguf_kept_quantized_is_the_dequantized_model(
    wide: dict[str, Path], tmp_path: Path, fmt: str, arch: str
) -> None:
    res = gguf_resolved(wide[arch], tmp_path, fmt, arch)
    cfg = load_config(res.folder)
    plan = SplitPlan.symmetric(cfg.n_layers, cfg.n_layers // 2)  # fully local
    quant = ClientModel(res, plan, client_quant="auto")
    assert quant.client_quant == "gguf"
    assert isinstance(quant.lm_head, QuantWeight) and quant.lm_head.fmt == fmt
    ref = ClientModel(dequantized_folder(res, tmp_path / "deq"), plan, client_quant="none")
    _same_model(quant, ref, 2e-4)


@contextmanager
def _activations(*, int8: bool) -> Iterator[None]:
    """Quantized products with int8 (llama.cpp's rule) or float activations, inside the block."""
    was = kernels.int8_activations()
    kernels.set_int8_activations(int8)
    try:
        yield
    finally:
        kernels.set_int8_activations(was)


def _same_model(a: ClientModel, b: ClientModel, atol: float) -> None:
    """Two fully local clients compute the same logits (to ``atol`` of the largest, relative)
    and the same greedy tokens."""
    ra, rb = SplitRunner(a, None), SplitRunner(b, None)
    ids = PROMPTS[0] * 3
    la, lb = ra.forward(ids, range(len(ids))), rb.forward(ids, range(len(ids)))
    assert torch.allclose(la, lb, atol=atol * lb.abs().max().item(), rtol=1e-4)
    params = SamplingParams(max_new_tokens=12)
    ra.reset()
    rb.reset()
    assert generate(ra, ids, params).token_ids == generate(rb, ids, params).token_ids


def _check_spec_equals_seq(runner: SplitRunner) -> None:
    params = SamplingParams(max_new_tokens=16)
    for prompt in PROMPTS[:2]:
        runner.reset()
        seq = generate(runner, prompt, params, decoder="sequential").token_ids
        for budget in (3, 9):
            runner.reset()
            spec = generate_speculative(
                runner, prompt, params, options=SpecOptions(fixed_budget=budget)
            )
            assert spec.token_ids == seq, (budget, prompt)


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_speculative_equals_sequential_gguf(
    wide: dict[str, Path], tmp_path: Path, fmt: str
) -> None:
    res = gguf_resolved(wide["llama"], tmp_path, fmt, "llama")
    cfg = load_config(res.folder)
    client = ClientModel(res, SplitPlan.symmetric(cfg.n_layers, 1), client_quant="auto")
    s, e = client.plan.trunk_range
    _check_spec_equals_seq(SplitRunner(client, load_trunk(res, s, e, quant="auto")))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_format_layers_run_in_one_call(
    wide: dict[str, Path], tmp_path: Path, arch: str
) -> None:
    """A Q4_K_M-style file (v and up of layer 0, down of layer 1 in Q6_K; the rest Q4_K): every
    layer still runs as one compiled call (q|k|v and gate|up as their parts), computing what
    the layer run piece by piece computes, and speculative output equals sequential."""
    path = tmp_path / f"{arch}-mixed.gguf"
    mixed = {"layers.0.self_attn.v_proj": "q6_k", "layers.0.mlp.up_proj": "q6_k"}
    mixed["layers.1.mlp.down_proj"] = "q6_k"
    write_gguf(wide[arch], path, "q4_k", arch, mixed)
    res = ResolvedModel(str(path), wide[arch], path)
    cfg = load_config(res.folder)
    plan = SplitPlan.symmetric(cfg.n_layers, cfg.n_layers // 2)  # fully local
    fused = ClientModel(res, plan, client_quant="auto")
    assert fused.head._fused is not None and len(fused.head._fused[0][7]) == 7  # parts
    assert len(fused.head._fused[1][7]) == 4  # one format per fused matrix: four products
    split = ClientModel(res, plan, client_quant="auto")
    split.head._fused = split.tail._fused = None  # the same weights, piece by piece
    # compared with float activations: with int8 ones a float rounding difference between the
    # two (the fused SiLU's exp, its attention) can flip one activation's 8-bit rounding, which
    # moved a logit by 8e-3 of the largest on an Intel AVX-512 machine (1/127: one step)
    with _activations(int8=False):
        _same_model(fused, split, 1e-4)
    client = ClientModel(res, SplitPlan.symmetric(cfg.n_layers, 1), client_quant="auto")
    assert client.head._fused is not None
    s, e = client.plan.trunk_range
    _check_spec_equals_seq(SplitRunner(client, load_trunk(res, s, e, quant="auto")))


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_speculative_equals_sequential_int(
    tiny_models: dict[str, Path], quant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VEIL_CACHE_DIR", str(tmp_path / "cache"))
    for fam in ("llama", "mistral", "qwen2"):  # mistral: sliding-window masks
        client = load_client(str(tiny_models[fam]), 1, client_quant=quant)
        assert client.head._fused is not None  # the one-call quantized layers
        assert client.client_quant == quant
        s, e = client.plan.trunk_range
        _check_spec_equals_seq(SplitRunner(client, load_trunk(str(tiny_models[fam]), s, e)))


def test_one_call_layers_follow_a_growing_cache(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-call layers keep numpy views of the KV cache between blocks; when the cache
    grows (new buffers) they must write and read the new ones: a stack that starts with room
    for 2 slots and doubles four times computes the bits of one that never grows."""
    monkeypatch.setenv("VEIL_CACHE_DIR", str(tmp_path / "cache"))
    client = load_client(str(tiny_models["llama"]), 1, client_quant="int8")
    cfg, layers = client.config, client.head.layers
    small = LayerStack(cfg, 0, layers, capacity=2)
    big = LayerStack(cfg, 0, layers, capacity=64)
    assert small._fused is not None and big._fused is not None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, cfg.hidden_size, generator=gen)  # [T, H]
    blocks = [(0, 3), *((i, i + 1) for i in range(3, 20))]  # a prompt, then one row at a time
    for a, b in blocks:
        pos = torch.arange(a, b)
        assert torch.equal(small.forward(x[a:b], pos), big.forward(x[a:b], pos))
    assert small.cache.capacity == 32 and big.cache.capacity == 64


def test_client_reads_only_its_tensors_and_holds_them_quantized(
    wide: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    res = gguf_resolved(wide["llama"], tmp_path, "q4_k", "llama")
    cfg = load_config(res.folder)
    touched: list[str] = []
    for meth in ("raw", "copy"):
        orig = getattr(GGUFFile, meth)

        def spy(self: GGUFFile, name: str, orig=orig) -> np.ndarray:  # type: ignore[no-untyped-def]
            touched.append(name)
            return orig(self, name)

        monkeypatch.setattr(GGUFFile, meth, spy)
    n = cfg.n_layers
    client = ClientModel(res, SplitPlan.symmetric(n, 1), client_quant="auto")
    blocks = {t.split(".")[1] for t in touched if t.startswith("blk.")}
    assert blocks == {"0", str(n - 1)}
    assert {"token_embd.weight", "output.weight", "output_norm.weight"} <= set(touched)
    held = [client.lm_head, client.embed_weight]
    for i in (0, n - 1):
        w = client._layers[i]
        held += [w.wqkv, w.wo, w.wgu, w.wdown]
    assert all(isinstance(h, QuantWeight) and h.fmt == "q4_k" for h in held)
    quant_bytes = client.local_param_bytes()
    float_bytes = ClientModel(
        res, SplitPlan.symmetric(n, 1), client_quant="none"
    ).local_param_bytes()
    assert quant_bytes == client_weight_bytes(res, cfg, 1, "auto")
    assert quant_bytes < float_bytes / 5
    assert sum(weight_bytes(h) for h in held) < quant_bytes


def test_int4_quantization_is_cached_and_memory_mapped(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VEIL_CACHE_DIR", str(tmp_path / "cache"))
    first = load_client(str(tiny_llama), 1, client_quant="int4")
    files = list((tmp_path / "cache" / "quant").rglob("*.data.npy"))
    assert files, "the quantized tensors are cached"
    second = load_client(str(tiny_llama), 1, client_quant="int4")
    assert isinstance(second.lm_head, QuantWeight)
    assert isinstance(second.lm_head.data, np.memmap)  # served from the cache file
    assert np.array_equal(first.lm_head.data, second.lm_head.data)
    ids = PROMPTS[1]
    a = SplitRunner(first, load_trunk(str(tiny_llama), 1, 3)).forward(ids, range(len(ids)))
    b = SplitRunner(second, load_trunk(str(tiny_llama), 1, 3)).forward(ids, range(len(ids)))
    assert torch.equal(a, b)
    cfg = load_config(tiny_llama)
    assert first.local_param_bytes() == client_weight_bytes(
        ResolvedModel(str(tiny_llama), tiny_llama, tiny_llama), cfg, 1, "int4"
    )


def test_bad_client_quant_is_one_clear_error(tiny_llama: Path) -> None:
    from engine.errors import ModelSpecError

    with pytest.raises(ModelSpecError, match="client quantization"):
        load_client(str(tiny_llama), 1, client_quant="int3")


@pytest.mark.slow
def test_default_model_kept_quantized_speculative_equals_sequential() -> None:
    """The embedded Q4_1 GGUF, its blocks kept quantized, at k = 2 with the trunk in process."""
    from engine.chat import messages_for, prompt_ids
    from engine.loading import DEFAULT_MODEL

    client = load_client(DEFAULT_MODEL, 2)
    assert client.client_quant == "gguf" and isinstance(client.lm_head, QuantWeight)
    s, e = client.plan.trunk_range
    runner = SplitRunner(client, load_trunk(client.resolved, s, e))
    params = SamplingParams(max_new_tokens=32)
    for text in ("Write a haiku about the sea.",):
        ids = prompt_ids(client.tokenizer, messages_for(text, None))
        runner.reset()
        seq = generate(runner, ids, params, decoder="sequential").token_ids
        runner.reset()
        assert generate(runner, ids, params, decoder="speculative").token_ids == seq


def test_lazy_lm_head_changes_no_token_and_computes_fewer_rows(
    wide: dict[str, Path], tmp_path: Path
) -> None:
    """With a drafter that does not learn from every node's logits, verification computes
    LM-head rows along the walk only; the tokens are those of sequential decoding."""
    from engine.drafts import SuffixDraft, TreeDrafter

    res = gguf_resolved(wide["llama"], tmp_path, "q4_k", "llama")
    cfg = load_config(res.folder)
    client = ClientModel(res, SplitPlan.symmetric(cfg.n_layers, 1), client_quant="auto")
    s, e = client.plan.trunk_range
    runner = SplitRunner(client, load_trunk(res, s, e))
    counted = {"rows": 0}
    plain_logits = client.logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        counted["rows"] += hidden.shape[0]
        return plain_logits(hidden)

    client.logits = counting  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=20)
    total = {False: 0, True: 0}
    branching = [7, 1, 7, 2, 7, 3, 7, 4, 9, 7, 1, 7, 2, 7]  # after 7: several drafted children
    for prompt in (*PROMPTS, branching):
        runner.reset()
        seq = generate(runner, prompt, params, decoder="sequential").token_ids
        for lazy in (False, True):
            drafter = TreeDrafter([SuffixDraft()])  # learns from the context, not from logits
            drafter.needs_all_logits = False  # type: ignore[attr-defined]
            runner.reset()
            counted["rows"] = 0
            res_spec = generate_speculative(
                runner,
                prompt,
                params,
                drafter=drafter,
                options=SpecOptions(fixed_budget=8, lazy_head=lazy),
            )
            assert res_spec.token_ids == seq, (lazy, prompt)
            total[lazy] += counted["rows"]
    assert total[True] < total[False]


@pytest.mark.parametrize("int8_acts", [False, True])
def test_both_arithmetics_keep_speculative_equal_to_sequential(
    wide: dict[str, Path], tmp_path: Path, int8_acts: bool
) -> None:
    res = gguf_resolved(wide["qwen2"], tmp_path, "q4_k", "qwen2")
    cfg = load_config(res.folder)
    client = ClientModel(res, SplitPlan.symmetric(cfg.n_layers, 1), client_quant="auto")
    s, e = client.plan.trunk_range
    with _activations(int8=int8_acts):
        _check_spec_equals_seq(SplitRunner(client, load_trunk(res, s, e, quant="auto")))


@pytest.mark.slow
def test_gguf_folder_keeps_the_weights_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new GGUF conversion writes config and tokenizer only; float readers dequantize from
    the file and agree bit for bit with an earlier full conversion (same trunk fingerprint)."""
    from engine.loading import DEFAULT_MODEL, WeightReader, resolve, weights_fingerprint
    from engine.model import layer_tensor_names

    old = resolve(DEFAULT_MODEL)  # the shared cache: possibly an earlier full conversion
    monkeypatch.setenv("VEIL_CACHE_DIR", str(tmp_path / "cache"))
    new = resolve(DEFAULT_MODEL)
    assert not list(new.folder.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in new.folder.iterdir()) < 20_000_000
    cfg = load_config(new.folder)
    names = [n for i in range(2, 28) for n in layer_tensor_names(cfg, i)]
    a, b = WeightReader(old.folder), WeightReader(new.folder)
    assert weights_fingerprint(a, names) == weights_fingerprint(b, names)
    for n in ("model.layers.3.self_attn.q_proj.weight", "model.norm.weight"):
        assert torch.equal(a.read([n])[n], b.read([n])[n])
    client = load_client(DEFAULT_MODEL, 15, client_quant="none")
    assert client.resolved.folder == new.folder
    ids = [1, 2, 3, 4, 5]
    ref = SplitRunner(load_client(str(old.folder), 15, client_quant="none"), None)
    assert torch.equal(SplitRunner(client, None).forward(ids, range(5)), ref.forward(ids, range(5)))
