"""The tiny organisation-keyed model the keyed tests share: a fixed key, a six-layer Llama
and its keyed trunk (k = 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.keyed.transform import OrgKey
from engine.keyed.trunk import prepare_keyed_trunk
from tests.tiny import make_model

KEY = OrgKey(bytes(range(32)))
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47]


def tiny_model(factory: pytest.TempPathFactory, name: str) -> Path:
    """A six-layer random Llama in a fresh folder."""
    folder = factory.mktemp(name) / "llama6"
    make_model(folder, "llama", seed=3, n_layers=6)
    return folder


def keyed_trunk(folder: Path, factory: pytest.TempPathFactory, name: str) -> Path:
    """The keyed trunk of ``folder`` under :data:`KEY`, one local layer each side."""
    out = factory.mktemp(name) / "trunk"
    prepare_keyed_trunk(str(folder), KEY, 1, out)
    return out
