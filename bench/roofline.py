"""This machine's roofline for the client's matrix products: memory read bandwidth and the
arithmetic peaks the kernels can reach (float32 FMA, int8 dot products), measured, not looked up.

    python bench/roofline.py [--json OUT] [--threads N]

* read bandwidth: a parallel sum over a 1 GiB array (numba, every thread), best of 5;
* float32 peak: torch's float32 GEMM on a 2048³ product (MKL/oneDNN, close to the FMA peak);
* bfloat16 and float16 GEMM: the same product in those dtypes (fast only where the CPU has
  AVX512-BF16/AMX or AVX512-FP16);
* int8 peak: torch's ``_int_mm`` (int8 x int8 -> int32 GEMM: vpmaddubsw/vpmaddwd on AVX2,
  vpdpbusd on VNNI, AMX tiles where present).

Run it under the shared CPU lock (``flock /tmp/veil-cpu.lock``); it takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second for a parallel read of ``gib`` GiB (sum of float32s)."""
    from numba import njit, prange

    @njit(parallel=True, fastmath=True, cache=False)  # type: ignore[untyped-decorator]
    def total(a: Any) -> float:
        s = 0.0
        for i in prange(a.shape[0]):
            s += a[i]
        return s

    a = np.ones(int(gib * (1 << 30)) // 4, dtype=np.float32)
    total(a[:1024])
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        total(a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best


def gemm_rate(dtype: torch.dtype, n: int = 2048, seconds: float = 3.0) -> float:
    """Multiply-adds x 2 per second for an n x n x n product in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    if dtype == torch.int8:
        a = torch.randint(-100, 100, (n, n), generator=g, dtype=torch.int8)
        b = torch.randint(-100, 100, (n, n), generator=g, dtype=torch.int8)

        def op() -> None:
            torch._int_mm(a, b)

    else:
        a = torch.randn(n, n, generator=g).to(dtype)
        b = torch.randn(n, n, generator=g).to(dtype)

        def op() -> None:
            torch.mm(a, b)

    op()
    reps, t0 = 0, time.perf_counter()
    best = float("inf")
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        op()
        best = min(best, time.perf_counter() - t)
        reps += 1
    return 2.0 * n**3 / best


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", default=None, metavar="OUT")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from engine.kernels import cpu

    if args.threads:
        torch.set_num_threads(args.threads)
    res: dict[str, Any] = {
        "cpu": cpu_name(),
        "features": sorted(cpu.features()),
        "threads": torch.get_num_threads(),
        "read_gb_s": round(read_bandwidth() / 1e9, 2),
    }
    for name, dt in (
        ("f32", torch.float32),
        ("bf16", torch.bfloat16),
        ("f16", torch.float16),
        ("int8", torch.int8),
    ):
        try:
            res[f"{name}_gemm_gop_s"] = round(gemm_rate(dt, seconds=2.0) / 1e9, 1)
        except RuntimeError as exc:  # an op this build lacks
            res[f"{name}_gemm_gop_s"] = None
            res[f"{name}_error"] = str(exc).splitlines()[0][:120]
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
