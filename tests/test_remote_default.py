"""The default model through a live CURVE `veil-trunk serve` process (one short run)."""

from __future__ import annotations

import pytest
import torch

from engine.chat import messages_for, prompt_ids
from engine.generate import generate
from engine.loading import DEFAULT_MODEL
from engine.local_server import start_local_trunk
from engine.sampling import SamplingParams
from engine.split import LocalTrunk, SplitRunner, load_client, load_trunk


class RoundedTrunk(LocalTrunk):
    """In-process trunk with the wire's fp16 rounding on what goes in and comes out."""

    def forward(self, hidden, positions, parents=None, keep=None):  # type: ignore[no-untyped-def]
        h = hidden.half().float()  # [B, H]
        return super().forward(h, positions, parents, keep).half().float()


@pytest.mark.slow
def test_default_model_greedy_through_server_equals_in_process() -> None:
    client = load_client(DEFAULT_MODEL, 2)
    ids = prompt_ids(client.tokenizer, messages_for("Name three colours of the rainbow.", None))
    params = SamplingParams(max_new_tokens=12)
    start, end = client.plan.trunk_range
    local = load_trunk(client.resolved, start, end)
    want = generate(SplitRunner(client, local), ids, params).token_ids
    want16 = generate(SplitRunner(client, RoundedTrunk(local.stack)), ids, params).token_ids
    with start_local_trunk(DEFAULT_MODEL) as srv:
        with srv.connect(client, wire_dtype="float32") as trunk:
            got = generate(SplitRunner(client, trunk), ids, params)
            assert got.token_ids == want
            assert trunk.json_stats()["round_trips"] == got.stats.round_trips
        with srv.connect(client) as trunk16:  # the default fp16 wire
            assert generate(SplitRunner(client, trunk16), ids, params).token_ids == want16
    assert torch.get_default_dtype() == torch.float32
