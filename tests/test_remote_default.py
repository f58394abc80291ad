"""The default model through a live CURVE `veil-trunk serve` process (one short run)."""

from __future__ import annotations

import pytest
import torch

from engine.chat import messages_for, prompt_ids
from engine.generate import generate
from engine.loading import DEFAULT_MODEL
from engine.local_server import start_local_trunk
from engine.sampling import SamplingParams
from engine.split import SplitRunner, load_client, load_trunk
from engine.transport import connect_trunk
from tests.inproc_trunk import CLIENT_KEYS, SERVER_KEYS, trunk_in_thread


@pytest.mark.slow
def test_default_model_greedy_through_server_equals_in_process() -> None:
    """`veil-trunk serve` in its own process (the CLI, model resolution, CURVE, both wires)
    gives exactly the tokens of the same server code running in this process, and its trunk
    is the engine's trunk: on the prompt it agrees with the in-process layers to rounding.

    (Token equality with the in-process layers is not the claim: those run the client's
    one-call layer, the server its batched one — the same model, different float roundings,
    which int8 activations can turn into a different token on a near tie.)"""
    client = load_client(DEFAULT_MODEL, 2)
    ids = prompt_ids(client.tokenizer, messages_for("Name three colours of the rainbow.", None))
    params = SamplingParams(max_new_tokens=12)
    want: dict[str, list[int]] = {}
    with trunk_in_thread(DEFAULT_MODEL) as ref:  # type: ignore[arg-type]
        for wire in ("float32", "float16"):
            with connect_trunk(
                ref.address,
                client,
                server_key=SERVER_KEYS[0],
                client_keys=CLIENT_KEYS,
                wire_dtype=wire,
            ) as t:
                want[wire] = generate(SplitRunner(client, t), ids, params).token_ids
    start, end = client.plan.trunk_range
    local = load_trunk(client.resolved, start, end)
    client.reset()
    hidden = client.head.forward(client.embed(torch.tensor(ids)), torch.arange(len(ids)))
    ref_out = local.forward(hidden, torch.arange(len(ids)))  # [T, H]
    with start_local_trunk(DEFAULT_MODEL) as srv:
        with srv.connect(client, wire_dtype="float32") as trunk:
            got = generate(SplitRunner(client, trunk), ids, params)
            assert got.token_ids == want["float32"]
            assert trunk.json_stats()["round_trips"] == got.stats.round_trips
        with srv.connect(client, wire_dtype="float32") as trunk:
            out = trunk.forward(hidden, torch.arange(len(ids)))  # [T, H]
        rel = (out - ref_out).norm() / ref_out.norm()
        assert rel < 1e-2, float(rel)
        with srv.connect(client) as trunk16:  # the default fp16 wire
            assert generate(SplitRunner(client, trunk16), ids, params).token_ids == want["float16"]
    assert torch.get_default_dtype() == torch.float32
