"""`veil bench client`: what one verification round costs this computer, per weight format.

Builds the client side of a split — ``k`` decoder layers at each end and the LM head — with
random weights of a published model's shapes (its config.json numbers, nothing downloaded), or
the real weights of a model spec with ``--real``, and times a round (the block through the 2k
layers, then the LM head on every row) at each block size. Prints ms per round and the bytes
of weights a round reads; ``--json OUT`` writes them.

Random weights time the arithmetic and memory traffic only; the numbers they produce mean
nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from engine.errors import VeilError

# config.json values of the published checkpoints (Meta-Llama-3-8B, Mistral-7B-v0.3,
# Qwen2-7B): only what the layer shapes need.
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
    },
    "mistral-7b": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "vocab_size": 32768,
        "rope_theta": 1000000.0,
    },
    "qwen2-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "num_hidden_layers": 28,
        "vocab_size": 152064,
        "rope_theta": 1000000.0,
    },
}
FORMATS = ("f32", "bf16", "q8_0", "int8", "q6_k", "q4_k", "q4_1", "q4_0")
PREFIX = 64  # cached tokens each block attends to


class BenchClientError(VeilError):
    """Bad `veil bench client` input."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "client",
        help="time one verification round of the client's layers and LM head, per format",
        description="Time the client side of a split (k layers at each end + LM head) on "
        "random weights of a published model's shapes, in each weight format.",
    )
    p.add_argument(
        "--shape",
        default="llama3-8b",
        metavar="NAME|MODEL",
        help=f"{', '.join(SHAPES)}, or a model spec (its config.json shapes)",
    )
    p.add_argument("--local-layers", type=int, default=2, metavar="K")
    p.add_argument("--rows", default="1,8,32", metavar="N,N,...", help="block sizes to time")
    p.add_argument(
        "--formats",
        default=",".join(FORMATS),
        metavar="F,F,...",
        help=f"weight formats (default: all of {', '.join(FORMATS)})",
    )
    p.add_argument(
        "--real",
        action="store_true",
        help="use the model's own weights (--shape must be a model spec): formats are then "
        "the --client-quant choices auto, none, int8, int4",
    )
    p.add_argument(
        "--int8-activations",
        action="store_true",
        help="also time every quantized format with int8 activations (format name + '+i8a')",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per point (median)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")


def parse_rows(text: str) -> list[int]:
    try:
        rows = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BenchClientError(f"--rows must be comma-separated integers, got '{text}'") from None
    if not rows or any(r < 1 or r > 256 for r in rows):
        raise BenchClientError("--rows values must be between 1 and 256")
    return rows


def shape_config(name: str) -> Any:
    from engine.config import ModelConfig

    if name.lower() in SHAPES:
        raw = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, **SHAPES[name.lower()]}
        return ModelConfig.from_hf(SimpleNamespace(**raw))
    from engine.loading import load_config, resolve

    return load_config(resolve(name).folder)


def random_matrix(fmt: str, n: int, k: int, gen: Any) -> Any:
    """An [n, k] matrix of random values stored in ``fmt`` (valid blocks, small scales)."""
    import numpy as np
    import torch

    from engine.quant import BLOCKS, QuantWeight, row_bytes

    if fmt == "f32":
        return torch.randn(n, k, generator=gen) * 0.02
    if fmt == "bf16":
        return (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    data = rng.integers(0, 256, size=(n, row_bytes(fmt, k)), dtype=np.uint8)
    if fmt == "int8":
        return QuantWeight("int8", data, k, np.full(n, 0.02 / 127, dtype=np.float32))
    per, nbytes = BLOCKS[fmt]
    blocks = data.reshape(n, k // per, nbytes)
    scale = np.full((n, k // per), 0.02 / 8, dtype=np.float16).view(np.uint8)
    scale = scale.reshape(n, k // per, 2)
    at = {"q6_k": (208,), "q4_1": (0, 2), "q4_k": (0, 2)}.get(fmt, (0,))
    for off in at:
        blocks[:, :, off : off + 2] = scale
    return QuantWeight(fmt, data, k)


def build(cfg: Any, k: int, fmt: str, seed: int = 0) -> tuple[Any, Any, Any, int]:
    """(head stack, tail stack, LM head, weight bytes per round) with random weights."""
    import torch

    from engine.model import LayerStack, LayerWeights
    from engine.quant import weight_bytes

    gen = torch.Generator().manual_seed(seed)
    h, hd = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    layers = []
    for _ in range(2 * k):
        layers.append(
            LayerWeights(
                ln1=torch.ones(h, dtype=dtype),
                wqkv=random_matrix(fmt, qkv, h, gen),
                wo=random_matrix(fmt, h, cfg.n_heads * hd, gen),
                ln2=torch.ones(h, dtype=dtype),
                wgu=random_matrix(fmt, 2 * cfg.intermediate_size, h, gen),
                wdown=random_matrix(fmt, h, cfg.intermediate_size, gen),
                bqkv=torch.zeros(qkv, dtype=dtype) if cfg.attn_bias else None,
            )
        )
    lm = random_matrix(fmt, cfg.vocab_size, h, gen)
    head = LayerStack(cfg, 0, layers[:k], dtype=dtype, capacity=PREFIX + 300)
    tail = LayerStack(cfg, cfg.n_layers - k, layers[k:], dtype=dtype, capacity=PREFIX + 300)
    nbytes = sum(w.nbytes() - weight_bytes(w.ln1) - weight_bytes(w.ln2) for w in layers)
    return head, tail, lm, nbytes + weight_bytes(lm)


def time_rounds(
    head: Any, tail: Any, lm: Any, norm: Any, cfg: Any, rows: int, repeats: int
) -> float:
    """Median seconds of one round: a block of ``rows`` tokens after PREFIX cached ones."""
    import torch

    from engine.kernels import linear
    from engine.model import rms_norm

    gen = torch.Generator().manual_seed(rows)
    dtype = head.dtype
    x0 = torch.randn(PREFIX, cfg.hidden_size, generator=gen).to(dtype)
    for st in (head, tail):
        st.reset()
        st.forward(x0, torch.arange(PREFIX))
    x = torch.randn(rows, cfg.hidden_size, generator=gen).to(dtype)
    pos = torch.arange(PREFIX, PREFIX + rows)
    parents = [i - 1 for i in range(rows)]
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            for st in (head, tail):
                st.cache.truncate(PREFIX)
            t = time.perf_counter()
            y = tail.forward(head.forward(x, pos, parents), pos, parents)
            linear(rms_norm(y, norm, cfg.rms_eps), lm)
            if i:  # the first round warms up (allocations, kernel compiles)
                times.append(time.perf_counter() - t)
    return statistics.median(times)


def real_client(spec: str, k: int, quant: str) -> tuple[Any, Any, Any, Any, int]:
    from engine.quant import weight_bytes
    from engine.split import load_client

    c = load_client(spec, k, client_quant=quant)
    nbytes = sum(w.nbytes() for w in c.head.layers + c.tail.layers) + weight_bytes(c.lm_head)
    return c.head, c.tail, c.lm_head, c.norm_weight, nbytes


def run(args: argparse.Namespace) -> int:
    import torch

    from app.cmd_bench import machine
    from engine import kernels
    from engine.kernels import cpu

    rows = parse_rows(args.rows)
    if args.local_layers < 1:
        raise BenchClientError("--local-layers must be at least 1")
    if args.repeats < 1:
        raise BenchClientError("--repeats must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            raise BenchClientError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    formats = [f.strip().lower() for f in args.formats.split(",") if f.strip()]
    if args.real:
        if args.formats == ",".join(FORMATS):
            formats = ["auto", "none", "int8", "int4"]
        bad = [f for f in formats if f not in ("auto", "none", "int8", "int4")]
    else:
        bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise BenchClientError(f"unknown format(s): {', '.join(bad)}")
    cfg = shape_config(args.shape)
    k = args.local_layers
    if 2 * k > cfg.n_layers:
        raise BenchClientError(f"--local-layers {k} is more than half of {cfg.n_layers} layers")
    results = []
    print(
        f"{args.shape}, k={k}: {machine()}; kernels: {kernels.status()}, "
        f"{kernels.quant_status()}; CPU features: {cpu.summary()}",
        file=sys.stderr,
    )
    print(f"{'format':<10} {'rows':>5} {'ms/round':>10} {'MB read':>9}")
    for fmt in formats:
        if args.real:
            head, tail, lm, norm, nbytes = real_client(args.shape, k, fmt)
        else:
            head, tail, lm, nbytes = build(cfg, k, fmt)
            norm = torch.ones(cfg.hidden_size, dtype=head.dtype)
        modes = [False]
        if args.int8_activations and fmt not in ("f32", "bf16", "none"):
            modes.append(True)
        for int8 in modes:
            kernels.set_int8_activations(int8)
            name = fmt + ("+i8a" if int8 else "")
            for n in rows:
                sec = time_rounds(head, tail, lm, norm, cfg, n, args.repeats)
                ms = round(sec * 1e3, 2)
                results.append(
                    {"format": name, "rows": n, "ms_per_round": ms, "bytes_read": nbytes}
                )
                print(f"{name:<10} {n:>5} {sec * 1e3:>10.1f} {nbytes / 1e6:>9.0f}", flush=True)
        kernels.set_int8_activations(False)
        del head, tail, lm
    out = {
        "shape": args.shape,
        "local_layers": k,
        "real_weights": bool(args.real),
        "machine": machine(),
        "cpu_features": cpu.summary(),
        "threads": torch.get_num_threads(),
        "kernel_threads": kernels.threads(),
        "results": results,
    }
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        except OSError as exc:
            raise BenchClientError(f"cannot write {args.json}: {exc.strerror or exc}") from None
    return 0
