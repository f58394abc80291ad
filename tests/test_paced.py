"""Progress for calls that report none (engine.paced) and the one-time GGUF conversion's
progress: a stage that says how long it should take, a bar that moves while transformers
works, never backwards, and reaches its end only when the work is done."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from engine import loading
from engine import paced as paced_module
from engine.paced import PacedProgress, about, paced_fraction
from engine.quant.gguf import GGUFFile


def test_paced_fraction_and_labels() -> None:
    assert paced_fraction(0, 10) == 0 and paced_fraction(5, 10) == pytest.approx(0.45)
    assert paced_fraction(10, 10) == pytest.approx(0.9)
    late = [paced_fraction(t, 10) for t in (11, 20, 60, 600)]
    assert late == sorted(late) and all(0.9 < f < 1.0 for f in late)
    assert [about(s) for s in (1, 12, 54, 61, 150)] == [
        "about 5 s",
        "about 10 s",
        "about 55 s",
        "about 1 min",
        "about 2 min",
    ]


class Recorder:
    """A progress callback that lets a test wait for the ticker's reports."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []
        self.cv = threading.Condition()

    def __call__(self, stage: str, fraction: float) -> None:
        with self.cv:
            self.seen.append((stage, fraction))
            self.cv.notify_all()

    def wait_for(self, n: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.seen) >= n, timeout=60)


def test_a_step_reports_while_its_block_runs() -> None:
    rec = Recorder()
    paced = PacedProgress(rec, "working", tick_s=0.01)
    with paced.step(0.2, 0.6, estimate_s=0.05):
        rec.wait_for(4)  # start + three ticks, whatever the machine's speed
    fractions = [f for _, f in rec.seen]
    assert fractions[0] == 0.2 and fractions[-1] == 0.6  # the end only when the block ended
    assert fractions == sorted(fractions) and all(0.2 <= f < 0.6 for f in fractions[:-1])
    assert {s for s, _ in rec.seen} == {"working"} and paced.last_s > 0


def test_a_failing_step_stops_its_ticker() -> None:
    rec = Recorder()
    paced = PacedProgress(rec, "working", tick_s=0.01)
    with pytest.raises(RuntimeError), paced.step(0.0, 1.0, 1.0):
        rec.wait_for(2)
        raise RuntimeError("boom")
    n = len(rec.seen)
    assert all(f < 1.0 for _, f in rec.seen)  # never reported done
    names = [t.name for t in threading.enumerate()]
    assert "veil-progress" not in names and len(rec.seen) == n


def test_conversion_reports_an_estimate_and_moves_while_transformers_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, default_model_folder: Path
) -> None:
    """transformers' two slow calls (config, tokenizer) stand in for themselves here, each
    waiting until the bar moved at least twice during it."""
    import transformers

    gguf = loading.embedded_gguf()
    header = GGUFFile(gguf)
    items = header.array_items
    header.close()
    assert items > 100_000  # SmolLM2: 49k vocabulary entries, their types and the merges
    rec = Recorder()
    monkeypatch.setattr(paced_module, "TICK_S", 0.01)
    real_cfg = transformers.AutoConfig.from_pretrained
    real_tok = transformers.AutoTokenizer.from_pretrained

    def slow(real: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            before = len(rec.seen)
            rec.wait_for(before + 2)
            return real(str(default_model_folder))

        return call

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", slow(real_cfg))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", slow(real_tok))
    out = tmp_path / "out"
    out.mkdir()
    loading._convert_gguf(gguf, out, rec)
    stages = {s for s, _ in rec.seen}
    assert stages == {f"converting model (one-time, {about(loading.conversion_estimate(items))})"}
    fractions = [f for _, f in rec.seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert sum(0.0 < f < 0.5 for f in fractions) >= 2  # moved while the config was read
    assert sum(0.5 < f < 0.97 for f in fractions) >= 2  # ... and while the tokenizer was built
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
