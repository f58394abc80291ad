"""Privacy audit: attacks are real (beat the prior, known-weights inversion is exact on an easy
case), the audit is deterministic, train/test is split by document, the CLI works, private
weights load and change what the server sees."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from app import cli
from engine.audit import store
from engine.audit.corpus import Document, pii_documents, split_by_document, stdlib_texts
from engine.audit.runner import QUICK, run_audit
from engine.errors import ModelLoadError, SplitError
from tests.tiny import make_model


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("audit") / "tiny"
    make_model(folder, n_layers=4)
    return folder


@pytest.fixture(scope="module")
def audit(tiny: Path) -> dict[str, Any]:
    return run_audit(str(tiny), [1], None, quick=True, save=False, seed=3)  # k=2 of 4: local


def _row(res: dict[str, Any], k: int, attack: str, side: str) -> dict[str, Any]:
    (row,) = [r for r in res["results"] if (r["k"], r["attack"], r["side"]) == (k, attack, side)]
    return row


def test_each_attack_beats_prior_at_k1(audit: dict[str, Any]) -> None:
    prior = _row(audit, 1, "prior", "input")["top1"]
    attacks = {r["attack"] for r in audit["results"] if r["side"] == "input"} - {"prior"}
    assert attacks == {"nearest_embedding", "ridge", "ridge_embedding", "mlp", "known_weights"}
    for a in attacks:
        assert _row(audit, 1, a, "input")["top1"] > prior + 0.2, a
    # output side: reading the model's own greedy reply, and the next token in general
    out_prior = _row(audit, 1, "prior", "output")
    for a in ("public_tail", "logit_lens"):
        assert _row(audit, 1, a, "output")["top1_generated"] > out_prior["top1_generated"], a
    assert _row(audit, 1, "public_tail", "output")["top1_generated"] == 1.0
    assert _row(audit, 1, "ridge", "output")["top1"] > out_prior["top1"]


def test_known_weights_inversion_is_exact_on_easy_case(audit: dict[str, Any]) -> None:
    kw = _row(audit, 1, "known_weights", "input")
    assert kw["top1"] >= 0.95
    assert kw["verified_exact"] >= 0.95
    assert kw["verified_correct"] >= 0.95
    lo, hi = kw["top1_ci"]
    assert lo <= kw["top1"] <= hi


def test_results_schema_and_noise_tradeoff(audit: dict[str, Any]) -> None:
    assert {"model", "date", "results", "noise"} <= set(audit)
    for r in audit["results"]:
        assert {"k", "attack", "side", "top1", "top1_ci", "top5", "pii_top1"} <= set(r)
        assert 0.0 <= r["top1"] <= r["top5"] <= 1.0
    noise = audit["noise"]
    sigmas = sorted({r["sigma"] for r in noise})
    assert sigmas == list(QUICK.noise_sigmas)
    agree = {r["sigma"]: r["greedy_agreement"] for r in noise}
    assert agree[0.0] == 1.0 and agree[sigmas[-1]] < 1.0  # noise costs quality


def test_train_test_split_is_by_document(audit: dict[str, Any]) -> None:
    train, test = set(audit["data"]["train_ids"]), set(audit["data"]["test_ids"])
    assert train and test and not train & test
    docs = [Document(f"s{i}", "stdlib", t) for i, t in enumerate(stdlib_texts(30))]
    docs += pii_documents(30, seed=1)
    docs.append(Document("dup", "pii", docs[-1].text))  # same text under another id
    tr, te = split_by_document(docs, 0.25, seed=1)
    assert {d.doc_id for d in tr}.isdisjoint({d.doc_id for d in te})
    assert {d.text for d in tr}.isdisjoint({d.text for d in te})
    assert {d.source for d in te} == {"stdlib", "pii"}
    _tr2, te2 = split_by_document(docs, 0.25, seed=1)
    assert [d.doc_id for d in te2] == [d.doc_id for d in te]


def test_deterministic_for_a_seed(tiny: Path, audit: dict[str, Any]) -> None:
    again = run_audit(str(tiny), [1], None, quick=True, save=False, seed=3)
    for key in ("results", "noise", "data"):
        assert json.dumps(again[key], sort_keys=True) == json.dumps(audit[key], sort_keys=True)


def test_cli_quick_writes_outputs_and_store(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VEIL_DATA_DIR", str(tmp_path / "data"))
    out = tmp_path / "out"
    rc = cli.main(["audit", "--model", str(tiny), "--local-layers", "1", "--out", str(out),
                   "--quick", "--threads", "1"])  # fmt: skip
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert (out / "audit.png").stat().st_size > 1000
    assert "known-weights inversion" in (out / "report.md").read_text()
    latest = store.latest_results(res["model"])
    assert latest is not None and latest["date"] == res["date"]
    wc = store.worst_case(latest, 1)
    assert wc is not None
    assert wc[0] == max(r["top1"] for r in res["results"] if r["k"] == 1)
    assert store.worst_case(latest, 3) is None
    assert store.results_dir(res["model"]).is_relative_to(tmp_path / "data")


def test_a_fully_local_depth_is_never_audited(tiny: Path) -> None:
    """k = L/2 runs every layer here and sends nothing: there is nothing to measure."""
    with pytest.raises(SplitError, match="between 1 and 1") as err:
        run_audit(str(tiny), [1, 2], None, quick=True, save=False)
    assert "nothing is sent" in str(err.value)


@pytest.mark.parametrize("ks", ["0", "1,x", "9", "2"])
def test_cli_bad_depths_are_one_line_errors(
    tiny: Path, ks: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["audit", "--model", str(tiny), "--local-layers", ks, "--quick", "--no-store"])
    assert rc != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("veil: error:") and "\n" not in err


def test_store_handles_missing_and_corrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VEIL_DATA_DIR", str(tmp_path))
    assert store.latest_results("nope") is None
    d = store.results_dir("bad/model")
    d.mkdir(parents=True)
    (d / "results.json").write_text("{not json")
    assert store.latest_results("bad/model") is None
    res = {"results": [{"k": 2, "attack": "a", "side": "input", "top1": 0.3},
                       {"k": 2, "attack": "b", "side": "output", "top1": 0.7},
                       {"k": 4, "attack": "c", "side": "input", "top1": 0.9}]}  # fmt: skip
    assert store.worst_case(res, 2) == (0.7, "b (output)")


def test_privatize_overlay_loads_and_changes_activations(tiny: Path, tmp_path: Path) -> None:
    from engine.audit.privatize import privatize
    from engine.split import load_client

    out = tmp_path / "private.safetensors"
    rep = privatize(str(tiny), 1, 1, out, steps=6, lr=1e-3, quick=True)
    assert out.is_file()
    pub, prv = rep["attacks"]["public"], rep["attacks"]["private"]
    assert pub["known_weights"]["verified_exact"] >= 0.95
    assert prv["known_weights"]["verified_exact"] < 0.5  # no longer matches public weights
    assert 0.0 < rep["quality"]["greedy_agreement"] <= 1.0

    public = load_client(str(tiny), 1)
    private = load_client(str(tiny), 1, private_weights=out)
    ids = torch.tensor([5, 17, 42, 99])
    pos = torch.arange(4)
    h_pub = public.head.forward(public.embed(ids), pos)
    h_prv = private.head.forward(private.embed(ids), pos)
    assert not torch.allclose(h_pub, h_prv)
    assert public.trunk_fingerprint() == private.trunk_fingerprint()


def test_private_weights_for_another_model_are_rejected(tiny: Path, tmp_path: Path) -> None:
    from engine.audit.overlay import save_overlay
    from engine.loading import load_config
    from engine.split import SplitPlan, load_client

    other = tmp_path / "other"
    make_model(other, n_layers=2)
    f = tmp_path / "o.safetensors"
    save_overlay(f, {"model.layers.0.input_layernorm.weight": torch.ones(64)},
                 load_config(other), {})  # fmt: skip
    with pytest.raises(ModelLoadError):
        load_client(str(tiny), 1, private_weights=f)
    with pytest.raises(ModelLoadError):
        load_client(str(tiny), 1, private_weights=tmp_path / "missing.safetensors")
    # a private layer 1 must stay local: head 2 is fine, head 1 would send it to the server
    from engine.loading import WeightReader
    from engine.model import layer_tensor_names

    cfg = load_config(tiny)
    layer1 = WeightReader(tiny).read(layer_tensor_names(cfg, 1))
    g = tmp_path / "l1.safetensors"
    save_overlay(g, {n: t * 1.01 for n, t in layer1.items()}, cfg, {})
    client = load_client(str(tiny), 2, private_weights=g)
    with pytest.raises(SplitError):
        client.set_split(SplitPlan.of(4, 1, 1))
    with pytest.raises(SplitError):
        load_client(str(tiny), 1, private_weights=g)
