"""The app with an organisation-keyed server: importing the key (Settings), connecting with it,
the privacy panel's figures under the key (a keyed audit's where one measured the setting, else
the plain audit's, said to be measured without the key: docs/privacy.md found the key does not
lower what the server reads), and the in-app audit's words under a key. Figures as measured
(docs/privacy.md): ~99% of prompt words with or without the key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.core import org_key
from app.core.controller import AppController
from app.core.engine_host import EngineHost
from app.core.privacy import KEY_NOT_LOWER, KEYED
from app.core.settings import MODE_SERVER, Settings
from app.core.tasks import InlineExecutor
from engine import keys
from engine.audit.store import save_delivered, save_results
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
def audits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh audit store for this test (no audit another test stored for the same model)."""
    root = tmp_path / "veil-data"
    monkeypatch.setenv("VEIL_DATA_DIR", str(root))
    return root


@pytest.fixture
def key_in_use(monkeypatch: pytest.MonkeyPatch) -> str:
    """The app connected to a server keyed to :data:`KEY` (without running one)."""
    monkeypatch.setattr(EngineHost, "key_id", property(lambda self: KEY.key_id))
    return KEY.key_id


def plain_audit(name: str, date: str = "2026-12-01") -> dict[str, Any]:
    """The plain audit as measured on the default model (docs/privacy.md): ~99% at k = 1, 2."""
    rows = [
        {"k": 1, "attack": "known_weights", "side": "input", "top1": 0.994},
        {"k": 2, "attack": "known_weights", "side": "input", "top1": 0.986},
    ]
    return {"model": name, "date": date, "n_layers": 6, "results": rows}


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


def test_importing_the_key_keeps_a_private_copy_and_refuses_other_files(
    tmp_path: Path, memory_keyring: str
) -> None:
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
    assert not org_key.key_path(data).exists()  # the secret is in the key store
    assert org_key.installed(data) == KEY
    other = tmp_path / "rotated.key"
    OrgKey(bytes(32)).save(other)
    assert org_key.import_key(data, other) != KEY  # IT rotated the key: the new one replaces it
    org_key.forget(data)
    assert org_key.installed(data) is None
    assert "cannot recover" in org_key.EXPLANATION


def test_the_app_connects_with_the_imported_key_and_shows_the_keyed_audit(
    tiny: Path, keyed_dir: Path, tmp_path: Path, memory_keyring: str, audits: Path
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
            # no keyed audit stored (the server ships only the plain one): the plain audit's
            # measured figure, said to be measured without the key -- never "not audited yet"
            name = app.model_name()
            save_results(plain_audit(name))
            v = app.privacy_view(1)
            assert v.figure == "99%" and v.level == "High" and "all of what you type" in v.sentence
            assert v.keyed and not v.key_measured
            assert "2026-12-01" in v.caption and v.caption.endswith(KEY_NOT_LOWER)
            assert KEYED not in v.caption and "does not lower" in v.accessible
            assert app.audit_model_name() == name  # the details show the plain audit
            # a keyed audit stored for this key (`veil audit --org-key`): its figure where it
            # measured the setting, the plain one (so labelled) where it did not
            keyed_rows = [
                {"k": 1, "noise": 0.0, "attack": "align_weights+invert", "side": "input",
                 "top1": 1.0},
                {"k": 1, "noise": 0.01, "attack": "align_weights+invert", "side": "input",
                 "top1": 1.0},
            ]  # fmt: skip
            keyed = audit_name(name, KEY.key_id)
            save_results(
                {"model": keyed, "date": "2026-12-06", "keyed": True, "results": keyed_rows}
            )
            v = app.privacy_view(1)
            assert v.figure == "100%" and v.keyed and v.key_measured and v.level == "High"
            assert f"{KEYED}." in v.caption and "2026-12-06" in v.caption
            assert KEY_NOT_LOWER not in v.caption
            v2 = app.privacy_view(2)
            assert v2.figure == "99%" and not v2.key_measured and KEY_NOT_LOWER in v2.caption
            assert app.audit_model_name() == keyed
        finally:
            app.close()


def test_the_servers_plain_audit_is_shown_under_a_key(
    tiny: Path, tmp_path: Path, audits: Path, key_in_use: str
) -> None:
    """A staff computer: the only audit is the one the server delivered with its model."""
    from tests.test_core_app import make_app

    app = make_app(tiny, tmp_path)
    try:
        app.host.ensure_ready_blocking()
        name = app.model_name()
        assert app.privacy_view(1).figure == "not audited yet"  # nothing stored at all
        save_delivered(plain_audit(name, "2026-11-30"))
        v = app.privacy_view(1)
        assert v.figure == "99%" and v.keyed and not v.key_measured
        assert "2026-11-30" in v.caption and KEY_NOT_LOWER in v.caption
        # a key rotation changes the key id: still no keyed audit, still the plain figure
        rotated = OrgKey(bytes(32)).key_id
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(EngineHost, "key_id", property(lambda self: rotated))
            assert app.privacy_view(1).figure == "99%"
    finally:
        app.close()


def test_the_plain_audit_is_shown_without_a_keyed_server(
    tiny: Path, tmp_path: Path, audits: Path
) -> None:
    from tests.test_core_app import make_app

    app = make_app(tiny, tmp_path)
    try:
        app.host.ensure_ready_blocking()
        name = app.model_name()
        save_results(plain_audit(name))
        v = app.privacy_view(1)
        assert v.figure == "99%" and not v.keyed and "organisation" not in v.caption
    finally:
        app.close()


@pytest.mark.gui
def test_the_in_app_audit_under_a_key_says_it_measured_without_it(
    qtbot: Any, tiny: Path, tmp_path: Path, audits: Path, key_in_use: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from app.core import audit_info
    from tests.gui_support import local_window

    w = local_window(qtbot, tiny, tmp_path / "data", k=1)
    name = w.app.model_name()

    def fake_audit(model: str, ks: list[int], progress: Any, cancelled: Any) -> dict[str, Any]:
        res = plain_audit(name, "2026-12-03")  # the plain audit the app runs
        save_results(res)
        return res

    monkeypatch.setattr(audit_info, "run_blocking", fake_audit)
    asked: list[str] = []
    w.ask_yes = lambda title, text, yes: asked.append(text) or True  # type: ignore[method-assign]

    def run_audit() -> str:
        w.run_audit()
        qtbot.waitUntil(lambda: w._audit_task is None, timeout=60_000)
        return str(w.privacy.audit_status.text())

    try:
        assert "not audited yet" in w.privacy.audit.text() or w.privacy.level.text() == "Unknown"
        done = run_audit()
        assert "without your organisation's key" in asked[-1]
        assert done.startswith("Audit finished in")
        assert "measured without your organisation's key" in done and "does not lower" in done
        assert w.privacy.view.figure == "99%" and KEY_NOT_LOWER in w.privacy.audit.text()
        # a keyed audit of this key is stored: the plain run does not replace its figure
        keyed_rows = [{"k": 1, "attack": "align_weights+invert", "side": "input", "top1": 1.0}]
        keyed = audit_name(name, key_in_use)
        save_results({"model": keyed, "date": "2026-12-06", "keyed": True, "results": keyed_rows})
        done = run_audit()
        assert "audit made with your key (2026-12-06)" in asked[-1]
        assert "still come from the audit made with your key (2026-12-06)" in done
        assert "now come from it" not in done
        assert w.privacy.view.figure == "100%" and w.privacy.view.key_measured
    finally:
        w.close()


def test_settings_dialog_imports_and_removes_the_key(
    qtbot: Any, tmp_path: Path, memory_keyring: str
) -> None:
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
