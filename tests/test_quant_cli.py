"""The command line around quantized clients: `veil generate --client-quant/--dtype`,
`veil bench client`, `veil-trunk serve --quant`, and their one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli import main
from tests.test_engine_loading import assert_one_line_error, veil


def test_generate_reports_dtype_and_client_quant(tiny_llama: Path, tmp_path: Path) -> None:
    env = {"VEIL_CACHE_DIR": str(tmp_path / "cache")}
    common = ["generate", "--prompt", "The quick", "--model", str(tiny_llama), "--json"]
    common += ["--local-layers", "1", "--max-new-tokens", "6", "--decoder", "sequential"]
    plain = json.loads(veil(*common, env=env).stdout)
    assert plain["dtype"] == "float32" and plain["client_quant"] == "none"  # auto, safetensors
    proc = veil(*common, "--client-quant", "int4", "--dtype", "float32", env=env)
    assert proc.returncode == 0, proc.stderr
    q = json.loads(proc.stdout)
    assert q["client_quant"] == "int4" and q["int8_activations"] is True  # the default
    assert q["local_param_bytes"] < plain["local_param_bytes"] / 3
    exact = veil(*common, "--client-quant", "int4", "--exact-float", env=env)
    assert exact.returncode == 0, exact.stderr
    assert json.loads(exact.stdout)["int8_activations"] is False
    assert_one_line_error(veil(*common, "--client-quant", "int3", env=env), "invalid choice")
    assert_one_line_error(veil(*common, "--dtype", "float8", env=env), "dtype")


def test_bench_client_json_and_errors(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "client.json"
    args = ["bench", "client", "--shape", str(tiny_llama), "--local-layers", "1"]
    args += ["--rows", "1,3", "--formats", "f32,q8_0,q4_1,int8", "--repeats", "1"]
    assert main([*args, "--int8-activations", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["shape"] == str(tiny_llama) and res["local_layers"] == 1
    got = {(r["format"], r["rows"]) for r in res["results"]}
    want = {
        (f, n)
        for f in ("f32", "q8_0", "q4_1", "int8", "q8_0+i8a", "q4_1+i8a", "int8+i8a")
        for n in (1, 3)
    }
    assert got == want
    sizes = {r["format"]: r["bytes_read"] for r in res["results"]}
    assert sizes["q4_1"] < sizes["q8_0"] < sizes["f32"] and sizes["int8"] < sizes["f32"]
    assert all(r["ms_per_round"] > 0 for r in res["results"])
    capsys.readouterr()
    for bad, needle in (
        (["--rows", "0"], "--rows"),
        (["--formats", "q3_x"], "unknown format"),
        (["--local-layers", "9"], "local-layers"),
    ):
        assert main(["bench", "client", "--shape", str(tiny_llama), *bad]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_bench_client_real_weights(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VEIL_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "real.json"
    args = ["bench", "client", "--shape", str(tiny_llama), "--real", "--local-layers", "1"]
    assert main([*args, "--rows", "2", "--repeats", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["format"] for r in res["results"]] == ["auto", "none", "int8", "int4"]


def test_trunk_serve_quant_flag_parses() -> None:
    from remote.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "m", "--quant", "int8"])
    assert args.quant == "int8" and args.dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--quant", "q3"])
