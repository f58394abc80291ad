"""Switching models in the app (issue 35): after a switch to a model that cannot be opened the
privacy panel stops describing the previous model, and comes back right with a good one; long
stages (a model's one-time conversion) show the time left. pytest-qt, offscreen, tiny model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from app.progress import Eta
from tests.gui_support import local_window
from tests.test_gui_app import WAIT_MS, tiny  # noqa: F401

pytestmark = pytest.mark.gui


def test_privacy_panel_after_a_failed_model_switch(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    w = local_window(qtbot, tiny, tmp_path, k=2)
    p = w.privacy
    assert p.slider.isEnabled() and "4 of 6 layers" in p.summary.text()
    memory = p.memory.text()
    assert memory != "-"
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    s = w.app.settings
    w.apply_settings(type(s)(**{**vars(s), "model": str(other)}))
    qtbot.waitUntil(lambda: w.chat_view.error.isVisible(), timeout=WAIT_MS)
    assert "not supported" in w.chat_view.error.text()
    # no model is in use now: nothing of the 6-layer model stays on the panel
    qtbot.waitUntil(lambda: not p.slider.isEnabled(), timeout=WAIT_MS)
    assert p.memory.text() == "-"
    assert "could not be opened" in p.summary.text() and "6 layers" not in p.summary.text()
    w.apply_settings(type(s)(**{**vars(s), "model": str(tiny)}))
    qtbot.waitUntil(lambda: p.slider.isEnabled(), timeout=WAIT_MS)
    assert "4 of 6 layers" in p.summary.text() and p.memory.text() == memory
    w.close()


def test_status_line_shows_time_left_of_a_long_stage(qtbot: Any, tiny: Path, tmp_path: Path):  # noqa: F811
    w = local_window(qtbot, tiny, tmp_path)
    now = [100.0]
    w._eta = Eta(clock=lambda: now[0])
    stage = "converting model (one-time, about 1 min)"
    w.show_progress(stage, 0.0)
    assert w.status.text() == "Converting model (one-time, about 1 min)…"  # too early to say
    now[0] += 20.0
    w.show_progress(stage, 0.4)  # 40% in 20 s: 30 s to go
    assert w.status.text().endswith("…  ·  about 30 s left")
    assert w.progress_bar.value() == 40
    w.show_progress("preparing kernels", 0.5)  # a new stage starts its own clock
    assert "left" not in w.status.text()
    w.close()


def test_eta_rules() -> None:
    now = [0.0]
    eta = Eta(clock=lambda: now[0])
    assert eta.left("a", 0.0) is None
    now[0] = 2.0
    assert eta.left("a", 0.5) is None  # under 3 s: no rate worth quoting
    now[0] = 10.0
    assert eta.left("a", 0.25) == pytest.approx(30.0)
    assert eta.left("a", 0.01) is None and eta.left("a", 1.0) is None
    assert eta.text("a", 0.5) == "  ·  about 10 s left"
