"""The app with an organisation-keyed server: importing the key (Settings), connecting with it,
and the privacy panel's keyed audit figures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.core import org_key
from app.core.controller import AppController
from app.core.settings import MODE_SERVER, Settings
from app.core.tasks import InlineExecutor
from engine import keys
from engine.audit.store import save_results
from engine.generate import generate
from engine.keyed import audit_name
from engine.keyed.transform import KeyedError, OrgKey
from engine.protocol import make_invite
from engine.sampling import SamplingParams
from engine.split import SplitRunner, load_client, load_trunk
from tests.inproc_trunk import SERVER_KEYS, trunk_in_thread
from tests.keyed_support import KEY, PROMPT, keyed_trunk, tiny_model

GREEDY = SamplingParams(max_new_tokens=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory, "keyed-app")


@pytest.fixture(scope="module")
def keyed_dir(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return keyed_trunk(tiny, tmp_path_factory, "keyed-app-trunk")


@pytest.fixture
def memory_keyring(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("VEIL_KEYRING", "memory")
    monkeypatch.setattr(keys, "_backend", None)
    monkeypatch.setattr(keys, "_backend_kind", None)
    yield keys.client_keypair(create=True)[0]


def server_app(tiny: Path, data: Path, invite: str) -> AppController:
    s = Settings(
        first_run_done=True,
        mode=MODE_SERVER,
        invite=invite,
        model=str(tiny),
        local_layers=1,
        system_prompt="",
        repetition_penalty=1.0,
    )
    app = AppController(InlineExecutor(), data, settings=s)
    app.load_config()
    return app


def test_importing_the_key_keeps_a_private_copy_and_refuses_other_files(tmp_path: Path) -> None:
    src = tmp_path / "from-it.key"
    KEY.save(src)
    data = tmp_path / "data"
    data.mkdir()
    assert org_key.installed(data) is None
    bad = tmp_path / "notes.txt"
    bad.write_text("not a key")
    with pytest.raises(KeyedError, match="not a Veil organisation key"):
        org_key.import_key(data, bad)
    assert org_key.import_key(data, src) == KEY
    assert org_key.key_path(data).stat().st_mode & 0o777 == 0o600
    assert org_key.installed(data) == KEY
    other = tmp_path / "rotated.key"
    OrgKey(bytes(32)).save(other)
    assert org_key.import_key(data, other) != KEY  # IT rotated the key: the new one replaces it
    org_key.forget(data)
    assert org_key.installed(data) is None
    assert "cannot recover" in org_key.EXPLANATION


def test_the_app_connects_with_the_imported_key_and_shows_the_keyed_audit(
    tiny: Path, keyed_dir: Path, tmp_path: Path, memory_keyring: str
) -> None:
    with trunk_in_thread(tiny, allow=[memory_keyring], keyed_trunk=str(keyed_dir)) as srv:
        invite = make_invite(srv.address, SERVER_KEYS[0])
        app = server_app(tiny, tmp_path, invite)
        try:
            with pytest.raises(KeyedError, match="add your organisation's key"):
                app.host.ensure_ready_blocking()
            src = tmp_path / "it.key"
            KEY.save(src)
            org_key.import_key(app.folder, src)
            refreshed: list[int] = []
            app.split_changed.connect(refreshed.append)
            app.connect_now()  # (inline executor) the panel is told to show the keyed figures
            assert app.host.key_id == KEY.key_id and refreshed == [1]
            runner = app.host.ensure_ready_blocking()
            got = generate(runner, PROMPT, GREEDY).token_ids
            client = load_client(str(tiny), 1)
            plain = SplitRunner(client, load_trunk(client.resolved, 1, 5))
            assert got == generate(plain, PROMPT, GREEDY).token_ids
            # the privacy panel: the keyed audit's figure, labelled, not the plain one
            name = app.model_name()
            rows = [{"k": 1, "attack": "mlp", "side": "input", "top1": 0.9}]
            save_results({"model": name, "date": "2026-12-01", "results": rows})
            keyed_rows = [{"k": 1, "attack": "mlp", "side": "input", "top1": 0.07}]
            save_results(
                {"model": audit_name(name, KEY.key_id), "date": "2026-12-02", "results": keyed_rows}
            )
            v = app.privacy_view(1)
            assert v.figure == "7%" and v.keyed and v.level == "Low"
            assert "with your organisation's key" in v.caption and "2026-12-02" in v.caption
        finally:
            app.close()


def test_the_plain_audit_is_shown_without_a_keyed_server(tiny: Path, tmp_path: Path) -> None:
    from tests.test_core_app import make_app

    app = make_app(tiny, tmp_path)
    try:
        app.host.ensure_ready_blocking()
        name = app.model_name()
        rows = [{"k": 1, "attack": "mlp", "side": "input", "top1": 0.9}]
        save_results({"model": name, "date": "2026-12-01", "results": rows})
        v = app.privacy_view(1)
        assert v.figure == "90%" and not v.keyed and "organisation" not in v.caption
    finally:
        app.close()


def test_settings_dialog_imports_and_removes_the_key(qtbot: Any, tmp_path: Path) -> None:
    from app.views.settings_dialog import SettingsDialog

    data = tmp_path / "data"
    data.mkdir()
    dlg = SettingsDialog(Settings(), key_folder=data)
    qtbot.addWidget(dlg)
    assert "No organisation key" in dlg.org_key_status.text()
    assert not dlg.org_key_remove.isEnabled()
    bad = tmp_path / "bad.key"
    bad.write_text("hello")
    assert not dlg.import_org_key(bad)
    assert "not a Veil organisation key" in dlg.org_key_status.text()
    good = tmp_path / "good.key"
    KEY.save(good)
    assert dlg.import_org_key(good)
    assert KEY.key_id in dlg.org_key_status.text() and dlg.org_key_remove.isEnabled()
    assert org_key.installed(data) == KEY
    dlg.org_key_remove.click()
    assert org_key.installed(data) is None and "No organisation key" in dlg.org_key_status.text()
