"""End to end on the real default model: token ids equal transformers' greedy `generate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.chat import messages_for, prompt_ids
from engine.generate import generate
from engine.loading import DEFAULT_MODEL
from engine.sampling import SamplingParams
from engine.split import SplitRunner, load_client, load_trunk

PROMPTS = Path(__file__).resolve().parent.parent.parent / "shared" / "bench" / "prompts.jsonl"
FALLBACK = ["Write a Python function to reverse a string.", "Name three colours of the sky."]

pytestmark = pytest.mark.slow


def _prompts() -> list[str]:
    if PROMPTS.is_file():
        rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
        return [rows[0]["prompt"], rows[-1]["prompt"]]
    return FALLBACK


@pytest.mark.usefixtures("exact_float")
def test_default_model_greedy_equals_transformers(default_model_folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    # The cache folder holds config and tokenizer only; the weights stay in the GGUF, which
    # transformers dequantizes itself (an independent reader of the same file).
    meta = json.loads((default_model_folder / "veil-converted.json").read_text())
    gguf = Path(meta["source"])
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    client = load_client(DEFAULT_MODEL, 2)
    runner = SplitRunner(client, load_trunk(client.resolved, 2, 28))
    local = SplitRunner(load_client(DEFAULT_MODEL, 15), None)
    for text in _prompts():
        ids = prompt_ids(client.tokenizer, messages_for(text))
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
        ref = out[0, len(ids) :].tolist()
        for r in (runner, local):
            res = generate(r, ids, SamplingParams(max_new_tokens=32))
            assert res.token_ids == ref
