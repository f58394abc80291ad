"""``veil-trunk``'s commands against bad input: one error line, exit 2, nothing written.

The allow-list cannot be given a second key through a note (``allow --name``), and every
command turns a bad address, number or file into one line instead of a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remote.allowlist import parse_allow_list
from remote.cli import main
from tests.fixed_keys import DASH_KEYS, PLAIN_KEYS, SERVER_KEYS

KEY = PLAIN_KEYS[0][0]
SMUGGLED = PLAIN_KEYS[1][0]  # the key a hostile note tries to add


def run(argv: list[str]) -> int:
    """``veil-trunk ARGV``'s exit code (argparse exits by itself on a flag it refuses)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("veil-trunk") and "error: " in err[0], err
    assert "Traceback" not in err[0]
    return err[0]


@pytest.mark.parametrize(
    "name",
    [
        f"bob\n{SMUGGLED}",  # the case: a second line holding a key
        f"bob\r{SMUGGLED}",
        f"bob\r\n{SMUGGLED}",
        f"bob\x85{SMUGGLED}",  # NEL: str.splitlines() ends a line there too
        f"bob\u2028{SMUGGLED}",  # LINE SEPARATOR
        f"bob\x1e{SMUGGLED}",  # record separator (splitlines again)
        "bob\tsmith",
        "bob\x1b[2Jsmith",  # a terminal escape
        "bob\u202esmith",  # right-to-left override (format character)
        "x" * 201,
    ],
)
def test_a_note_that_could_break_its_line_adds_no_key(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "keys"
    d.mkdir()
    before = f"# staff laptops\n{DASH_KEYS[0][0]}  # carol\n"
    (d / "allowed_clients.txt").write_text(before)
    assert main(["allow", KEY, "--keys", str(d), "--name", name]) == 2
    assert "--name" in one_error_line(capsys)
    assert (d / "allowed_clients.txt").read_text() == before  # untouched
    # and without a file, none is made
    fresh = tmp_path / "fresh"
    assert main(["allow", KEY, "--keys", str(fresh), "--name", name]) == 2
    assert not (fresh / "allowed_clients.txt").exists()
    capsys.readouterr()


def test_allow_and_revoke_with_ordinary_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "keys"
    d.mkdir()
    path = d / "allowed_clients.txt"
    # an admin's own file: a comment, Windows line endings, a note with a '#'
    path.write_bytes(b"# reception\r\n" + DASH_KEYS[0][0].encode() + b"  # desk #2\r\n")
    name = "Zoë Müller (laptop, 2nd floor) — #3"
    assert main(["allow", KEY, "--keys", str(d), "--name", name]) == 0
    assert main(["allow", SMUGGLED, "--keys", str(d)]) == 0
    assert main(["allow", KEY, "--keys", str(d), "--name", "again"]) == 0  # already there
    assert capsys.readouterr().out.splitlines() == [
        f"allowed {KEY}",
        f"allowed {SMUGGLED}",
        f"already allowed {KEY}",
    ]
    text = path.read_text(encoding="utf-8")
    assert text.endswith(f"{KEY}  # {name}\n{SMUGGLED}\n")
    assert parse_allow_list(text) == {DASH_KEYS[0][0], KEY, SMUGGLED}
    assert path.stat().st_mode & 0o777 == 0o600
    # revoking one key leaves every other line exactly as it was
    assert main(["revoke", KEY, "--keys", str(d)]) == 0
    assert path.read_bytes() == (
        b"# reception\r\n"
        + DASH_KEYS[0][0].encode()
        + b"  # desk #2\r\n"
        + SMUGGLED.encode()
        + b"\n"
    )
    assert main(["revoke", KEY, "--keys", str(d)]) == 2
    assert "not on the allow-list" in one_error_line(capsys)


def _keyfile(tmp_path: Path, public: str, secret: str) -> str:
    f = tmp_path / "client.json"
    f.write_text(json.dumps({"public": public, "secret": secret}))
    return str(f)


STATUS_ADDRESSES = [
    "tcp://",  # the case: zmq refused it deep inside socket set-up
    "tcp://nohost",
    "tcp://nohost:abc",
    "tcp://[::1",
    "tcp://10.0.0.1:99999",
    "tcp://*:5757",
    "tcp://host name:5757",
]


@pytest.mark.parametrize("address", STATUS_ADDRESSES)
def test_status_with_a_bad_address_is_one_line(
    address: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = _keyfile(tmp_path, *PLAIN_KEYS[0])
    argv = ["status", "--server", address, "--server-key", SERVER_KEYS[0], "--client-keys", keys]
    assert main(argv) == 2
    assert address in one_error_line(capsys)
    assert main(["status", "--server", address, "--insecure"]) == 2
    one_error_line(capsys)


def test_every_command_refuses_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    bad_list = tmp_path / "bad-list"
    bad_list.mkdir()
    (bad_list / "allowed_clients.txt").write_bytes(b"\xff\xfe not utf-8\n")
    list_dir = tmp_path / "list-is-a-folder"
    (list_dir / "allowed_clients.txt").mkdir(parents=True)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    secret = damaged / "server.key_secret"
    secret.write_text(f"public-key = {'a' * 39}~\nsecret-key = {'b' * 39}~\n")  # 40, not Z85
    secret.chmod(0o600)
    undecodable = tmp_path / "undecodable"
    undecodable.mkdir()
    (undecodable / "server.key_secret").write_bytes(b"\xff\xfe")
    (undecodable / "server.key_secret").chmod(0o600)
    (tmp_path / "secret-is-a-folder" / "server.key_secret").mkdir(parents=True)
    not_z85 = _keyfile(tmp_path, "a", "b")
    good_keys = str(tmp_path / "good.json")
    Path(good_keys).write_text(json.dumps({"public": PLAIN_KEYS[0][0], "secret": PLAIN_KEYS[0][1]}))
    serve = ["serve", "--model", "x", "--insecure", "--bind", "tcp://127.0.0.1:5999"]
    status = ["status", "--server", "tcp://127.0.0.1:5999"]
    loadtest = ["loadtest", "--server", "tcp://127.0.0.1:5999", "--insecure"]
    cases: list[tuple[list[str], str]] = [
        (["keygen", "--keys", str(a_file)], "cannot write the server keypair"),
        (["keygen", "--keys", str(a_file / "sub")], "cannot write the server keypair"),
        (["keygen", "--keys", str(tmp_path / "secret-is-a-folder"), "--force"], "cannot write"),
        (["allow", KEY, "--keys", str(a_file / "sub")], "cannot write"),
        (["allow", KEY, "--keys", str(bad_list)], "not UTF-8"),
        (["revoke", KEY, "--keys", str(bad_list)], "not UTF-8"),
        (["allow", KEY, "--keys", str(list_dir)], "cannot read"),
        (["revoke", KEY, "--keys", str(list_dir)], "cannot read"),
        (["invite", "--keys", str(damaged)], "damaged"),
        (["invite", "--keys", str(undecodable)], "cannot read"),
        (["invite", "--keys", str(damaged), "--address", "tcp://host"], "--address"),
        (["invite", "--keys", str(damaged), "--address", "tcp://host:*"], "--address"),
        ([*serve[:-1], "tcp://127.0.0.1:99999"], "between 1 and 65535"),
        ([*serve[:-1], "tcp://127.0.0.1:abc"], "--bind"),
        ([*serve[:-1], "127.0.0.1:5999"], "--bind"),
        ([*serve, "--device", "bogus"], "unknown device 'bogus'"),
        ([*serve, "--threads", "99999999999999999999"], "--threads"),
        ([*serve, "--kernel-threads", "99999999999999999999"], "--kernel-threads"),
        ([*serve, "--max-context", "-5"], "--max-context"),
        ([*serve, "--session-ttl", "nan"], "--session-ttl"),
        ([*serve, "--max-cache-gb", "inf"], "--max-cache-gb"),
        ([*serve, "--max-cache-gb", "1e300"], "--max-cache-gb"),
        ([*serve, "--ray", "--cpus-per-replica", "nan"], "--cpus-per-replica"),
        (["serve", "--model", "x", "--keys", str(damaged)], "damaged"),
        ([*status, "--server-key", "xyz", "--client-keys", good_keys], "--server-key"),
        ([*status, "--server-key", SERVER_KEYS[0], "--client-keys", not_z85], "Z85"),
        ([*status, "--server-key", SERVER_KEYS[0], "--client-keys", str(a_file)], "JSON"),
        ([*loadtest, "--timeout", "nan"], "--timeout"),
        ([*loadtest, "--think-ms", "inf"], "--think-ms"),
        (["loadtest", "--spawn", "x", "--spawn-args", '"unbalanced'], "--spawn-args"),
    ]
    for argv, message in cases:
        assert run(argv) == 2, argv
        line = one_error_line(capsys)
        assert message in line, (argv, line)


def test_keys_from_stdin_must_be_z85(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO('{"public": "a", "secret": "b", "allow": []}\n'))
    argv = ["serve", "--model", "x", "--keys-from-stdin", "--bind", "tcp://127.0.0.1:5999"]
    assert main(argv) == 2
    assert "40-character Z85" in one_error_line(capsys)
