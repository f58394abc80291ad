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


# A fresh install: nothing cached. Loading with warm-up compiles; a speculative reply after it
# (the default model fully local, its draft head, trees of 8 nodes) compiles nothing.
COLD_REPLY = """
import json
import engine.kernels as K
import engine.speculative as spec
from engine.chat import messages_for, prompt_ids
from engine.sampling import SamplingParams
from engine.split import SplitRunner, load_client

start = K.compiles()
client = load_client("smollm2-135m-instruct", 15, warm_up=True)
loaded = K.compiles()
runner = SplitRunner(client, None)
ids = prompt_ids(client.tokenizer, messages_for("List three fruits and their colours."))
got = spec.generate_speculative(
    runner, ids, SamplingParams(max_new_tokens=16), options=spec.SpecOptions(fixed_budget=8)
)
print(json.dumps({"at_load": loaded - start, "in_reply": K.compiles() - loaded,
                  "nodes": got.stats.tree_nodes_sent - got.stats.round_trips}))
"""


def test_a_fresh_install_compiles_while_loading_not_inside_the_first_reply(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba")  # an empty kernel cache
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", COLD_REPLY], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=600, check=True,
    )  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["at_load"] > 0  # the cache was empty: loading compiled the kernels
    assert got["nodes"] > 0  # drafted rounds were verified
    assert got["in_reply"] == 0, got


def test_compiles_counts_numba_compilations_not_cache_loads() -> None:
    from numba import njit

    from engine import kernels

    before = kernels.compiles()

    @njit(cache=False)  # type: ignore[untyped-decorator]
    def twice(x: int) -> int:
        return 2 * x

    assert twice(3) == 6
    after = kernels.compiles()
    assert after > before  # compiled on first call
    assert twice(4) == 8 and kernels.compiles() == after  # then called, not compiled
