"""The IT side of model delivery from the command line (issue 35): keygen makes the signing key
and invites carry it, `veil-trunk audit` stores the figures beside the model, `serve` ships
them with the model, and `veil generate` with only the invite downloads and chats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import protocol as P
from tests.inproc_trunk import CLIENT_KEYS

ROOT = Path(__file__).resolve().parent.parent


def test_audit_ships_with_the_model_and_an_invite_is_all_a_laptop_needs(
    tiny_llama: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from app.cli import main as veil
    from app.core import audit_info
    from engine import keys
    from engine.delivery import fetch
    from engine.local_server import free_port
    from remote.cli import main as trunk_cli
    from remote.delivery_cli import SIGN_FILE, sign_public

    monkeypatch.setenv("VEIL_KEYRING", "memory")
    monkeypatch.setenv("VEIL_WIRE_DTYPE", "float32")
    monkeypatch.setattr(keys, "_backend", None)
    keys.backend().set_password(keys.SERVICE, keys.CLIENT_PUBLIC, CLIENT_KEYS[0])
    keys.backend().set_password(keys.SERVICE, keys.CLIENT_SECRET, CLIENT_KEYS[1])
    monkeypatch.setattr(fetch, "parts_root", lambda: tmp_path / "laptop-cache")
    d, parts = tmp_path / "keys", tmp_path / "parts"
    assert trunk_cli(["keygen", "--keys", str(d)]) == 0
    assert (d / SIGN_FILE).stat().st_mode & 0o777 == 0o600
    assert trunk_cli(["allow", CLIENT_KEYS[0], "--keys", str(d)]) == 0
    addr = f"tcp://127.0.0.1:{free_port()}"
    assert trunk_cli(["invite", "--address", addr, "--keys", str(d)]) == 0
    invite = capsys.readouterr().out.strip().splitlines()[-1]
    assert P.invite_sign_key(invite) == sign_public(d)
    audit = ["audit", "--model", str(tiny_llama), "--quick", "--local-layers", "1"]
    assert trunk_cli([*audit, "--parts-dir", str(parts)]) == 0
    out = capsys.readouterr().out
    assert "k=1: worst-case top-1 token recovery" in out and "stored beside the model" in out
    serve = ["serve", "--model", str(tiny_llama), "--keys", str(d), "--bind", addr]
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote.cli", *serve, "--parts-dir", str(parts)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"READY {addr} "), line
        args = ["generate", "--server", invite, "--local-layers", "1", "--prompt", "hi"]
        args += ["--max-new-tokens", "6", "--json"]
        assert veil(args) == 2  # no terminal here and no --yes: it says the size and stops
        err = capsys.readouterr().err
        assert "needs a one-time download of the model llama from the server" in err
        assert "--yes" in err
        assert veil([*args, "--yes"]) == 0
        res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert res["model"] == "llama" and len(res["token_ids"]) == 6
        assert 0 < res["model_part"]["fetched_bytes"] == res["model_part"]["part_bytes"]
        assert veil([*args]) == 0  # cached: no question, nothing fetched
        again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert again["model_part"]["fetched_bytes"] == 0
        assert again["token_ids"] == res["token_ids"]
    finally:
        proc.terminate()
        proc.wait(30)
    fig = audit_info.figure("llama", 1)  # measured on the server, shown on the laptop
    assert fig.top1 is not None and fig.value.endswith("%")


def test_serve_without_a_signing_key_it_cannot_make_runs_without_delivery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from remote import delivery_cli

    def cannot(d: Path, create: bool = True) -> bytes:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(delivery_cli, "signing_key", cannot)
    assert delivery_cli.serve_signing_key(tmp_path) is None
    assert "model delivery is off" in caplog.text and "Permission denied" in caplog.text
