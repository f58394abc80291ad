"""Attacks that know the keyed scheme (engine/keyed/attacks.py) and the keyed audit: on a tiny
noise-free keyed model the secret rotation is recovered from the weights, tokens are recovered
without it, the attacker code never sees the key, noise degrades the alignment, and the keyed
audit stores its results with the schema the app reads."""

from __future__ import annotations

import inspect
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from app import cli
from engine.audit import store
from engine.audit.collect import AuditModel
from engine.audit.keyed import run_keyed_audit
from engine.audit.runner import QUICK, run_audit
from engine.keyed import attacks as KA
from engine.keyed import audit_name
from engine.keyed.transform import OrgKey, derive, key_layers
from engine.keyed.trunk import public_model_fp
from engine.loading import WeightReader, resolve

KEY = OrgKey(bytes(range(32)))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def am(tiny_models: dict[str, Path]) -> AuditModel:
    return AuditModel(resolve(str(tiny_models["llama"])))


def _keyed(am: AuditModel, noise: float) -> tuple[Any, list[Any], list[Any]]:
    pub = [am.layers[i] for i in range(1, 3)]
    t = derive(KEY, am.config, "fp", 1, 3, noise)
    return t, pub, key_layers(pub, am.config, t, KEY, "fp")


def test_weight_alignment_recovers_q_exactly_without_noise(am: AuditModel) -> None:
    t, pub, keyed = _keyed(am, 0.0)
    al = KA.align_weights(pub, keyed, am.config)
    assert KA.rotation_error(al.q_hat, t.q) < 1e-5
    assert al.matched_agreement == 1.0
    assert KA.rotation_error(KA.gram_eigen(pub, keyed, am.config), t.q) < 1e-5
    # an unrelated orthogonal matrix is far off: the measure can fail
    other = derive(OrgKey(bytes(32)), am.config, "fp", 1, 3)
    assert KA.rotation_error(other.q, t.q) > 1.0


def test_noise_degrades_the_alignment_measurably(am: AuditModel) -> None:
    errs = []
    for noise in (0.0, 0.03, 0.3):
        t, pub, keyed = _keyed(am, noise)
        errs.append(KA.rotation_error(KA.align_weights(pub, keyed, am.config).q_hat, t.q))
    assert errs[0] < 1e-5 < errs[1] < errs[2]
    assert errs[1] > 1e3 * errs[0]
    assert errs[2] < 0.5  # still far better than an unrelated rotation (~1.4)


def test_procrustes_and_distribution_matching_recover_q(am: AuditModel) -> None:
    t, _, _ = _keyed(am, 0.0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, am.config.vocab_size, (300,), generator=gen)
    x = am.states(ids.tolist(), [1], logits=False)[1].double()  # [300, H] public head output
    obs = x @ t.q
    assert KA.rotation_error(KA.procrustes(x, obs), t.q) < 1e-6
    # the same states in another order: only their distribution is shared
    shuffled = obs[torch.randperm(len(obs), generator=gen)]
    assert KA.rotation_error(KA.distribution_match(x, shuffled), t.q) < 1e-4
    # too few known pairs leave most of q undetermined
    assert KA.rotation_error(KA.procrustes(x[:8], obs[:8]), t.q) > 0.5


def test_vocabulary_matching_recovers_tokens_without_q(am: AuditModel) -> None:
    t, _, _ = _keyed(am, 0.0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, am.config.vocab_size, (12,), generator=gen)
    sent = t.rotate_in(am.states(ids.tolist(), [1], logits=False)[1])  # what the trunk sees
    order = list(range(am.config.vocab_size))
    res = KA.vocabulary_match(am.stack(0, 1), am.embed_weight, sent, lambda _t: order, (64, 512))
    assert torch.equal(res.top5[:, 0], ids)
    assert bool(res.verified.all())


def test_attacker_functions_never_take_the_key() -> None:
    src = inspect.getsource(KA)
    assert "from engine.keyed.transform" not in src and "import engine.keyed" not in src
    assert not any(
        getattr(v, "__module__", "") == "engine.keyed.transform" for v in vars(KA).values()
    )
    for name, fn in inspect.getmembers(KA, inspect.isfunction):
        if fn.__module__ != KA.__name__ or name == "rotation_error":
            continue
        params = inspect.signature(fn).parameters
        assert not {"key", "transform", "q"} & set(params), name
        assert "OrgKey" not in str(fn.__annotations__) and "KeyedTransform" not in str(
            fn.__annotations__
        )


TINY_AUDIT = replace(QUICK, n_stdlib=8, n_pii=8, n_generated=2, sipit_docs=2, quality_docs=2)


@pytest.fixture(scope="module")
def keyed_res(tiny_models: dict[str, Path]) -> dict[str, Any]:
    folder = str(tiny_models["llama"])
    return run_keyed_audit(
        folder, [1], KEY, None, [0.0, 0.1], settings=TINY_AUDIT, seed=0, quick=True
    )


def test_keyed_audit_stores_results_with_the_schema(
    tiny_models: dict[str, Path], keyed_res: dict[str, Any]
) -> None:
    folder = str(tiny_models["llama"])
    res = keyed_res
    name = audit_name(resolve(folder).name, KEY.key_id)
    got = store.latest_results(name)
    assert got is not None and got["model"] == name == res["model"]
    assert got["keyed"] is True and got["key_id"] == KEY.key_id and got["noise"] == [0.0, 0.1]
    # the transform measured is the one `keyed-model prepare` deploys for this model
    assert got["model_fp"] == public_model_fp(WeightReader(resolve(folder).folder))
    assert {(q["k"], q["noise"]) for q in got["quality"]} == {(1, 0.0), (1, 0.1)}
    assert got["quality"][0]["greedy_agreement"] == 1.0  # noise 0: the same function
    for row in got["results"]:
        assert {"k", "attack", "side", "top1", "top1_ci", "top5", "pii_top1", "noise"} <= set(row)
    rows = {(r["attack"], r["side"], r["noise"]): r for r in got["results"]}
    wa = rows[("weight_alignment+known_weights", "input", 0.0)]
    assert wa["rotation_error"] < 1e-5 and wa["top1"] == 1.0
    assert len(got["best"]) == 4  # per noise level and side
    assert store.worst_case(got, 1) is not None


ESTIMATES = ("weight_alignment", "gram_eigen", "known_plaintext", "distribution_match")


def test_keyed_audit_runs_the_plain_audits_attacks_after_every_estimate(
    tiny_models: dict[str, Path], keyed_res: dict[str, Any]
) -> None:
    """Each estimate of q is followed by the plain audit's attacks on the sides the plain audit
    runs them (named "<estimate>+<plain name>"); the prior needs no q; `best` is the top row
    over all of them."""
    folder = str(tiny_models["llama"])
    plain = run_audit(folder, [1], None, settings=TINY_AUDIT, seed=0, quick=True, save=False)
    plain_sides = {(r["attack"], r["side"]) for r in plain["results"]}
    assert len({a for a, _ in plain_sides}) == 8  # today's eight
    res = keyed_res
    for s in res["noise"]:
        got = {(r["attack"], r["side"]) for r in res["results"] if r["noise"] == s}
        assert {("prior", "input"), ("prior", "output")} <= got
        for e in ESTIMATES:
            follow = {(a[len(e) + 1 :], side) for a, side in got if a.startswith(e + "+")}
            assert follow == plain_sides - {("prior", "input"), ("prior", "output")}, (e, s)
    # noise 0: weight alignment recovers q exactly, so its follow-ups read what the plain
    # audit's attacks read from the unkeyed states (same corpus, split, seed and decoders)
    plain_top1 = {(r["attack"], r["side"]): r["top1"] for r in plain["results"]}
    for r in res["results"]:
        if r["noise"] == 0.0 and r["attack"].startswith("weight_alignment+"):
            a = r["attack"].split("+", 1)[1]
            assert r["top1"] == pytest.approx(plain_top1[(a, r["side"])], abs=0.02), a
        if r["attack"] == "prior":
            assert r["top1"] == plain_top1[("prior", r["side"])]
    for b in res["best"]:
        rows = [
            r
            for r in res["results"]
            if (r["k"], r["noise"], r["side"]) == (b["k"], b["noise"], b["side"])
        ]
        assert b["top1"] == max(r["top1"] for r in rows)
        assert b["attack"] in {r["attack"] for r in rows}
    # here (tiny model, k = 1) nearest embedding on the turned-back states already reads every
    # token: the first row to reach the top is the one `best` names
    top_in = next(b for b in res["best"] if (b["noise"], b["side"]) == (0.0, "input"))
    assert top_in["attack"] == "weight_alignment+nearest_embedding" and top_in["top1"] == 1.0


def test_cli_keyed_noise_without_a_key_is_a_one_line_error(
    tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = str(tiny_models["llama"])
    rc = cli.main(["audit", "--model", folder, "--local-layers", "1", "--keyed-noise", "0.1"])
    assert rc != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("veil: error:") and "\n" not in err and "--org-key" in err


def test_cli_unreadable_key_is_a_one_line_error(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    folder = str(tiny_models["llama"])
    rc = cli.main(["audit", "--model", folder, "--local-layers", "1", "--org-key", str(bad)])
    assert rc != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("veil: error:") and "\n" not in err and "organisation key" in err
