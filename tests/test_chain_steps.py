"""A long prompt's protocol steps travel with several in flight (engine/transport/steps.py):
the same rows as one step at a time, and a refusal or a lost session in the middle of the
pipeline ends in the same result, not an error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import protocol as P
from engine.generate import generate
from engine.sampling import SamplingParams
from engine.split import ClientModel, SplitRunner, load_client
from engine.transport import RemoteTrunk, connect_trunk
from engine.transport import steps as chain
from remote.server import TrunkServer
from tests.inproc_trunk import CLIENT_KEYS, SERVER_KEYS, trunk_in_thread
from tests.tiny import make_model

ROWS = 44  # the prompt: 6 steps of 8 rows (the last one 4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("chain") / "llama4"
    make_model(f, "llama", seed=4, n_layers=4)
    return f


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[TrunkServer]:
    with trunk_in_thread(folder, max_sessions=8, max_sessions_per_client=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(folder: Path) -> ClientModel:
    return load_client(str(folder), 1)


def connect(srv: TrunkServer, client: ClientModel, chunk_rows: int) -> RemoteTrunk:
    trunk = connect_trunk(
        srv.address, client, server_key=SERVER_KEYS[0], client_keys=CLIENT_KEYS, heartbeat_s=0.2
    )
    trunk.chunk_rows = chunk_rows
    return trunk


def prompt(client: ClientModel) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(ROWS, client.config.hidden_size, generator=g), torch.arange(ROWS)


def one_step_result(srv: TrunkServer, client: ClientModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt as one protocol step, then one decode row: the reference."""
    hidden, pos = prompt(client)
    with connect(srv, client, chunk_rows=512) as trunk:
        out = trunk.forward(hidden, pos)
        nxt = trunk.forward(hidden[:1], torch.tensor([ROWS]))
        assert trunk.chained_steps == 0
    return out, nxt


def test_chained_steps_give_the_rows_of_one_step(server: TrunkServer, client: ClientModel) -> None:
    want, want_next = one_step_result(server, client)
    hidden, pos = prompt(client)
    with connect(server, client, chunk_rows=8) as trunk:
        got = trunk.forward(hidden, pos)
        assert trunk.chained_steps == 6 and trunk.round_trips == 6 and len(trunk.journal) == 6
        assert torch.equal(got, want)
        assert torch.equal(trunk.forward(hidden[:1], torch.tensor([ROWS])), want_next)
        assert trunk.replays == 0


def test_greedy_tokens_with_chained_prompt_steps(server: TrunkServer, client: ClientModel) -> None:
    ids = [1, *range(20, 60)]  # 41 tokens: 6 steps of 8 rows
    params = SamplingParams(max_new_tokens=8)
    with connect(server, client, chunk_rows=512) as trunk:
        want = generate(SplitRunner(client, trunk), ids, params).token_ids
    with connect(server, client, chunk_rows=8) as trunk:
        got = generate(SplitRunner(client, trunk), ids, params).token_ids
        assert trunk.chained_steps == 6
    assert got == want


@pytest.mark.parametrize("refused", [1, 3, 5])
def test_a_step_refused_in_flight_is_sent_again_in_turn(
    server: TrunkServer, client: ClientModel, monkeypatch: pytest.MonkeyPatch, refused: int
) -> None:
    """The server refuses the chain's ``refused``-th step once (busy): the steps after it are
    refused as out of order, and the client resumes at it on the same session."""
    want, want_next = one_step_result(server, client)
    real = TrunkServer._step_problem
    seen: list[int] = []

    def problem(self: TrunkServer, s: Any, m: P.Step, *a: Any) -> Any:
        seen.append(m.step)
        if len(seen) == refused + 1:
            return P.E_BUSY, "server busy: test"
        return real(self, s, m, *a)

    monkeypatch.setattr(TrunkServer, "_step_problem", problem)
    hidden, pos = prompt(client)
    with connect(server, client, chunk_rows=8) as trunk:
        sid = trunk.session
        got = trunk.forward(hidden, pos)
        assert torch.equal(got, want)
        assert trunk.session == sid and trunk.replays == 0  # no new session, nothing replayed
        assert trunk.chained_steps == refused and len(trunk.journal) == 6
        # no late refusal of the pipeline reaches the next step
        assert torch.equal(trunk.forward(hidden[:1], torch.tensor([ROWS])), want_next)


@pytest.mark.parametrize("lost_at", [0, 2, 4])
def test_a_session_lost_in_flight_is_reopened_and_replayed(
    server: TrunkServer, client: ClientModel, monkeypatch: pytest.MonkeyPatch, lost_at: int
) -> None:
    """The server forgets the session when the chain's ``lost_at``-th step arrives (a restart):
    the client reopens one, replays the steps whose results it has, and goes on."""
    want, want_next = one_step_result(server, client)
    real = TrunkServer._step_problem
    seen: list[int] = []
    dropped: list[str] = []

    def problem(self: TrunkServer, s: Any, m: P.Step, *a: Any) -> Any:
        seen.append(m.step)
        if len(seen) == lost_at + 1:
            dropped.append(s.sid)
            self._drop(s, "dropped by the test")
            return P.E_UNKNOWN_SESSION, "no such session"
        return real(self, s, m, *a)

    monkeypatch.setattr(TrunkServer, "_step_problem", problem)
    hidden, pos = prompt(client)
    with connect(server, client, chunk_rows=8) as trunk:
        got = trunk.forward(hidden, pos)
        assert torch.equal(got, want)
        # the results of the steps before the loss may or may not have left the server
        assert trunk.chained_steps <= lost_at and len(trunk.journal) == 6
        assert trunk.replays == (1 if trunk.chained_steps else 0)  # (replays what came back)
        assert trunk.session is not None and trunk.session not in dropped
        assert torch.equal(trunk.forward(hidden[:1], torch.tensor([ROWS])), want_next)


def test_the_window_is_what_the_server_accepts() -> None:
    from remote.server import MAX_IN_FLIGHT

    assert 1 < chain.CHAIN_WINDOW <= MAX_IN_FLIGHT
