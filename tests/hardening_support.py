"""What the hardening tests share: quick client timeouts and the 8k-context tiny model."""

from __future__ import annotations

from pathlib import Path

from tests.tiny import make_model

REPO = Path(__file__).resolve().parent.parent
FAST = {
    "timeout_s": 1.0,
    "heartbeat_s": 0.1,
    "reconnect_s": 5.0,
    "connect_timeout_s": 5.0,
    "step_timeout_s": 3.0,
}


def make_tiny_8k(folder: Path) -> Path:
    """6 layers and an 8k context, so prompts longer than one 4,096-row block fit."""
    make_model(folder, "llama", seed=5, n_layers=6, max_position_embeddings=8192)
    return folder
