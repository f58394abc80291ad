"""`veil-trunk loadtest` at a small size against a real CURVE server (in a thread, fixed keys)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import protocol as P
from remote.cli import main as trunk_cli
from remote.server import TrunkServer
from tests.inproc_trunk import CLIENT_KEYS, SERVER_KEYS, STRANGER_KEYS, trunk_in_thread
from tests.tiny import make_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("load") / "llama6"
    make_model(f, "llama", seed=4, n_layers=6, max_position_embeddings=2048)
    return f


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[TrunkServer]:
    with trunk_in_thread(folder, max_sessions=8, max_sessions_per_client=8) as srv:
        yield srv


def keyfile(tmp_path: Path, keys: tuple[str, str]) -> Path:
    f = tmp_path / f"client-{keys[0][:6].encode().hex()}.json"
    f.write_text(json.dumps({"public": keys[0], "secret": keys[1]}))
    return f


def invite(srv: TrunkServer) -> str:
    return P.make_invite(srv.address, SERVER_KEYS[0])


def test_loadtest_reports_json_and_png(
    server: TrunkServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    argv = [
        "loadtest",
        "--server",
        invite(server),
        "--client-keys",
        str(keyfile(tmp_path, CLIENT_KEYS)),
        "--clients",
        "1,4",
        "--block-rows",
        "4",
        "--steps",
        "6",
        "--think-ms",
        "5",
        "--prompt-rows",
        "8",
        "--local-layers",
        "1",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    assert trunk_cli(argv) == 0
    report = json.loads(out.read_text())
    assert report["server"]["batching"] is True and report["server"]["max_batch_rows"] == 256
    assert report["server"]["bit_identical"] is True
    runs = report["runs"]
    assert [(r["clients"], r["block_rows"]) for r in runs] == [(1, 4), (4, 4)]
    for r in runs:
        assert r["errors"] == 0 and r["steps"] == 6 * r["clients"]
        assert r["steps_per_s"] > 0 and r["rows_per_s"] == pytest.approx(4 * r["steps_per_s"], 0.01)
        lat = r["latency_ms"]
        assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"]
        assert r["queue_ms_p50"] >= 0
        # 4-row trees whose kept path commits 1 to 4 tokens: 1 to 4 rows per committed token
        assert 1.0 <= r["rows_per_committed_token"] <= 4.0
        load = r["load_p50"]
        assert load["row_ms"] > 0 and load["peers"] >= 0 and 0 <= load["busy"] <= 1
        # the server's batches over the run: every step and prefill row is in there
        hist = {int(k): v for k, v in r["batch_rows_hist"].items()}
        assert sum(k * v for k, v in hist.items()) == r["clients"] * (8 + 6 * 4)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "rows/s" in table and "batching" in table


def test_loadtest_exits_non_zero_when_steps_fail(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three clients against a two-session server: one is refused ('server busy')."""
    with trunk_in_thread(folder, max_sessions=2, max_sessions_per_client=3) as srv:
        argv = [
            "loadtest",
            "--server",
            invite(srv),
            "--client-keys",
            str(keyfile(tmp_path, CLIENT_KEYS)),
            "--clients",
            "3",
            "--steps",
            "2",
            "--think-ms",
            "1",
            "--local-layers",
            "1",
            "--json",
            str(tmp_path / "r.json"),
        ]
        assert trunk_cli(argv) == 1
    run = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert run["errors"] == 1 and any("busy" in m for m in run["error_messages"])
    assert "1 step(s) failed" in capsys.readouterr().err


def test_loadtest_bad_setups_are_one_line(
    server: TrunkServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["loadtest", "--server", invite(server), "--steps", "1", "--timeout", "2"]
    stranger = ["--client-keys", str(keyfile(tmp_path, STRANGER_KEYS))]
    allowed = ["--client-keys", str(keyfile(tmp_path, CLIENT_KEYS))]
    for argv in (
        [*base, *stranger],  # a key the server does not allow: no answer at all
        [*base, *allowed, "--clients", "0"],
        [*base, *allowed, "--block-rows", "x"],
        [*base, *allowed, "--prompt-rows", "5000"],
        [*base, *allowed, "--local-layers", "3"],  # 6 layers: nothing left for the trunk
        ["loadtest", "--clients", "1"],  # no server
    ):
        assert trunk_cli(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err and err[-1].startswith("veil-trunk: error: "), err


def test_serve_batching_and_device_flags_are_checked(
    folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["serve", "--model", str(folder), "--insecure", "--bind", "tcp://127.0.0.1:5999"]
    for extra, message in (
        (["--max-batch-rows", "0"], "at least 1"),
        (["--prefill-chunk", "-5"], "at least 1"),
        (["--stage-layers", "2,2"], "needs --devices"),
        (["--devices", "cpu,cpu", "--stage-layers", "2,x"], "whole numbers"),
        (["--devices", "cpu,cpu", "--stage-layers", "3,3"], "add up to the 4 served layers"),
        (["--devices", "cpu,tpu"], "unknown device 'tpu'"),
        (["--devices", "cpu,,cpu"], "comma-separated"),
        (["--devices", "cpu,cpu,cpu,cpu,cpu"], "5 devices but only 4 trunk layers"),
    ):
        assert trunk_cli([*base, *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("veil-trunk: error: ") and message in err[-1], (extra, err)
