"""What this CPU can do fast, for choosing kernels and the default compute dtype.

Features come from the LLVM host description numba compiles for (the same code generator that
builds the kernels, so "has avx512bf16" means the kernels could use it), with /proc/cpuinfo as
the fallback. Nothing here runs a benchmark: choices are by feature, and the measurements that
justify them are in docs/performance.md.

``VEIL_CPU_FEATURES_OFF`` (comma-separated LLVM names, e.g. ``avx512vnni,avxvnni``) hides
features from these choices: to test the code other CPUs run, or to step around a feature
that misbehaves on one machine. The quantized kernels' cache is keyed by what is left (and by
the int8 kernels' vector width, :func:`wide_int8`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

# /proc/cpuinfo spellings -> LLVM spellings, for the features we care about
_CPUINFO = {
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512_vnni": "avx512vnni",
    "avx_vnni": "avxvnni",
    "avx512_bf16": "avx512bf16",
    "avx512_fp16": "avx512fp16",
    "amx_bf16": "amx-bf16",
    "amx_int8": "amx-int8",
    "amx_fp16": "amx-fp16",
    "amx_tile": "amx-tile",
}


def features_off() -> frozenset[str]:
    """Features hidden by ``VEIL_CPU_FEATURES_OFF``."""
    raw = os.environ.get("VEIL_CPU_FEATURES_OFF", "")
    return frozenset(f.strip().lower() for f in raw.split(",") if f.strip())


@functools.cache
def features() -> frozenset[str]:
    """LLVM names of the host CPU's features (``avx2``, ``avx512bf16``, ``amx-bf16``, ...),
    less those hidden by ``VEIL_CPU_FEATURES_OFF``."""
    return _host_features() - features_off()


def _host_features() -> frozenset[str]:
    try:
        import llvmlite.binding as llvm

        flat = llvm.get_host_cpu_features().flatten()
        return frozenset(f[1:] for f in flat.split(",") if f.startswith("+"))
    except Exception:  # no llvmlite, or a platform it cannot describe
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                have = set(line.split(":", 1)[1].split())
                return frozenset(v for k, v in _CPUINFO.items() if k in have)
    except OSError:
        pass
    return frozenset()


def has_fast_bf16() -> bool:
    """Native bfloat16 dot products (AVX512-BF16 or AMX-BF16): bf16 GEMMs beat float32 there.
    Without them torch converts bf16 to float32 in software, which is slower than float32."""
    f = features()
    return "avx512bf16" in f or "amx-bf16" in f


def has_fast_fp16() -> bool:
    """Native float16 arithmetic (AVX512-FP16 or AMX-FP16)."""
    f = features()
    return "avx512fp16" in f or "amx-fp16" in f


def has_int8_dot() -> bool:
    """Integer dot-product instructions (VNNI): int8 products at 4x the float32 rate."""
    f = features()
    return "avx512vnni" in f or "avxvnni" in f or "amx-int8" in f


def host_cpu_name() -> str:
    """LLVM's name for the host CPU (``znver4``, ``sapphirerapids``, ...; else ``generic``)."""
    try:
        import llvmlite.binding as llvm

        return str(llvm.get_host_cpu_name())
    except Exception:
        return "generic"


HALF_WIDTH_512 = frozenset({"znver4"})
"""CPUs that run 512-bit instructions as two 256-bit halves: 512-bit variants of the int8
kernels measured slower than the 256-bit ones on a Zen 4 (docs/performance.md)."""


def can_wide_int8() -> bool:
    """Whether this CPU has 512-bit integer dot products (AVX512-VNNI with AVX512BW)."""
    return {"avx512f", "avx512bw", "avx512vnni"} <= features()


def wide_int8() -> bool:
    """Whether the int8-activation kernels use 512-bit vectors: where the CPU has them
    (:func:`can_wide_int8`) at full width (not a :data:`HALF_WIDTH_512` CPU).
    ``VEIL_INT8_WIDTH=256`` or ``512`` overrides the choice (512 only where the CPU has it),
    which is how the tests run the path another CPU takes."""
    forced = os.environ.get("VEIL_INT8_WIDTH", "").strip()
    if forced == "256":
        return False
    if forced == "512":
        return can_wide_int8()
    return can_wide_int8() and host_cpu_name() not in HALF_WIDTH_512


def summary() -> str:
    """One line for diagnostics and benchmark records."""
    f = features()
    keys = ("avx2", "fma", "avx512f", "avx512vnni", "avxvnni", "avx512bf16", "amx-bf16", "amx-int8")
    return " ".join(k for k in keys if k in f) or "generic"


def default_dtype(device: str = "cpu") -> torch.dtype:
    """The compute dtype ``auto`` means: bfloat16 on CUDA, float32 on every CPU.

    CPUs with native bf16 products (AVX512-BF16, AMX) were once given bfloat16 too, but on a
    Zen 4 (AVX512-BF16) the speculative decoder's output then differed from sequential
    decoding (and bf16 greedy text differs from the float32 model's from the first tokens on
    the default model), so bfloat16 on a CPU is an explicit choice (``--dtype bfloat16``)."""
    if str(device).startswith("cuda"):
        return torch.bfloat16
    return torch.float32
