"""The app with only an invite (issue 35): the organisation's model comes from the server
after a question with its size and a progress dialog, and the privacy panel shows the audit
that came with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtWidgets import QMessageBox

from app.core.engine_host import CONNECTED
from app.core.settings import MODE_DEMO, MODE_SERVER, SERVER_MODEL, Settings
from app.main_window import create, parse_args
from engine.loading import WeightReader, load_config
from remote.delivery import audit_path, model_key
from tests.delivery_support import invite, laptop, shipping_server
from tests.test_gui_app import WAIT_MS
from tests.tiny import make_model

ROWS = [
    {"k": 1, "attack": "mlp", "side": "input", "top1": 0.83, "top1_ci": [0.8, 0.86]},
    {"k": 2, "attack": "mlp", "side": "input", "top1": 0.37, "top1_ci": [0.33, 0.41]},
]


@pytest.fixture(scope="module")
def model6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gm6") / "office-model"
    make_model(folder, "llama", seed=6, n_layers=6)
    return folder


def test_only_an_invite_downloads_the_model_and_shows_its_audit(
    qtbot: Any, model6: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    laptop(monkeypatch, tmp_path / "cache")
    parts = tmp_path / "parts"
    key = model_key(WeightReader(model6), load_config(model6))
    audit = audit_path(parts, key)  # what `veil-trunk audit` leaves beside the model
    audit.parent.mkdir(parents=True)
    audit.write_text(json.dumps({"model": str(model6), "date": "2026-12-04", "results": ROWS}))
    answers = [QMessageBox.StandardButton.Yes]
    monkeypatch.setattr(QMessageBox, "exec", lambda self: answers[0])
    with shipping_server(model6, parts) as srv:
        app, w = create(parse_args(["--theme", "light"]), str(tmp_path / "data"))
        qtbot.addWidget(w)
        w.show()
        app.choose_server(invite(srv))  # the first-run choice: paste the invite, nothing else
        assert app.settings.model == SERVER_MODEL
        qtbot.waitUntil(lambda: app.host.uses_server_model, timeout=WAIT_MS)
        app.load_config()
        qtbot.waitUntil(lambda: w.privacy.slider.isEnabled(), timeout=WAIT_MS)
        [(model, size)] = w.download_asker.asked  # asked once, with the size, before
        part = app.host.part
        assert model == "office-model" and size == part.manifest.total_bytes
        assert w.download_shown == 1.0 and w.download is None  # shown, then closed
        assert w.privacy.slider.maximum() == part.manifest.k_max == 2  # what the part holds
        assert app.model_name() == "office-model"
        w.privacy.slider.setValue(2)
        v = w.privacy.view
        assert v is not None and v.audited and v.figure == "37%"  # not "not audited yet"
        assert "2026-12-04" in w.privacy.audit.text()
        assert not w.privacy.run_button.isEnabled()
        app.connect_now()
        qtbot.waitUntil(lambda: app.host.state == CONNECTED, timeout=WAIT_MS)
        assert len(w.download_asker.asked) == 1  # the cache, not a second download
        w.close()


def test_a_declined_download_leaves_a_clear_line(
    qtbot: Any, model6: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    laptop(monkeypatch, tmp_path / "cache")
    monkeypatch.setattr(QMessageBox, "exec", lambda self: QMessageBox.StandardButton.Cancel)
    errors: list[str] = []
    with shipping_server(model6, tmp_path / "parts") as srv:
        app, w = create(parse_args(["--theme", "light"]), str(tmp_path / "data"))
        qtbot.addWidget(w)
        w.show()
        app.load_failed.connect(lambda e: errors.append(str(e)))
        app.choose_server(invite(srv))
        qtbot.waitUntil(lambda: app.host.uses_server_model, timeout=WAIT_MS)
        app.load_config()
        qtbot.waitUntil(lambda: bool(errors), timeout=WAIT_MS)
        assert "declined" in errors[0] and "\n" not in errors[0]
        assert app.host.part is None
        w.close()


def test_settings_offer_the_servers_model_and_browse_folders(
    qtbot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtWidgets import QFileDialog

    from app.views.settings_dialog import SettingsDialog

    s = Settings(mode=MODE_SERVER, invite=invite_code())
    dlg = SettingsDialog(s)
    qtbot.addWidget(dlg)
    assert dlg.server_model.isEnabled()
    dlg.server_model.click()
    assert dlg.values().model == SERVER_MODEL
    folder = tmp_path / "my-model"
    folder.mkdir()
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(folder))
    actions = dlg.browse.menu().actions()
    assert [a.text() for a in actions] == ["A model file (.gguf)…", "A model folder…"]
    actions[1].trigger()
    assert dlg.values().model == str(folder)
    dlg.server_model.click()
    dlg.demo_radio.setChecked(True)  # the demo runs the built-in model, never the server's
    assert not dlg.server_model.isEnabled()
    assert dlg.values().mode == MODE_DEMO and dlg.values().model != SERVER_MODEL


def invite_code() -> str:
    from engine.protocol import make_invite

    return make_invite("tcp://10.0.0.7:5757", "k" * 40)
