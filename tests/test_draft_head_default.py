"""The draft head shipped for the default model: it is found, it drafts, it is measured on fresh
self-prompts (never on the benchmark prompts), and the output is still the sequential one."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from app.cli import main
from engine.drafts.dataset import DataOptions, load_samples, make_data
from engine.drafts.head import find_shipped_head, shipped_heads_dir
from engine.drafts.pipeline import load_frozen
from engine.drafts.select import auto_head
from engine.drafts.selfgen import BatchModel
from engine.drafts.train import depth_acceptance
from engine.loading import DEFAULT_MODEL, resolve
from engine.model import rope_inv_freq
from engine.split import load_client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_the_default_model_has_a_shipped_head() -> None:
    client = load_client(DEFAULT_MODEL, 2)
    path = find_shipped_head(client.config.fingerprint())
    assert path is not None and path.parent == shipped_heads_dir()
    assert path.stat().st_size < 16 << 20  # small enough to ship
    head = auto_head(client)
    assert head is not None
    assert head.feature_layers == client.tap_layers() == (2, 28, 30)
    info = head.info
    assert info["data_tokens"] > 0 and info["train_steps"] > 0
    assert len(info["heldout_acceptance"]["conditional"]) == 6


def test_generate_drafts_with_the_shipped_head(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = ["generate", "--prompt", "Name three colors.", "--max-new-tokens", "40", "--json"]
    assert main([*prompt, "--decoder", "sequential"]) == 0
    seq = json.loads(capsys.readouterr().out)
    assert main(prompt) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == seq["token_ids"]
    assert spec["draft_head"] and Path(spec["draft_head"]).name.endswith(".safetensors")
    assert spec["draft_ms_per_round"] > 0
    assert spec["round_trips"] < seq["round_trips"]
    assert main([*prompt, "--draft-head", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["draft_head"] is None and plain["token_ids"] == seq["token_ids"]


def test_shipped_head_accepts_on_fresh_self_prompts() -> None:
    """Regression floor for the head alone (the full measurement is
    bench/draft_head_acceptance.py; docs/performance.md has its numbers)."""
    resolved = resolve(DEFAULT_MODEL)
    client = load_client(DEFAULT_MODEL, 2)
    head = auto_head(client)
    assert head is not None
    with tempfile.TemporaryDirectory() as tmp:
        model = BatchModel(resolved, head.feature_layers, tokenizer=client.tokenizer)
        make_data(model, Path(tmp), DataOptions(tokens=1500, batch=12, reply_tokens=64, seed=4242))
        del model
        samples = [s for s in load_samples(Path(tmp)) if s.kind == "reply"]
    frozen = load_frozen(client.reader, client.config, head.vocab, "cpu")
    acc = depth_acceptance(head.net, frozen, samples, rope_inv_freq(client.config), depth=3)
    assert acc["positions"] > 300
    # the shipped head measured 0.65 and 1.28 here (these prompts are fixed: seed 4242; the
    # head it replaced, trained on 7x less data, 0.51 and 0.89)
    assert acc["conditional"][0] > 0.58, acc
    assert acc["mean_chain"] > 1.1, acc
