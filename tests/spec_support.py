"""What the speculative-decoding test modules share: tiny models of every family, runners
cached per model folder and k, the fixtures' bodies (one thread; the runners' configs put
back after a test changes them), and the chain a head drafter is shown."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import strategies as st

from engine.config import ModelConfig
from engine.drafts import Verified
from engine.split import SplitRunner, load_client, load_trunk
from tests.tiny import make_model

# mistral: sliding window 8 inside tree blocks; qwen3: q/k norms; gemma3: sliding and global
# layers with their own rotary bases, Gemma's norms, query scale and capped logits
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

# prompts of token ids for property tests; the repetitive ones get long paths accepted
prompts = st.one_of(
    st.lists(st.integers(3, 300), min_size=1, max_size=24),
    st.tuples(st.lists(st.integers(3, 300), min_size=1, max_size=5), st.integers(2, 8)).map(
        lambda t: t[0] * t[1]
    ),
)


def build_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random model folder per family."""
    root = tmp_path_factory.mktemp("spec-models")
    out = {}
    for i, fam in enumerate(FAMILIES):
        make_model(root / fam, fam, seed=40 + i)
        out[fam] = root / fam
    return out


_RUNNERS: dict[tuple[str, int], SplitRunner] = {}
_CONFIGS: dict[tuple[str, int], ModelConfig] = {}


def runner_for(folder: Path, k: int = 1) -> SplitRunner:
    """The cached runner of ``folder`` with ``k`` local layers at each end (a local trunk)."""
    key = (str(folder), k)
    if key not in _RUNNERS:
        client = load_client(str(folder), k)
        s, e = client.plan.trunk_range
        trunk = None if client.plan.fully_local else load_trunk(str(folder), s, e)
        _RUNNERS[key] = SplitRunner(client, trunk)
        _CONFIGS[key] = client.config
    return _RUNNERS[key]


def original_config(folder: Path, k: int = 1) -> ModelConfig:
    """The config ``runner_for(folder, k)`` was loaded with (tests change the runner's)."""
    return _CONFIGS[(str(folder), k)]


@contextmanager
def one_thread() -> Iterator[None]:
    """Tiny models: one thread is fastest, and the machine is shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def restore_configs() -> None:
    """Tests change EOS and the context limit on the (shared) runners' configs: put them back."""
    for k, r in _RUNNERS.items():
        r.client.config = _CONFIGS[k]


def chain_verified(ctx: list[int], n: int, states: Any, client: Any) -> Verified:
    """What a drafter is shown when the first ``n`` tokens of ``ctx`` are verified as one chain
    (each row's next token the one after it in ``ctx``), with the model's ``states`` of those
    rows (``forward_states(ctx[:n], range(n))``)."""
    return Verified(
        ctx,
        ctx[:n],
        list(range(-1, n - 1)),
        torch.zeros(n, 1, dtype=torch.long),
        torch.zeros(n, 1),
        list(range(n)),
        {i: ctx[i + 1] for i in range(n)},
        0,
        states.features(),
        client.tap_layers(),
    )


def assert_same_head_cache(a: Any, b: Any, n: int) -> None:
    """Two head drafters hold the same K/V for their first ``n`` rows (to rounding)."""
    torch.testing.assert_close(a.cache.k[:, :, :n], b.cache.k[:, :, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.cache.v[:, :, :n], b.cache.v[:, :, :n], atol=1e-4, rtol=1e-4)
