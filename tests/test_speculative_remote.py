"""Speculative decoding through a real veil-trunk process (CURVE, WAN emulator): the same tokens
as sequential decoding, with compaction done remotely by ``keep``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine.speculative as spec
from engine.generate import generate_sequential
from engine.local_server import start_local_trunk
from engine.sampling import SamplingParams
from engine.split import SplitRunner, load_client
from tests.tiny import make_model


@pytest.mark.slow
def test_speculative_equals_sequential_over_the_real_server(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    make_model(folder, "llama", seed=5)
    client = load_client(str(folder), 1)
    with start_local_trunk(str(folder), min_local_layers=1, rtt_ms=2, threads=1) as srv:
        trunk = srv.connect(client, wire_dtype="float32")
        # no EOS, so random-weight outputs run long (after the handshake: it checks the config)
        client.config = dataclasses.replace(client.config, eos_token_ids=())
        try:
            runner = SplitRunner(client, trunk)

            @settings(
                max_examples=8,
                deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture],
            )
            @given(
                prompt=st.one_of(
                    st.lists(st.integers(3, 300), min_size=1, max_size=12),
                    st.lists(st.integers(3, 300), min_size=1, max_size=4).map(lambda p: p * 4),
                ),
                max_new=st.integers(1, 24),
                budget=st.one_of(st.none(), st.integers(0, 10)),
            )
            def check(prompt: list[int], max_new: int, budget: int | None) -> None:
                params = SamplingParams(max_new_tokens=max_new)
                ref = generate_sequential(runner, prompt, params)
                got = spec.generate_speculative(
                    runner, prompt, params, options=spec.SpecOptions(fixed_budget=budget)
                )
                assert got.token_ids == ref.token_ids
                assert got.finish_reason == ref.finish_reason

            check()
            assert trunk.json_stats()["replays"] == 0
        finally:
            trunk.close()
