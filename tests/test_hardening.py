"""The client against the failures of issue 17: a misbehaving server (a fake trunk that
answers ``internal``, ``unknown_session``, "in flight" forever, NaN, oversized frames),
damaged invites, keys that start with '-', and where keys are kept. The real server's side
(long prompts, revocation, per-key caps, the idle rule, takeover) is tests/test_server_access.py.

Client-side cases need no model (a :class:`RemoteTrunk` with made-up fingerprints talks to
:class:`tests.fake_trunk.FakeTrunk`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import keys
from engine import protocol as P
from engine.errors import KeyStoreError, TransportError
from engine.split import ClientModel, load_client
from engine.transport import STEP_TIMEOUT_S, RemoteTrunk, connect_trunk
from engine.transport.policy import PREFILL_CHUNK
from remote.cli import main as trunk_cli
from tests.fake_trunk import OVERSIZED_BYTES, FakeTrunk, hidden
from tests.fixed_keys import DASH_KEYS, PLAIN_KEYS
from tests.hardening_support import FAST, REPO, make_tiny_8k


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_8k(tmp_path_factory.mktemp("tiny") / "llama8k")


@pytest.fixture(scope="module")
def client(tiny: Path) -> ClientModel:
    return load_client(str(tiny), 1)


def fake_client(fake: FakeTrunk, **kw: float) -> RemoteTrunk:
    opts = {**FAST, **kw}
    return RemoteTrunk(
        fake.address,
        server_key=fake.public_key,
        client_keys=PLAIN_KEYS[0],
        start=1,
        end=3,
        hidden_size=64,
        config_fp="fake",
        weights_fp=None,
        wire_dtype="float32",
        **opts,  # type: ignore[arg-type]
    )


@pytest.fixture
def fake(request: pytest.FixtureRequest) -> Iterator[FakeTrunk]:
    with FakeTrunk(request.param) as f:
        yield f


# ----------------------------------------------------------------------------- defect 1


@pytest.mark.parametrize("fake", ["stale_error"], indirect=True)
def test_an_error_about_an_older_session_does_not_fail_the_open(fake: FakeTrunk) -> None:
    """After the built-in server restarted, the new one answered a step or ping meant for the
    old session ("no such session") while the client opened a fresh one: that stale answer
    failed the message with "the trunk server answered: no such session [unknown_session]"."""
    with fake_client(fake) as trunk:
        h = hidden(3)
        assert torch.equal(trunk.forward(h, torch.arange(3)), h)
        assert fake.counts["open"] == 1


@pytest.mark.parametrize("fake", ["echo"], indirect=True)
def test_fake_echo_server_works_and_long_blocks_go_in_chunks(fake: FakeTrunk) -> None:
    with fake_client(fake) as trunk:
        h = hidden(1300)
        assert torch.equal(trunk.forward(h, torch.arange(1300)), h)
        # 1300 rows as chain steps of at most PREFILL_CHUNK rows each
        assert fake.counts["step"] == -(-1300 // PREFILL_CHUNK)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["internal"], indirect=True)
def test_internal_error_is_a_server_fault_not_a_retry_storm(fake: FakeTrunk) -> None:
    with fake_client(fake) as trunk:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="failed on this step 2 times: CUDA out of"):
            trunk.forward(hidden(4), torch.arange(4))
        assert time.monotonic() - t0 < 10
    # one retry (reopen + the step again), then the error: no storm
    assert fake.counts["open"] <= 2 and fake.counts["step"] <= 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["unknown"], indirect=True)
def test_a_server_that_keeps_losing_the_session_is_given_up(fake: FakeTrunk) -> None:
    lost = "lost this conversation's session 5 times"
    with fake_client(fake) as trunk, pytest.raises(TransportError, match=lost):
        trunk.forward(hidden(4), torch.arange(4))
    assert fake.counts["open"] <= 1 + trunk.max_session_losses
    assert fake.counts["step"] <= 1 + trunk.max_session_losses


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["in_flight", "silent_accept"], indirect=True)
def test_a_step_never_answered_ends_at_the_deadline(fake: FakeTrunk) -> None:
    with fake_client(fake, step_timeout_s=2.0) as trunk:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="did not finish a step within 2 s"):
            trunk.forward(hidden(4), torch.arange(4))
        assert 1.9 < time.monotonic() - t0 < 8
        # the trunk refuses to go on with an unknown server state; a new conversation may
        with pytest.raises(TransportError, match="failed during this conversation"):
            trunk.forward(hidden(1), torch.tensor([4]))
    # "done but no reply": the step is sent again (a retry gets the cached reply), with backoff
    assert (fake.counts["step"] > 1) == (fake.mode == "silent_accept")
    assert fake.counts["step"] < 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["lose_late"], indirect=True)
def test_recovering_a_step_does_not_restart_its_deadline(fake: FakeTrunk) -> None:
    """The session is lost 3 s into a 4 s step, and the new session never finishes it: the step
    still ends at its one deadline (4 s), not a fresh 4 s after each recovery."""
    fake.lose_after_s = 3.0
    with fake_client(fake, step_timeout_s=4.0) as trunk:
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="did not finish a step within 4 s"):
            trunk.forward(hidden(4), torch.arange(4))
        assert time.monotonic() - t0 < 6.5
    assert fake.counts["open"] == 2  # one recovery happened


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["nan", "inf"], indirect=True)
def test_non_finite_activations_are_a_server_fault(fake: FakeTrunk) -> None:
    with (
        fake_client(fake) as trunk,
        pytest.raises(TransportError, match="invalid activations"),
    ):
        trunk.forward(hidden(4), torch.arange(4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fake", ["oversized"], indirect=True)
def test_an_oversized_reply_is_never_buffered(fake: FakeTrunk) -> None:
    trunk = fake_client(fake, step_timeout_s=2.0)
    assert trunk.max_reply_bytes < OVERSIZED_BYTES
    with pytest.raises(TransportError):
        trunk.forward(hidden(4), torch.arange(4))
    assert fake.counts["step"] >= 1  # the server did send its oversized reply (and more)
    assert trunk.bytes_received < trunk.max_reply_bytes  # ...but none of it was taken in
    trunk.close()


def test_default_limits_end_a_misbehaving_server_within_two_minutes() -> None:
    """The documented worst case with default settings: connecting, then a step's own budget
    (waiting, replays) plus the time allowed to reach a lost server again."""
    import inspect

    d = {
        k: v.default
        for k, v in inspect.signature(RemoteTrunk.__init__).parameters.items()
        if v.default is not inspect.Parameter.empty
    }
    assert d["step_timeout_s"] == STEP_TIMEOUT_S
    assert d["connect_timeout_s"] + d["step_timeout_s"] + d["reconnect_s"] <= 120


@pytest.fixture
def memory_keyring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VEIL_KEYRING", "memory")
    monkeypatch.setattr(keys, "_backend", None)
    monkeypatch.setattr(keys, "_backend_kind", None)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["internal", "in_flight", "nan"])
def test_veil_generate_against_a_misbehaving_server_is_one_line_and_exit_3(
    tiny: Path, mode: str
) -> None:
    with FakeTrunk(mode) as fake:
        env = dict(os.environ, VEIL_KEYRING="memory", VEIL_STEP_TIMEOUT="3")
        t0 = time.monotonic()
        proc = subprocess.run(
            [
                *(sys.executable, "-m", "app.cli", "generate", "--model", str(tiny)),
                *("--local-layers", "1", "--prompt", "hi", "--max-new-tokens", "4"),
                *("--server", fake.invite),
            ],
            capture_output=True,
            text=True,
            timeout=110,
            cwd=REPO,
            env=env,
        )
        took = time.monotonic() - t0
    lines = proc.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("veil: error:")]
    assert proc.returncode == 3, proc.stderr
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in proc.stderr
    assert took < 60, took


def test_the_app_shows_the_error_and_gives_the_message_back(
    tiny: Path, tmp_path: Path, memory_keyring: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.core.controller import AppController
    from app.core.settings import MODE_SERVER, Settings
    from app.core.tasks import InlineExecutor

    monkeypatch.setenv("VEIL_STEP_TIMEOUT", "3")
    with FakeTrunk("internal") as fake:
        s = Settings(first_run_done=True, mode=MODE_SERVER, invite=fake.invite, model=str(tiny))
        s.local_layers, s.max_tokens = 1, 4
        app = AppController(InlineExecutor(), tmp_path, settings=s)
        failures: list[tuple[str, str]] = []
        app.chat.failed.connect(lambda err, text: failures.append((str(err), text)))
        t0 = time.monotonic()
        assert app.chat.send("please keep this message")
        assert time.monotonic() - t0 < 30
        app.close()
    assert len(failures) == 1
    err, put_back = failures[0]
    assert "failed on this step" in err and "\n" not in err
    assert put_back == "please keep this message"
    assert app.chat.current is not None


# ----------------------------------------------------------------------------- defect 5


def test_an_invite_with_a_malformed_key_is_refused_when_parsed() -> None:
    for bad in ("#" * 40, "~" * 40, "abc"):
        with pytest.raises(ValueError, match="damaged"):
            P.parse_invite(P.make_invite("tcp://127.0.0.1:5", bad))
    good = P.make_invite("tcp://127.0.0.1:5", DASH_KEYS[0][0])
    assert P.parse_invite(good) == ("tcp://127.0.0.1:5", DASH_KEYS[0][0])


@pytest.mark.timeout(60)
def test_socket_errors_close_the_socket_and_do_not_hang() -> None:
    for address, key in (("tcp://127.0.0.1:99999", PLAIN_KEYS[1][0]), ("tcp://x:1", "#" * 40)):
        with pytest.raises(TransportError):
            RemoteTrunk(
                address,
                server_key=key,
                client_keys=PLAIN_KEYS[0],
                start=1,
                end=3,
                hidden_size=64,
                config_fp="c",
                weights_fp=None,
                connect_timeout_s=1,
            )


@pytest.mark.timeout(60)
def test_a_saved_server_key_is_replaced_only_after_a_handshake(
    client: ClientModel, memory_keyring: None, caplog: pytest.LogCaptureFixture
) -> None:
    with FakeTrunk("echo") as fake:
        keys.save_server_key(fake.address, PLAIN_KEYS[1][0])  # pinned before: another key
        wrong = P.make_invite(fake.address, DASH_KEYS[1][0])  # an invite nobody holds
        with pytest.raises(TransportError):
            connect_trunk(wrong, client, connect_timeout_s=1.5)
        assert keys.server_key(fake.address) == PLAIN_KEYS[1][0]  # untouched
        with caplog.at_level("WARNING", logger="veil.transport"):
            connect_trunk(fake.invite, client, connect_timeout_s=5).close()
        assert keys.server_key(fake.address) == fake.public_key
        assert "replaces the old one" in caplog.text


def test_an_insecure_loopback_server_is_reachable_or_named_in_the_error(
    tiny: Path, client: ClientModel, memory_keyring: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from app.cli import main as veil

    with pytest.raises(TransportError, match="add --insecure"):
        connect_trunk("tcp://127.0.0.1:1", client)
    with FakeTrunk("echo", curve=False) as fake:  # like `veil-trunk serve --insecure`
        argv = ["generate", "--model", str(tiny), "--local-layers", "1", "--prompt", "hi"]
        argv += ["--max-new-tokens", "3", "--json", "--server", fake.address, "--insecure"]
        assert veil(argv) == 0
        assert json.loads(capsys.readouterr().out)["round_trips"] >= 1
        assert fake.counts["open"] >= 1 and fake.counts["step"] >= 1


# ----------------------------------------------------------------------------- defect 12


@pytest.mark.parametrize("pub", [DASH_KEYS[0][0], PLAIN_KEYS[0][0]])
def test_allow_and_revoke_take_keys_exactly_as_shown(
    pub: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = str(tmp_path)
    assert trunk_cli(["allow", pub, "--keys", d, "--name", "ana"]) == 0
    assert trunk_cli(["allow", "--keys", d, pub]) == 0  # flags before the key
    assert capsys.readouterr().out.splitlines() == [f"allowed {pub}", f"already allowed {pub}"]
    assert trunk_cli(["revoke", pub, "--keys", d]) == 0
    assert trunk_cli(["revoke", pub, "--keys", d]) == 2  # gone
    assert trunk_cli(["allow", pub[:-1] + "~", "--keys", d]) == 2  # not Z85
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(ln.startswith("veil-trunk: error: ") for ln in err)


# ----------------------------------------------------------------------------- defect 13


def test_the_encrypted_key_store_names_its_missing_dependency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VEIL_KEYRING", "encrypted")
    monkeypatch.setattr(keys, "_backend", None)
    for name in ("Crypto", "Cryptodome"):  # as on a machine without pycryptodome
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(KeyStoreError) as ei:
        keys.client_keypair()
    msg = str(ei.value)
    assert "pycryptodome" in msg and "veil[encrypted-keys]" in msg
    assert "No module named" not in msg and "set VEIL_KEYRING=encrypted" not in msg


def test_where_keys_are_kept_is_said_truly_for_each_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(keys, "_backend", None)
    said = {}
    for kind in ("", "memory", "file", "encrypted"):
        monkeypatch.setenv("VEIL_KEYRING", kind)
        monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
        said[kind] = keys.storage_description()
    assert "system keyring" in said[""]
    assert "forgotten when Veil exits" in said["memory"]
    assert "plain, unencrypted file" in said["file"] and str(tmp_path) in said["file"]
    assert "password-protected file" in said["encrypted"]
    assert not any("never in plain files" in s for s in said.values())


@pytest.mark.gui
def test_the_settings_dialog_says_where_keys_are(
    qtbot: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from PySide6.QtWidgets import QLabel

    from app.core.settings import Settings
    from app.views.settings_dialog import SettingsDialog

    monkeypatch.setenv("VEIL_KEYRING", "file")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.setattr(keys, "_backend", None)
    dlg = SettingsDialog(Settings())
    qtbot.addWidget(dlg)
    texts = " ".join(w.text() for w in dlg.findChildren(QLabel))
    assert "plain, unencrypted file" in texts and "never in plain files" not in texts
