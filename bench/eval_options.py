"""The implementation options for quantized client products, measured on one matrix.

    python bench/eval_options.py [--n 28672] [--k 4096] [--rows 1,8,32] [--json OUT]

Times ``y = x @ W.T`` for W of Llama-3-8B's fused gate|up shape (28672 x 4096) at each block
size, and checks batch invariance (a row computed alone equals the same row inside the block,
bit for bit), for:

* torch float32 / bfloat16 ``F.linear`` (MKL / oneDNN);
* torch ``_weight_int8pack_mm`` (int8 per-channel weights, float activations);
* torch ``_weight_int4pack_mm_for_cpu`` (int4 groups of 32; what torchao's CPU int4 layout
  calls);
* onnxruntime ``MatMulNBits`` (4-bit blocks of 32, accuracy level 4 = int8 activations), if
  ``onnxruntime`` and ``onnx`` are importable;
* Veil's kernels: float32 small-row, Q8_0 / Q4_K with float activations, and with int8
  activations.

Random data; timing only (median of repeats, CPU named in the output).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timeit(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    full = fn(x)
    return all(torch.equal(fn(x[i : i + 1])[0], full[i]) for i in (0, x.shape[0] - 1))


def options(n: int, k: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    from engine import kernels
    from engine.quant import quantize_int8
    from tests.tiny_quant import rand_quant

    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    out["torch f32 F.linear"] = lambda x: torch.nn.functional.linear(x, w)
    wb = w.bfloat16()
    out["torch bf16 F.linear"] = lambda x: torch.nn.functional.linear(x.bfloat16(), wb).float()
    q8 = quantize_int8(w)
    q8t = torch.from_numpy(q8.data.view(np.int8).copy())
    s8 = torch.from_numpy(q8.scale.copy())
    out["torch _weight_int8pack_mm"] = lambda x: torch.ops.aten._weight_int8pack_mm(x, q8t, s8)
    try:
        q4 = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
        sz = torch.rand(k // 32, n, 2, generator=g) * 0.01
        out["torch _weight_int4pack_mm_for_cpu"] = lambda x: (
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
        )
    except (RuntimeError, AttributeError) as exc:
        print(f"int4pack unavailable: {exc}", file=sys.stderr)
    try:
        ort = _onnx_matmulnbits(n, k)
    except Exception as exc:  # an onnxruntime build without the op, a version mismatch
        print(f"onnxruntime MatMulNBits unavailable: {exc}", file=sys.stderr)
        ort = None
    if ort is not None:
        out["onnxruntime MatMulNBits (int8 acc.)"] = ort
    out["veil f32 small-row kernel"] = lambda x: kernels.linear(x, w)
    for fmt in ("q8_0", "q4_k"):
        qw = rand_quant(fmt, n, k, seed=1)

        def float_acts(x: torch.Tensor, qw: Any = qw) -> torch.Tensor:
            kernels.set_int8_activations(False)
            return kernels.linear(x, qw)

        def int_acts(x: torch.Tensor, qw: Any = qw) -> torch.Tensor:
            kernels.set_int8_activations(True)
            try:
                return kernels.linear(x, qw)
            finally:
                kernels.set_int8_activations(False)

        out[f"veil {fmt} (float activations)"] = float_acts
        out[f"veil {fmt} (int8 activations)"] = int_acts
    return out


def _onnx_matmulnbits(n: int, k: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return None
    rng = np.random.default_rng(0)
    blocks = k // 32
    b = rng.integers(0, 256, size=(n, blocks, 16), dtype=np.uint8)
    scales = (rng.random(n * blocks) * 0.01).astype(np.float32)
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "scales"],
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=32,
        accuracy_level=4,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
        initializer=[
            helper.make_tensor("B", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
            helper.make_tensor(
                "scales", TensorProto.FLOAT, scales.shape, scales.tobytes(), raw=True
            ),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10  # what onnxruntime 1.2x reads
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    _ = onnx  # imported for its helper module

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(sess.run(None, {"A": x.numpy()})[0])

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from app.cmd_bench import machine

    rows = [int(r) for r in args.rows.split(",")]
    res: dict[str, Any] = {
        "machine": machine(),
        "n": args.n,
        "k": args.k,
        "threads": torch.get_num_threads(),
    }
    table = {}
    for name, fn in options(args.n, args.k).items():
        entry: dict[str, Any] = {}
        with torch.inference_mode():
            x = torch.randn(max(rows), args.k, generator=torch.Generator().manual_seed(1))
            entry["batch_invariant"] = invariant(fn, x)
            for r in rows:
                entry[f"ms_{r}"] = round(
                    timeit(lambda r=r, fn=fn, x=x: fn(x[:r].contiguous()), args.repeats) * 1e3, 2
                )
        table[name] = entry
        print(
            f"{name:<40} "
            + " ".join(f"{r:>3} rows {entry[f'ms_{r}']:8.2f} ms" for r in rows)
            + f"  invariant: {entry['batch_invariant']}",
            flush=True,
        )
    res["results"] = table
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
