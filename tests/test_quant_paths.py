"""The int8-activation kernels' other instruction paths, checked on any machine.

The kernels pick VNNI (512- or 256-bit), AVX2 or portable IR by CPU feature, so a CI machine
with VNNI would never run the code a CPU without it runs. Here the product test runs again in a
child process with the faster features hidden (``VEIL_CPU_FEATURES_OFF``) or the other vector
width forced (``VEIL_INT8_WIDTH``), with its own kernel cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHILD = """
import sys
import pytest
from engine.kernels import _ir_int
{checks}
args = ["-q", "-p", "no:cacheprovider", "tests/test_quant.py", "-k", "int8_activation"]
sys.exit(pytest.main(args))
"""


def _product_test_in_child(checks: str, env_vars: dict[str, str], tmp_path: Path) -> None:
    """Run the int8 product test (9 formats) in a child process with ``env_vars`` set and a
    kernel cache of its own, after the child asserts ``checks`` (which path it takes)."""
    env = {**os.environ, **env_vars}
    env["HOME"] = env["XDG_CACHE_HOME"] = str(tmp_path)  # a kernel cache of its own
    r = subprocess.run(
        [sys.executable, "-c", CHILD.format(checks=checks)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "9 passed" in r.stdout, r.stdout[-3000:]


@pytest.mark.parametrize(
    ("off", "want_avx2"),
    [("avx512vnni,avxvnni", True), ("avx2,avx512vnni,avxvnni", False)],
    ids=["avx2-path", "portable-path"],
)
def test_int8_kernels_without_the_faster_features(
    off: str, want_avx2: bool, tmp_path: Path
) -> None:
    checks = (
        'assert not _ir_int._vnni(), "VNNI should be hidden"\n'
        f'assert {want_avx2} or not _ir_int._avx2(), "AVX2 should be hidden"'
    )
    _product_test_in_child(checks, {"VEIL_CPU_FEATURES_OFF": off}, tmp_path)


def test_int8_kernels_at_the_other_vector_width(tmp_path: Path) -> None:
    """CPUs with 512-bit VNNI at full width run the int8 kernels with 512-bit vectors (eight
    blocks per step), others with 256-bit ones (a Zen 4 has both and takes 256): the width
    this machine does not choose runs here in a child process (``VEIL_INT8_WIDTH``); the
    chosen one runs in tests/test_quant.py."""
    from engine.kernels import _ir_int, cpu

    if not _ir_int._vnni():
        pytest.skip("this CPU has no VNNI: the AVX2 test above covers its int8 path")
    if not _ir_int._wide() and not cpu.can_wide_int8():
        pytest.skip("this CPU has only 256-bit VNNI, which tests/test_quant.py runs")
    wide = not _ir_int._wide()
    checks = (
        f'assert _ir_int._vnni() and _ir_int._wide() == {wide}, "the width was not forced"\n'
        f"assert _ir_int.GROUP == {8 if wide else 4}"
    )
    _product_test_in_child(checks, {"VEIL_INT8_WIDTH": "512" if wide else "256"}, tmp_path)
