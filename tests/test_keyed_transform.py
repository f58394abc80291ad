"""The keyed trunk computes the plain trunk's function in a secret basis; the key's files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.keyed.transform import KeyedError, OrgKey, derive, key_layers
from engine.loading import load_config, resolve
from engine.model import LayerStack
from engine.split import load_trunk

KEY = OrgKey(bytes(range(32)))


@pytest.mark.parametrize("family", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_the_keyed_trunk_computes_the_plain_function_in_the_secret_basis(
    tiny_models: dict[str, Path], family: str
) -> None:
    r = resolve(str(tiny_models[family]))
    cfg = load_config(r.folder)
    plain = load_trunk(r, 1, 3, quant="none").stack
    t = derive(KEY, cfg, "fp", 1, 3)
    keyed = LayerStack(cfg, 1, key_layers(plain.layers, cfg, t, KEY, "fp"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, cfg.hidden_size, generator=gen)  # [7, H]
    pos = torch.arange(7)
    sent = t.rotate_in(x)
    assert (sent - x).abs().max() > 0.1  # what crosses the wire is not the head output
    a = plain.forward(x, pos)
    b = t.rotate_out(keyed.forward(sent, pos))
    torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
    # a tree block on top of the cached prefix (speculation's verify step)
    tree_pos, parents = torch.tensor([7, 8, 8]), [-1, 0, 0]
    a = plain.forward(x[:3], tree_pos, parents)
    b = t.rotate_out(keyed.forward(t.rotate_in(x[:3]), tree_pos, parents))
    torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
    # the keyed weights differ from the public ones everywhere they could be compared
    for pw, kw in zip(plain.layers, keyed.layers, strict=True):
        assert not torch.allclose(pw.wgu, kw.wgu, atol=1e-3)
        assert torch.all(kw.ln1 == 1) and torch.all(kw.ln2 == 1)


def test_the_transform_is_a_function_of_key_and_model(tiny_models: dict[str, Path]) -> None:
    cfg = load_config(resolve(str(tiny_models["llama"])).folder)
    a, b = derive(KEY, cfg, "fp", 1, 3), derive(KEY, cfg, "fp", 1, 3)
    assert torch.equal(a.q, b.q) and torch.equal(a.layers[1].mlp_perm, b.layers[1].mlp_perm)
    other_model = derive(KEY, cfg, "other", 1, 3)
    other_key = derive(OrgKey(bytes(32)), cfg, "fp", 1, 3)
    assert not torch.allclose(a.q, other_model.q) and not torch.allclose(a.q, other_key.q)
    eye = torch.eye(cfg.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(a.q @ a.q.T, eye)
    assert a.key_id == KEY.key_id and len(a.key_id) == 16 and a.key_id != other_key.key_id


def test_a_gemma_model_is_refused_in_one_line(tiny_models: dict[str, Path]) -> None:
    cfg = load_config(resolve(str(tiny_models["gemma3"])).folder)
    with pytest.raises(KeyedError, match="not available for this model family"):
        derive(KEY, cfg, "fp", 1, 3)


def test_key_files_round_trip_and_damaged_ones_are_named(tmp_path: Path) -> None:
    path = tmp_path / "org.key"
    KEY.save(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert OrgKey.load(path) == KEY
    with pytest.raises(KeyedError, match="already exists"):
        OrgKey.generate().save(path)
    bad = tmp_path / "bad.key"
    for text, msg in [
        ("hello", "not a Veil organisation key"),
        ("veil-org-key-v1 zz", "not hexadecimal"),
        ("veil-org-key-v1 abcd", "has 2 bytes"),
    ]:
        bad.write_text(text)
        with pytest.raises(KeyedError, match=msg):
            OrgKey.load(bad)
    with pytest.raises(KeyedError, match="cannot read"):
        OrgKey.load(tmp_path / "missing.key")
    assert OrgKey.generate() != OrgKey.generate()
