"""Real GGUF files against transformers: Gemma 3 270M and Qwen2.5-Coder-1.5B-Instruct (both
Q4_K_M), greedy tokens fully local and split (k = 2, the trunk in process), each kept in its
file's quantized blocks as Veil runs it by default; transformers dequantizes the same file.

Marked ``real_model`` and deselected by default (CI never fetches them): fetch the files once
with ``python -m tests.real_models``, then run ``pytest -m real_model``. A test whose file is not
in the user cache is skipped and says how to fetch it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.chat import messages_for, prompt_ids
from engine.generate import generate
from engine.sampling import SamplingParams
from engine.speculative import generate_speculative
from engine.split import SplitRunner, load_client, load_trunk
from tests import real_models

pytestmark = pytest.mark.real_model

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Write a short poem about the sea.",
)


def _file(name: str) -> Path:
    path = real_models.cached(name)
    if path is None:
        pytest.skip(real_models.skip_reason(name))
    return path


def _check(path: Path, new_tokens: int) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    local = load_client(str(path), (hf.config.num_hidden_layers + 1) // 2)
    assert local.plan.fully_local and local.client_quant == "gguf"
    client = load_client(str(path), 2)
    s, e = client.plan.trunk_range
    split = SplitRunner(client, load_trunk(client.resolved, s, e))
    params = SamplingParams(max_new_tokens=new_tokens)
    for text in PROMPTS:
        ids = prompt_ids(client.tokenizer, messages_for(text))
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        ref = out[0, len(ids) :].tolist()
        for runner in (SplitRunner(local, None), split):
            runner.reset()
            got = generate(runner, ids, params, decoder="sequential").token_ids
            assert got == ref[: len(got)] and len(got) in (len(ref), new_tokens), text
    split.reset()
    ids = prompt_ids(client.tokenizer, messages_for(PROMPTS[1]))
    seq = generate(split, ids, params, decoder="sequential").token_ids
    split.reset()
    assert generate_speculative(split, ids, params).token_ids == seq


@pytest.mark.usefixtures("exact_float")  # transformers dequantizes: compare that arithmetic
def test_gemma3_270m_matches_transformers() -> None:
    """Gemma 3: 18 layers, every 6th global (rope base 1M) and the rest sliding (512, base
    10k), 262k vocabulary, Q5_0/Q8_0/Q4_K/Q6_K blocks."""
    _check(_file("gemma3-270m"), 24)


@pytest.mark.usefixtures("exact_float")
def test_qwen25_coder_1_5b_matches_transformers() -> None:
    """Qwen2.5-Coder-1.5B-Instruct: 28 layers, GQA 12/2, q/k/v biases, Q4_K/Q6_K blocks."""
    _check(_file("qwen2.5-coder-1.5b"), 16)
