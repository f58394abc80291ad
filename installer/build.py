"""Build the Veil installer for the operating system this runs on.

    python installer/build.py            # from the repository root, inside .venv

* Linux:   dist/veil/ (the frozen one-folder app), dist/veil_VERSION_ARCH.deb and
           dist/veil-VERSION-linux-ARCH.tar.gz
* Windows: dist/veil/ and dist/Veil-VERSION-setup.exe (needs Inno Setup 6's ISCC.exe)
* macOS:   dist/Veil.app and dist/Veil-VERSION.dmg (uses hdiutil)

Options: ``--skip-freeze`` reuses an existing dist/veil; ``--package deb|tar|all|none`` picks the
Linux packages; ``--dist``/``--work`` move the output and PyInstaller's work folder.
Errors are one line (``build: error: ...``) with exit status 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "installer" / "veil.spec"
ICON_SIZES = (16, 32, 48, 64, 128, 256, 512)


class BuildError(Exception):
    pass


def version() -> str:
    """The project version from pyproject.toml."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def folder_size(path: Path) -> int:
    """Bytes in all regular files below path (links not followed)."""
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _run(cmd: Sequence[str], log: Path | None = None) -> str:
    """Run cmd (its output streams into log when given); on failure raise BuildError with the
    last lines of its output."""
    try:
        if log is None:
            proc = subprocess.run(
                list(cmd),
                cwd=str(ROOT),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            output = proc.stdout
        else:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("w") as f:
                proc = subprocess.run(list(cmd), cwd=str(ROOT), stdout=f, stderr=subprocess.STDOUT)
            output = log.read_text(errors="replace")
    except FileNotFoundError as exc:
        raise BuildError(f"cannot run {cmd[0]}: {exc.strerror}") from None
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        where = f" (full log: {log})" if log else ""
        raise BuildError(f"{Path(cmd[0]).name} failed with exit {proc.returncode}{where}\n{tail}")
    return output


def check_inputs() -> None:
    icons = ROOT / "resources" / "icons"
    missing = [f"veil-{s}.png" for s in ICON_SIZES if not (icons / f"veil-{s}.png").is_file()]
    if missing:
        raise BuildError(f"missing icons in {icons}: {', '.join(missing)}")
    try:
        import PyInstaller  # noqa: F401
    except ModuleNotFoundError:
        raise BuildError(
            "PyInstaller is not installed: pip install 'pyinstaller>=6.10,<7'"
        ) from None


def freeze(dist: Path, work: Path) -> Path:
    """Run PyInstaller on installer/veil.spec; return the one-folder bundle."""
    cmd = [
        sys.executable,
        "-m",
        "PyInstaller",
        "--noconfirm",
        "--log-level",
        "WARN",
        "--distpath",
        str(dist),
        "--workpath",
        str(work),
        str(SPEC),
    ]
    _run(cmd, log=work / "pyinstaller.log")
    bundle = dist / "veil"
    exe = bundle / ("veil.exe" if sys.platform == "win32" else "veil")
    if not exe.is_file():
        raise BuildError(f"PyInstaller finished but {exe} is missing")
    # veil-trunk next to veil: the same executable, which dispatches on its name
    if sys.platform == "win32":
        (bundle / "veil-trunk.cmd").write_text('@"%~dp0veil.exe" --trunk-child %*\r\n')
    else:
        link = bundle / "veil-trunk"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to("veil")
    return bundle


def package_linux(bundle: Path, dist: Path, what: str) -> list[Path]:
    if shutil.which("dpkg-deb") is None and what in ("deb", "all"):
        raise BuildError(
            "dpkg-deb is not installed (apt-get install dpkg-dev), or use --package tar"
        )
    out = _run(
        [
            "bash",
            str(ROOT / "installer" / "linux" / "package.sh"),
            str(bundle),
            version(),
            str(dist),
            what,
        ]
    )
    return [Path(line) for line in out.split() if line.endswith((".deb", ".tar.gz"))]


def package_windows(bundle: Path, dist: Path) -> list[Path]:
    candidates = [
        shutil.which("iscc"),
        os.path.expandvars(r"%ProgramFiles(x86)%\Inno Setup 6\ISCC.exe"),
        os.path.expandvars(r"%ProgramFiles%\Inno Setup 6\ISCC.exe"),
        os.path.expandvars(r"%LOCALAPPDATA%\Programs\Inno Setup 6\ISCC.exe"),
    ]
    iscc = next((c for c in candidates if c and Path(c).is_file()), None)
    if iscc is None:
        raise BuildError("Inno Setup 6 is not installed (https://jrsoftware.org/isinfo.php)")
    _run(
        [
            iscc,
            f"/DAppVersion={version()}",
            f"/DBundleDir={bundle}",
            f"/DOutputDir={dist}",
            f"/DRepoRoot={ROOT}",
            str(ROOT / "installer" / "windows" / "veil.iss"),
        ]
    )
    return sorted(dist.glob(f"Veil-{version()}-setup.exe"))


def package_macos(dist: Path) -> list[Path]:
    app = dist / "Veil.app"
    if not app.is_dir():
        raise BuildError(f"{app} is missing (the spec's BUNDLE step runs only on macOS)")
    out = _run(
        ["bash", str(ROOT / "installer" / "macos" / "make-dmg.sh"), str(app), version(), str(dist)]
    )
    return [Path(line) for line in out.split() if line.endswith(".dmg")]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="build", description=__doc__.split("\n\n")[0])
    p.add_argument("--dist", type=Path, default=ROOT / "dist", help="output folder (dist/)")
    p.add_argument(
        "--work",
        type=Path,
        default=ROOT / "build" / "pyinstaller",
        help="PyInstaller work folder (build/pyinstaller/)",
    )
    p.add_argument("--skip-freeze", action="store_true", help="reuse an existing DIST/veil")
    p.add_argument(
        "--package",
        choices=("deb", "tar", "all", "none"),
        default="all",
        help="Linux packages to make (default all)",
    )
    args = p.parse_args(argv)
    dist, work = args.dist.resolve(), args.work.resolve()
    t0 = time.perf_counter()
    try:
        check_inputs()
        if args.skip_freeze:
            bundle = dist / "veil"
            if not bundle.is_dir():
                raise BuildError(f"--skip-freeze: {bundle} does not exist")
        else:
            print(
                f"build: freezing Veil {version()} with PyInstaller (several minutes)...",
                flush=True,
            )
            bundle = freeze(dist, work)
        t1 = time.perf_counter()
        print(f"build: bundle {bundle} ({_mib(folder_size(bundle))}, {t1 - t0:.0f} s)", flush=True)
        outputs: list[Path] = []
        if sys.platform.startswith("linux"):
            if args.package != "none":
                outputs = package_linux(bundle, dist, args.package)
        elif sys.platform == "win32":
            outputs = package_windows(bundle, dist)
        elif sys.platform == "darwin":
            outputs = package_macos(dist)
        else:
            raise BuildError(f"no installer recipe for {sys.platform}")
        t2 = time.perf_counter()
        for o in outputs:
            print(f"build: {o} ({_mib(o.stat().st_size)})")
        print(f"build: done in {t2 - t0:.0f} s (packaging {t2 - t1:.0f} s)")
        return 0
    except BuildError as exc:
        print(f"build: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
