"""numba's on-disk kernel cache is found again by every later start, whatever the order in
which a process first uses its kernels and whether it inherited NUMBA_CACHE_DIR (as the
built-in server child does): issue 30, "Preparing kernels…" on a third start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Where each kernel's cache lives, as a new process defines them (nothing is compiled).
PROBE = """
import json
import engine.kernels as K
assert K.quant_available()
from engine.kernels import _fused_layer, _quant_mm
from engine.kernels._topk import top_k_softmax
from engine.kernels._attention import attend_rows
layer = _fused_layer.entry((2, 2, 2, 2), _quant_mm.layers_dir)
print(json.dumps({
    "layer": layer._cache._cache_path,
    "q4_1": _quant_mm.mm_q4_1._cache._cache_path,
    "topk": top_k_softmax._cache._cache_path,
    "attention": attend_rows._cache._cache_path,
}))
"""


def _paths(cache_home: Path, preset: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["XDG_CACHE_HOME"] = str(cache_home)
    env["PYTHONPATH"] = str(REPO)
    if preset:  # as the built-in server child starts: the app's value inherited
        env["NUMBA_CACHE_DIR"] = str(cache_home / "veil" / "numba")
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=300, check=True,
    )  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_kernels_are_cached_in_one_place_whatever_the_environment(tmp_path: Path) -> None:
    fresh = _paths(tmp_path, preset=False)
    inherited = _paths(tmp_path, preset=True)
    assert fresh == inherited
    root = str(tmp_path / "veil" / "numba")
    assert all(p.startswith(root) for p in fresh.values()), fresh  # never beside the source
