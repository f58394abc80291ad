"""Split execution equals the unsplit transformers model, for every family and every k."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.errors import ModelLoadError, SplitError
from engine.loading import WeightReader, load_config
from engine.model import layer_tensor_names
from engine.split import SplitPlan, SplitRunner, load_client, load_trunk
from tests.tiny import make_model

FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3", "gemma2"]
# families whose layers differ: sliding windows, biases, q/k norms, Gemma's norms and caps
TREE_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma2"]


def _runner(folder: Path, head: int, tail: int) -> SplitRunner:
    client = load_client(str(folder), head, tail_layers=tail)
    trunk = None
    if not client.plan.fully_local:
        s, e = client.plan.trunk_range
        trunk = load_trunk(str(folder), s, e)
    return SplitRunner(client, trunk)


def _hf(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_split_logits_match_transformers_for_every_k(
    family: str, tiny_models: dict[str, Path]
) -> None:
    folder = tiny_models[family]
    hf = _hf(folder)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 390, (1, 37), generator=g)  # longer than Mistral's window of 8
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [T, V]
    n = load_config(folder).n_layers
    splits = [(k, min(k, n - k)) for k in range(1, n // 2 + 1)] + [(1, 2), (2, 1), (1, 1)]
    for head, tail in splits:
        runner = _runner(folder, head, tail)
        full = runner.forward(ids[0].tolist(), range(37))
        assert (full - ref).abs().max().item() < 1e-4, (head, tail)
        # Incremental: prefill 20, then one token at a time.
        runner.reset()
        parts = [runner.forward(ids[0, :20].tolist(), range(20))]
        parts += [runner.forward([int(ids[0, i])], [i]) for i in range(20, 37)]
        assert (torch.cat(parts) - ref).abs().max().item() < 1e-4, (head, tail)


def test_mistral_sliding_window_is_applied(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Guard: the window must change the result once the sequence outgrows it."""
    folder = tiny_models["mistral"]
    assert load_config(folder).layer_windows == (8,) * 4
    no_window = tmp_path / "nowin"
    make_model(no_window, "mistral", seed=2, sliding_window=None)
    ids = list(range(5, 30))
    a = _runner(folder, 1, 1).forward(ids, range(len(ids)))
    b = _runner(no_window, 1, 1).forward(ids, range(len(ids)))
    assert torch.allclose(a[:8], b[:8], atol=1e-5)  # inside the window: identical
    assert (a[-1] - b[-1]).abs().max() > 1e-3  # beyond it: different


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(
    family: str, tiny_models: dict[str, Path]
) -> None:
    from engine.generate import generate
    from engine.sampling import SamplingParams

    folder = tiny_models[family]
    hf = _hf(folder)
    prompt = [5, 17, 42, 99, 7, 250, 31]
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    ref = out[0, len(prompt) :].tolist()
    for k in (1, 2):
        runner = _runner(folder, k, k)
        res = generate(runner, prompt, SamplingParams(max_new_tokens=24))
        assert res.token_ids[: len(ref)] == ref[: len(res.token_ids)]
        assert len(res.token_ids) == 24 or res.finish_reason == "eos"


def _random_tree(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(-1, i) for i in range(1, n)]


def _depths(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    return depth


def _path_to(parents: list[int], node: int) -> list[int]:
    """Block indices from the root down to ``node``."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_tree_append_and_compaction_equal_recompute(
    family: str, tiny_models: dict[str, Path]
) -> None:
    folder = tiny_models[family]
    rng = random.Random(7)
    runner = _runner(folder, 1, 1)
    prefix = [rng.randrange(3, 390) for _ in range(12)]
    for _trial in range(5):
        runner.reset()
        runner.forward(prefix, range(len(prefix)))
        n = rng.randrange(2, 12)
        parents = _random_tree(rng, n)
        toks = [rng.randrange(3, 390) for _ in range(n)]
        pos = [len(prefix) + d for d in _depths(parents)]
        tree_logits = runner.forward(toks, pos, parents)
        # Each node's logits equal a chain run of its root-to-node path.
        path = _path_to(parents, rng.randrange(n))
        ref = _runner(folder, 1, 1)
        chain = ref.forward(prefix + [toks[i] for i in path], range(len(prefix) + len(path)))
        for j, node in enumerate(path):
            assert (tree_logits[node] - chain[len(prefix) + j]).abs().max() < 1e-4
        # Keep the path, then append one more token: equals the chain continued.
        nxt = rng.randrange(3, 390)
        after = runner.forward([nxt], [len(prefix) + len(path)], None, keep=path)
        full = ref.forward([nxt], [len(prefix) + len(path)])
        assert (after - full).abs().max() < 1e-4


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_tree_nodes_have_the_bits_of_sequential_steps(
    family: str, tiny_models: dict[str, Path]
) -> None:
    """On CPU in float32 every node of a verified tree gets exactly the logits the same token
    gets when its path is decoded one token at a time (what makes speculative output equal
    sequential output even on a near tie); mistral's window (8) is crossed on the way."""
    folder = tiny_models[family]
    rng = random.Random(11)
    runner = _runner(folder, 1, 1)
    ref = _runner(folder, 1, 1)
    prefix = [rng.randrange(3, 390) for _ in range(9)]
    for _trial in range(4):
        runner.reset()
        runner.forward(prefix, range(len(prefix)))
        n = rng.randrange(6, 16)
        parents = _random_tree(rng, n)
        toks = [rng.randrange(3, 390) for _ in range(n)]
        depth = _depths(parents)
        tree_logits = runner.forward(toks, [len(prefix) + d for d in depth], parents)
        path = _path_to(parents, max(range(n), key=lambda i: depth[i]))
        ref.reset()
        ref.forward(prefix, range(len(prefix)))
        for j, node in enumerate(path):
            step = ref.forward([toks[node]], [len(prefix) + j])[0]
            assert torch.equal(tree_logits[node], step), (family, j)


def test_kv_cache_grows_and_truncates(tiny_llama: Path) -> None:
    runner = _runner(tiny_llama, 1, 1)
    for stack in (runner.client.head, runner.client.tail, runner.trunk.stack):  # type: ignore[union-attr]
        stack.cache._alloc(4)
    ids = list(range(10, 50))
    grown = runner.forward(ids, range(40))
    assert runner.client.head.cache.capacity >= 40
    ref = _runner(tiny_llama, 1, 1).forward(ids, range(40))
    assert (grown - ref).abs().max() < 1e-5
    cache = runner.client.head.cache
    cache.truncate(30)
    assert cache.length == 30
    with pytest.raises(ValueError):
        cache.truncate(31)


def test_client_and_trunk_load_only_their_own_tensors(tiny_llama: Path, tmp_path: Path) -> None:
    """Checkpoints holding only one side's tensors are enough for that side."""
    from safetensors.torch import save_file

    cfg = load_config(tiny_llama)
    reader = WeightReader(tiny_llama)
    n, k = cfg.n_layers, 1
    client_names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    client_names += [t for i in (0, n - 1) for t in layer_tensor_names(cfg, i)]
    trunk_names = [t for i in range(k, n - k) for t in layer_tensor_names(cfg, i)]
    assert not set(client_names) & set(trunk_names)
    for name, names in (("client", client_names), ("trunk", trunk_names)):
        d = tmp_path / name
        d.mkdir()
        save_file(reader.read(names), str(d / "model.safetensors"))
        for f in tiny_llama.iterdir():
            if f.suffix != ".safetensors":
                (d / f.name).write_bytes(f.read_bytes())
    client = load_client(str(tmp_path / "client"), k)
    trunk = load_trunk(str(tmp_path / "trunk"), k, n - k)
    ids = [4, 8, 15, 16, 23, 42]
    split = SplitRunner(client, trunk).forward(ids, range(6))
    ref = _runner(tiny_llama, k, k).forward(ids, range(6))
    assert torch.equal(split, ref)
    # Growing k needs layers the client-only checkpoint lacks: proof it never had them.
    with pytest.raises(ModelLoadError):
        client.set_split(SplitPlan.symmetric(n, 2))
    with pytest.raises(ModelLoadError):
        load_trunk(str(tmp_path / "client"), k, n - k)


def test_local_footprint_grows_with_k_on_demand(tiny_llama: Path) -> None:
    client = load_client(str(tiny_llama), 1)
    small = client.local_param_bytes()
    client.set_split(SplitPlan.symmetric(4, 2))
    assert client.local_param_bytes() > small
    client.set_split(SplitPlan.symmetric(4, 1))
    assert client.local_param_bytes() == small


def test_split_plan_validation(tiny_llama: Path) -> None:
    assert SplitPlan.symmetric(30, 15).fully_local
    assert SplitPlan.symmetric(30, 2).trunk_range == (2, 28)
    assert SplitPlan.symmetric(5, 3).fully_local
    for bad in (0, 16, -1):
        with pytest.raises(SplitError):
            SplitPlan.symmetric(30, bad)
    with pytest.raises(SplitError):
        SplitPlan.of(30, 20, 11)
    with pytest.raises(SplitError, match="needs a trunk"):
        SplitRunner(load_client(str(tiny_llama), 1), None)
    client = load_client(str(tiny_llama), 1)
    with pytest.raises(SplitError, match="serves layers"):
        SplitRunner(client, load_trunk(str(tiny_llama), 1, 2))


def test_warm_up_runs_under_a_label_and_leaves_nothing_behind(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.split as split

    seen: list[tuple[str, float]] = []
    monkeypatch.setattr(split, "WARM_LABEL_AFTER_S", 0.0)  # the label at once
    warm = load_client(str(tiny_llama), 1, progress=lambda s, f: seen.append((s, f)), warm_up=True)
    assert ("preparing kernels", 0.0) in seen and seen[-1] == ("preparing kernels", 1.0)
    # a warm-up faster than the label's delay shows nothing (a CLI prints no line for it)
    monkeypatch.setattr(split, "WARM_LABEL_AFTER_S", 1e6)
    quiet: list[tuple[str, float]] = []
    split.warm_up_client(warm, lambda s, f: quiet.append((s, f)))
    assert quiet == []
    assert warm.head.cache.length == 0 and warm.tail.cache.length == 0
    cold = load_client(str(tiny_llama), 1)
    ids, pos = [3, 7, 11, 5], [0, 1, 2, 3]
    for c in (warm, cold):
        c.reset()
    a = SplitRunner(warm, load_trunk(warm.resolved, 1, 3)).forward(ids, pos)
    b = SplitRunner(cold, load_trunk(cold.resolved, 1, 3)).forward(ids, pos)
    assert torch.equal(a, b)


def test_a_long_prompt_runs_in_pieces_as_one_block(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain longer than PIECE_ROWS runs piece by piece (the compiled layers are faster on
    pieces) and gives what one block gives; the cache still holds it as one block, so
    a following ``keep`` indexes the whole prompt."""
    import engine.model as model

    ids = [3 + (i * 37) % 380 for i in range(500)]
    monkeypatch.setattr(model, "PIECE_ROWS", 200)
    pieces = _runner(tiny_llama, 1, 1)
    got = pieces.forward(ids, range(500))
    assert pieces.client.head.cache.block_start == 0 and pieces.client.head.cache.length == 500
    after = pieces.forward([7], [450], None, keep=list(range(450)))
    monkeypatch.setattr(model, "PIECE_ROWS", 10_000)
    whole = _runner(tiny_llama, 1, 1)
    want = whole.forward(ids, range(500))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, whole.forward([7], [450], None, keep=list(range(450))))
    calls: list[int] = []
    real = model.LayerStack._forward_block
    monkeypatch.setattr(model, "PIECE_ROWS", 200)
    monkeypatch.setattr(
        model.LayerStack,
        "_forward_block",
        lambda self, h, *a, **k: calls.append(h.shape[0]) or real(self, h, *a, **k),
    )
    _runner(tiny_llama, 1, 1).forward(ids, range(500))
    assert calls[:3] == [200, 200, 100]  # the head's pieces (then the trunk's and the tail's)
