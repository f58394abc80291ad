"""`veil bench` end to end on a tiny model: a real veil-trunk process behind the WAN emulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli import main
from app.cmd_bench import load_prompts, summarize
from engine import kernels
from engine.errors import VeilError
from tests.tiny import make_model


@pytest.mark.slow
def test_bench_writes_results_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    make_model(model, "llama", seed=7)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "category": "code", "prompt": "def binary_search(items):"})
        + "\n\n"
        + json.dumps({"id": "b", "category": "drafting", "prompt": "The quick brown fox " * 3})
        + "\n",
        encoding="utf-8",
    )
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "--prompts",
            str(prompts),
            "--model",
            str(model),
            "--local-layers",
            "1",
            "--rtt-ms",
            "20",
            "--sweep-rtt",
            "0,20",
            "--max-new-tokens",
            "6",
            "--threads",
            "1",
            "--kernel-threads",
            "1",
            "--out",
            str(out),
        ]
    )
    kernels.set_threads(None)  # the bench sets the process-wide kernel threads
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["model"] and res["rtt_ms"] == 20
    assert res["trunk_threads"] == 1 and res["kernel_threads"] == 1
    assert [p["id"] for p in res["prompts"]] == ["a", "b"]
    for p in res["prompts"]:
        assert set(p) >= {"id", "category", "sequential", "speculative", "identical"}
        for d in ("sequential", "speculative"):
            assert set(p[d]) >= {"token_ids", "round_trips", "decode_tok_s", "ttft_s"}
            assert 1 <= len(p[d]["token_ids"]) <= 6
        assert "tokens_per_round_trip" in p["speculative"]
        assert p["identical"] == (p["sequential"]["token_ids"] == p["speculative"]["token_ids"])
        assert p["identical"]
        # sequential: one round trip per token (the prefill makes the first)
        assert p["sequential"]["round_trips"] == len(p["sequential"]["token_ids"])
    s = res["summary"]
    assert set(s) == {
        *("tokens_per_round_trip", "decode_tok_s", "speedup", "all_identical"),
        "draft_ms_per_round",
        "rows_per_token",
    }
    # trunk rows per committed token: one per token for one-token steps (issue 32)
    assert s["rows_per_token"]["sequential"] == 1.0
    assert s["rows_per_token"]["speculative"] >= 1.0
    assert set(s["tokens_per_round_trip"]) == {"sequential", "speculative"}
    assert s["tokens_per_round_trip"]["sequential"] == 1.0
    assert s["all_identical"] is True
    assert [pt["rtt_ms"] for pt in res["sweep"]] == [20, 0]
    for name in ("tok_s_vs_rtt.png", "tpr_by_category.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    table = capsys.readouterr().out
    assert "speculative" in table and "tokens per round trip" in table


def test_bench_with_rounds_in_flight_reports_them_beside_the_same_decoder_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    make_model(model, "llama", seed=7)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "category": "drafting", "prompt": "one two three " * 4}) + "\n",
        encoding="utf-8",
    )
    out = tmp_path / "out"
    args = ["bench", "--prompts", str(prompts), "--model", str(model), "--local-layers", "1"]
    args += ["--rtt-ms", "5", "--max-new-tokens", "12", "--threads", "1", "--kernel-threads"]
    args += ["1", "--pipeline", "--out", str(out)]
    rc = main(args)
    kernels.set_threads(None)
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    (p,) = res["prompts"]
    assert p["identical"] and p["pipelined"]["token_ids"] == p["sequential"]["token_ids"]
    pipe = p["pipelined"]
    assert 0 <= pipe["pipeline_hits"] <= pipe["pipelined_rounds"]
    assert pipe["tokens_per_round_trip"] == round(len(pipe["token_ids"]) / pipe["round_trips"], 4)
    s = res["summary"]
    assert set(s["decode_tok_s"]) == {"sequential", "speculative", "pipelined"}
    assert s["pipelined"]["rounds_in_flight"] == pipe["pipelined_rounds"]
    assert s["pipelined"]["bets_won"] == pipe["pipeline_hits"]
    assert set(res["model_fit"]) == {"sequential", "speculative", "pipelined"}
    assert "with rounds in flight" in capsys.readouterr().out


def test_summary_is_totals_over_prompts() -> None:
    def dec(n: int, rts: int, s: float) -> dict[str, object]:
        return {"token_ids": list(range(n)), "round_trips": rts, "decode_s": s}

    rows = [
        {"sequential": dec(10, 10, 1.0), "speculative": dec(10, 4, 0.5), "identical": True},
        {"sequential": dec(4, 4, 0.3), "speculative": dec(4, 3, 0.3), "identical": False},
    ]
    s = summarize(rows)
    assert s["tokens_per_round_trip"] == {"sequential": 1.0, "speculative": 2.0}
    assert s["decode_tok_s"] == {"sequential": 9.231, "speculative": 15.0}
    assert s["speedup"] == round(15.0 / 9.231, 3)
    assert s["all_identical"] is False


@pytest.mark.parametrize(
    ("text", "msg"),
    [
        ("not json\n", "not valid JSON"),
        ('{"id": "x"}\n', 'non-empty "prompt"'),
        ('{"id": "x", "prompt": "a"}\n{"id": "x", "prompt": "b"}\n', "duplicate id"),
        ("\n", "no prompts"),
    ],
)
def test_bad_prompts_file_is_one_clear_error(tmp_path: Path, text: str, msg: str) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(VeilError, match=msg):
        load_prompts(str(f))
    with pytest.raises(VeilError, match="cannot read"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_bench_cli_reports_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["bench", "--prompts", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert err.startswith("veil: error: cannot read the prompts file") and "\n" not in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "c", "prompt": "hi"}) + "\n")
    rc = main(["bench", "--prompts", str(prompts), "--kernel-threads", "0", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and err == "veil: error: --kernel-threads must be at least 1"
