"""Shared fixtures: tiny random-weight models per family and the real default model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _isolated_user_dirs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """User data (conversations, audits, settings) and the app's log go to temp dirs, never
    the real ones.

    The model cache (VEIL_CACHE_DIR) is left alone so the default model converts once per
    machine, as it would for a user.
    """
    os.environ["VEIL_DATA_DIR"] = str(tmp_path_factory.mktemp("veil-data"))
    os.environ["VEIL_LOG_DIR"] = str(tmp_path_factory.mktemp("veil-log"))
    # client parts a test server makes (remote/delivery.py) stay out of the user cache
    os.environ["VEIL_TRUNK_PARTS"] = str(tmp_path_factory.mktemp("veil-trunk-parts"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> folder of a saved tiny model (4 layers; Gemma: sliding layers 0, 2, 3)."""
    from tests.tiny import make_model

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for seed, fam in enumerate(
        ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3", "gemma2")
    ):
        make_model(root / fam, fam, seed=seed)
        out[fam] = root / fam
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def default_model_folder() -> Path:
    """The embedded default model, converted into the user cache on first use."""
    from engine.loading import DEFAULT_MODEL, resolve

    return resolve(DEFAULT_MODEL).folder


@pytest.fixture
def exact_float() -> Iterator[None]:
    """Quantized weights multiplied with float activations (``--exact-float``): the arithmetic
    of the dequantized model, for tests that compare with transformers' float reference."""
    from engine import kernels

    was = kernels.int8_activations()
    kernels.set_int8_activations(False)
    yield
    kernels.set_int8_activations(was)
