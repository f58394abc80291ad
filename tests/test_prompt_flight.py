"""A long prompt read through a trunk server with several blocks in flight (engine.generate.
read_prompt): the client's head layers for block c+1 run while the trunk works on block c. The
rows are exactly those of reading the blocks one by one, progress and cancelling still work
between blocks, and a session lost with prompt blocks in flight is replayed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.speculative as spec
from engine import protocol as P
from engine.errors import GenerationError
from engine.generate import CancelToken, Prefill, generate_sequential, read_prompt
from engine.sampling import SamplingParams
from engine.split import BlockStates, ClientModel, SplitRunner, load_client, load_trunk
from remote.server import TrunkServer
from tests.inproc_trunk import connect_without_eos, record_overlapped, trunk_in_thread
from tests.tiny import make_model

PROMPT = [(7 * i + 3) % 50 + 4 for i in range(45)]  # 45 tokens: blocks of 8 leave a short last
PARAMS = SamplingParams(max_new_tokens=12)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("prompt-flight") / "llama4"
    make_model(f, "llama", seed=11, n_layers=4)
    return f


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[TrunkServer]:
    with trunk_in_thread(folder, max_sessions=8, max_sessions_per_client=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(folder: Path) -> ClientModel:
    return load_client(str(folder), 1)


@pytest.fixture
def overlapped(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Step ids the client sent while an earlier step's answer was still out."""
    return record_overlapped(monkeypatch)


def _finals(runner: Any, prefill: Prefill, cancel: CancelToken | None = None) -> Any:
    """PROMPT read by ``runner`` (a runner or a spy on one): each block's final rows, or None
    when stopped."""
    return read_prompt(runner, lambda s: s.final, PROMPT, prefill, cancel)


def _rows(runner: SplitRunner, chunk: int, window: int) -> torch.Tensor:
    runner.reset()
    blocks = _finals(runner, Prefill(chunk, window=window))
    assert blocks is not None and len(blocks) == -(-len(PROMPT) // chunk)
    return torch.cat(blocks)  # [L, H]


@pytest.mark.parametrize("chunk", [1, 8, 16])
def test_blocks_in_flight_give_the_rows_of_one_at_a_time(
    server: TrunkServer, client: ClientModel, overlapped: set[int], chunk: int
) -> None:
    with connect_without_eos(server, client) as trunk:
        runner = SplitRunner(client, trunk)
        one = _rows(runner, chunk, 1)
        assert not overlapped  # window 1: every block waited for
        for window in (2, 3):
            assert torch.equal(_rows(runner, chunk, window), one)
        # steps were sent while earlier ones were out, never more than 3 at once
        assert len(overlapped) >= -(-len(PROMPT) // chunk) - 1
        assert trunk.json_stats()["replays"] == 0


def test_decoders_read_the_prompt_in_flight_and_give_the_same_tokens(
    server: TrunkServer, client: ClientModel, overlapped: set[int]
) -> None:
    with connect_without_eos(server, client) as trunk:
        runner = SplitRunner(client, trunk)
        ref = generate_sequential(runner, PROMPT, PARAMS, prefill=Prefill(8, window=1))
        assert not overlapped
        seq = generate_sequential(runner, PROMPT, PARAMS, prefill=Prefill(8))
        spec.forget(runner)
        got = spec.generate_speculative(runner, PROMPT, PARAMS, prefill=Prefill(8))
        assert seq.token_ids == ref.token_ids == got.token_ids
        assert len(overlapped) >= 5  # 6 prompt blocks, 3 in flight: all but the first
        assert seq.stats.round_trips == ref.stats.round_trips  # a block is one round trip


def test_a_stop_with_blocks_in_flight_drops_them_and_the_next_reply_is_exact(
    server: TrunkServer, client: ClientModel, overlapped: set[int]
) -> None:
    with connect_without_eos(server, client) as trunk:
        runner = SplitRunner(client, trunk)
        ref = generate_sequential(runner, PROMPT, PARAMS, prefill=Prefill(8, window=1))
        cancel = CancelToken()
        stop = Prefill(8, on_progress=lambda d, n: cancel.cancel())
        got = generate_sequential(runner, PROMPT, PARAMS, cancel=cancel, prefill=stop)
        assert got.finish_reason == "cancelled" and got.token_ids == []
        assert overlapped and not trunk._inflight and trunk.session is None  # dropped, closed
        # the dropped session's late answers are not mistaken for the next reply's
        assert generate_sequential(runner, PROMPT, PARAMS, prefill=Prefill(8)).token_ids == (
            ref.token_ids
        )
        assert trunk.json_stats()["replays"] == 0


@pytest.mark.parametrize("lost_at", [1, 3, 5])
def test_a_session_lost_with_prompt_blocks_in_flight_is_replayed(
    server: TrunkServer,
    client: ClientModel,
    monkeypatch: pytest.MonkeyPatch,
    overlapped: set[int],
    lost_at: int,
) -> None:
    """The server forgets the session when the ``lost_at``-th prompt block arrives (a
    restart): the blocks answered before it are replayed onto a new session, those in flight
    are sent again, and the tokens do not change."""
    with connect_without_eos(server, client) as trunk:
        ref = generate_sequential(SplitRunner(client, trunk), PROMPT, PARAMS, prefill=Prefill(8))
    overlapped.clear()
    real = TrunkServer._step_problem
    seen: list[int] = []

    def problem(self: TrunkServer, s: Any, m: P.Step, *a: Any) -> Any:
        seen.append(m.step)
        if len(seen) == lost_at + 1:
            self._drop(s, "dropped by the test")
            return P.E_UNKNOWN_SESSION, "no such session"
        return real(self, s, m, *a)

    monkeypatch.setattr(TrunkServer, "_step_problem", problem)
    with connect_without_eos(server, client) as trunk:
        runner = SplitRunner(client, trunk)
        got = generate_sequential(runner, PROMPT, PARAMS, prefill=Prefill(8))
        assert got.token_ids == ref.token_ids
        # block j goes out after block j - 3 was answered: from block 3 on, the lost one has
        # answered blocks before it (replayed) and blocks in flight with it
        assert trunk.replays == 1 if lost_at >= 3 else trunk.replays <= 1
    assert lost_at in overlapped
    # the new session computes every step once: 6 prompt blocks and 11 decode steps, in order
    assert seen == [*range(lost_at + 1), *range(6 + PARAMS.max_new_tokens - 1)]


class _Spy:
    """A runner that logs the order in which blocks are started and finished."""

    def __init__(self, runner: SplitRunner) -> None:
        self.runner, self.log = runner, []  # type: list[str]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def start(self, ids: list[int], positions: range) -> Any:
        self.log.append(f"s{positions.start}")
        return self.runner.start(ids, positions)

    def finish(self, f: Any) -> BlockStates:
        self.log.append(f"f{int(f.positions[0])}")
        return self.runner.finish(f)


def _local(folder: Path, k: int, pipelines: bool = True) -> SplitRunner:
    """A runner with the trunk in this process; ``pipelines``: it says, as a trunk behind a
    link does, that its steps may be in flight together."""
    c = load_client(str(folder), k)
    if c.plan.fully_local:
        return SplitRunner(c, None)
    trunk = load_trunk(str(folder), *c.plan.trunk_range)
    trunk.pipelines = pipelines  # type: ignore[attr-defined]
    return SplitRunner(c, trunk)


def test_block_order_progress_and_cancel(folder: Path) -> None:
    spy = _Spy(_local(folder, 1))
    done: list[tuple[int, int]] = []
    prefill = Prefill(16, on_progress=lambda d, n: done.append((d, n)), window=3)
    assert _finals(spy, prefill) is not None
    # block c+1 (and c+2) started before block c is finished; each stack sees blocks in order
    assert spy.log == ["s0", "s16", "s32", "f0", "f16", "f32"]
    assert done == [(16, 45), (32, 45), (45, 45)]

    spy.log.clear()
    cancel = CancelToken()
    stop = Prefill(8, on_progress=lambda d, n: cancel.cancel(), window=3)
    assert _finals(spy, stop, cancel) is None
    # Stop pressed when the first block landed: no block is sent or waited for after it
    assert spy.log == ["s0", "s8", "s16", "f0"]
    # the two blocks dropped in flight left no trace: the caches were reset with them
    again = _finals(spy, Prefill(8, window=3))
    assert again is not None and torch.equal(torch.cat(again), _rows(_local(folder, 1), 8, 3))

    spy.log.clear()
    cancel = CancelToken()  # Stop while the last blocks are taken: the rest are dropped too
    last = Prefill(16, on_progress=lambda d, n: cancel.cancel(), window=3)
    assert _finals(spy, last, cancel) is None
    assert spy.log == ["s0", "s16", "s32", "f0"]

    spy.log.clear()
    _finals(spy, Prefill(16, window=1))
    assert spy.log == ["s0", "f0", "s16", "f16", "s32", "f32"]
    with pytest.raises(GenerationError, match="window"):
        _finals(spy, Prefill(16, window=0))


@pytest.mark.parametrize("k", [1, 2])
def test_without_a_link_blocks_are_read_one_by_one(folder: Path, k: int) -> None:
    """Fully local (k = 2 of 4 layers) or a trunk in this process (which answers at once):
    nothing to overlap, so no block waits in flight (a Stop is as quick as before)."""
    spy = _Spy(_local(folder, k, pipelines=False))
    assert spy.remote == (k == 1)
    _finals(spy, Prefill(16))
    assert spy.log == ["s0", "f0", "s16", "f16", "s32", "f32"]


def test_veil_generate_reads_a_long_prompt_in_blocks_with_a_progress_line(
    folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`veil generate` reads as the app does: a prompt longer than one block is read in
    READ_CHUNK blocks (through a server several in flight), with a progress line on stderr."""
    from app.cli import main as veil
    from app.core.long_message import READ_CHUNK

    started: list[int] = []
    real = SplitRunner.start

    def start(self: SplitRunner, ids: Any, positions: Any, *a: Any) -> Any:
        started.append(len(ids))
        return real(self, ids, positions, *a)

    monkeypatch.setattr(SplitRunner, "start", start)
    words = " ".join(["the"] * (READ_CHUNK + 40))  # more tokens than one block holds
    argv = ["generate", "--model", str(folder), "--local-layers", "2", "--decoder", "sequential"]
    assert veil([*argv, "--prompt", words, "--max-new-tokens", "2", "--json"]) == 0
    out = capsys.readouterr()
    prompt = json.loads(out.out)["prompt_tokens"]
    assert prompt > READ_CHUNK and started[: -(-prompt // READ_CHUNK)] == [
        *[READ_CHUNK] * (prompt // READ_CHUNK),
        *([prompt % READ_CHUNK] if prompt % READ_CHUNK else []),
    ]
    assert "veil: reading the prompt..." in out.err  # (not a terminal: one line per stage)
    started.clear()
    assert veil([*argv, "--prompt", "hi", "--max-new-tokens", "2", "--json"]) == 0
    out = capsys.readouterr()
    assert "reading the prompt" not in out.err  # one block: nothing to show
