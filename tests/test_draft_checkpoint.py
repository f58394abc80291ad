"""`veil train-draft --resume`: the checkpoint cannot run code, and resuming is exact.

A work folder may come from anywhere, so its checkpoint is a safetensors file whose numbers and
settings are JSON; a pickled checkpoint of an older Veil is refused, unread, in one line (a crafted
one would have run code). A run interrupted after a checkpoint and resumed writes the same head,
bit for bit, as the run that was never interrupted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.drafts import checkpoint as ckpt
from engine.drafts import pipeline
from engine.drafts.pipeline import DraftTrainOptions, train_draft
from tests.tiny import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt-model") / "llama"
    make_model(folder, "llama", seed=71)
    return folder


def _opts(work: Path, resume: bool) -> DraftTrainOptions:
    return DraftTrainOptions(
        tokens=1200,
        steps=24,
        resume=resume,
        local_layers=1,
        vocab_size=160,
        gen_batch=16,
        reply_tokens=40,
        work_dir=work,
        heldout=0.2,
    )


def _head_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


class Stop(Exception):
    """The interruption: the process dies right after a checkpoint."""


def test_a_resumed_run_writes_the_same_head_as_an_uninterrupted_one(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    whole = train_draft(str(model), tmp_path / "whole.safetensors", _opts(work, False))
    assert whole["train_steps"] == 24
    assert not (work / ckpt.FILE).exists()  # a finished run leaves no checkpoint

    real = pipeline.train_head
    seen: list[int] = []

    def interrupted(*args: Any, **kw: Any) -> Any:
        args[4].checkpoint_s = 0.0  # TrainOptions: a checkpoint after every step
        save = kw["checkpoint"]

        def checkpoint(net: torch.nn.Module, state: dict[str, Any]) -> None:
            save(net, state)
            seen.append(int(state["step"]))
            if state["step"] == 9:
                raise Stop

        return real(*args, **{**kw, "checkpoint": checkpoint})

    monkeypatch.setattr(pipeline, "train_head", interrupted)
    with pytest.raises(Stop):  # same data (resume keeps it), killed after step 9
        train_draft(str(model), tmp_path / "cut.safetensors", _opts(work, True))
    assert seen == list(range(1, 10)) and (work / ckpt.FILE).is_file()
    monkeypatch.setattr(pipeline, "train_head", real)

    resumed = train_draft(str(model), tmp_path / "resumed.safetensors", _opts(work, True))
    assert resumed["train_steps"] == 24
    a, b = (
        _head_tensors(tmp_path / "whole.safetensors"),
        _head_tensors(tmp_path / "resumed.safetensors"),
    )
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_the_checkpoint_round_trips_the_optimizer_exactly(tmp_path: Path) -> None:
    net = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95))
    for _ in range(2):
        net(torch.ones(2, 4)).sum().backward()
        opt.step()
    state = {"optimizer": opt.state_dict(), "step": 2, "rng": {"cpu": torch.get_rng_state()}}
    ckpt.save(tmp_path, net, {**state, "wall_s": 1.5}, torch.arange(7))
    loaded = ckpt.load(tmp_path)
    assert loaded is not None
    weights, back, vocab = loaded
    assert torch.equal(vocab, torch.arange(7)) and back["step"] == 2 and back["wall_s"] == 1.5
    assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())
    sd = back["optimizer"]
    assert sd["param_groups"] == opt.state_dict()["param_groups"]  # betas stay a tuple
    assert list(sd["state"]) == [0, 1]  # int keys stay ints
    for i, s in opt.state_dict()["state"].items():
        assert all(torch.equal(s[k], sd["state"][i][k]) for k in s)
    torch.optim.AdamW(net.parameters()).load_state_dict(sd)
    assert torch.equal(back["rng"]["cpu"], state["rng"]["cpu"])


class _Evil:
    """Unpickling this makes a folder: what a hostile checkpoint.pt would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def test_a_pickled_checkpoint_is_refused_without_running_it(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main

    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "ran"
    torch.save(
        {"net": _Evil(marker), "state": {}, "vocab": torch.arange(3)}, work / "checkpoint.pt"
    )
    argv = ["train-draft", "--model", str(model), "--out", str(tmp_path / "h.safetensors")]
    argv += ["--resume", "--work-dir", str(work), "--tokens", "300", "--steps", "2"]
    argv += ["--local-layers", "1", "--vocab", "0"]
    code = main(argv)
    assert not marker.exists()  # the pickle was never run
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint.pt" in err[0] and "--resume" in err[0], err
    assert not (work / "manifest.json").exists()  # refused before any data was made


@pytest.mark.parametrize(
    "content",
    [
        b"\xff" * 64,  # not safetensors at all
        None,  # a safetensors file that is not a training checkpoint
    ],
)
def test_a_damaged_checkpoint_is_one_clear_error(content: bytes | None, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / ckpt.FILE
    if content is None:
        save_file({"x": torch.zeros(2)}, str(path), metadata={"format": "something else"})
    else:
        path.write_bytes(content)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load(tmp_path)
    assert "\n" not in str(err.value) and "--resume" in str(err.value)
