"""Quantized test data: random valid blocks per format, simple K-quant quantizers, and tiny
GGUF files written with the gguf package's writer from a tiny float model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine.quant import BLOCKS, QuantWeight, row_bytes

SCALE_AT = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q6_k": (208,)}
SCALE_AT |= {"q5_0": (0,), "q5_1": (0, 2), "q5_k": (0, 2)}


def rand_quant(fmt: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """An [n, k] matrix of random bytes in ``fmt`` with small positive float16 scales (every
    byte pattern is a valid block once the scales are finite)."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, row_bytes(fmt, k)), dtype=np.uint8)
    if fmt == "int8":
        return QuantWeight("int8", data, k, (rng.random(n) * 0.01 + 1e-3).astype(np.float32))
    per, nbytes = BLOCKS[fmt]
    blocks = data.reshape(n, k // per, nbytes)
    for off in SCALE_AT[fmt]:
        s = (rng.random((n, k // per)) * 0.02 + 1e-4).astype(np.float16)
        blocks[:, :, off : off + 2] = s.view(np.uint8).reshape(n, k // per, 2)
    return QuantWeight(fmt, data, k)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """A simple (not llama.cpp's) Q4_K quantizer: rows [N, K] float -> uint8 [N, K/256*144]."""
    n, k = w.shape
    sb = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(sb.min(-1), 0.0)
    hi = sb.max(-1)
    scf, mnf = (hi - lo) / 15.0, -lo  # per sub-block scale and (positive) min
    d = (scf.max(-1) / 63.0).astype(np.float16)  # [n, nb]
    dmin = (mnf.max(-1) / 63.0).astype(np.float16)
    df, dmf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scf, df, out=np.zeros_like(scf), where=df > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(mnf, dmf, out=np.zeros_like(mnf), where=dmf > 0)), 0, 63)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.divide(sb + (dmf * mn)[..., None], step, out=np.zeros_like(sb), where=step > 0)
    q = np.clip(np.round(q), 0, 15).astype(np.uint8).reshape(n, k // 256, 4, 2, 32)
    qs = (q[:, :, :, 0, :] | (q[:, :, :, 1, :] << 4)).reshape(n, k // 256, 128)
    s = np.zeros((n, k // 256, 12), np.uint8)
    s[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    s[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    out = np.concatenate(
        [d.view(np.uint8).reshape(n, -1, 2), dmin.view(np.uint8).reshape(n, -1, 2), s, qs], -1
    )
    return out.reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """A simple Q6_K quantizer: rows [N, K] float -> uint8 [N, K/256*210]."""
    n, k = w.shape
    g = w.reshape(n, k // 256, 16, 16).astype(np.float32)
    scf = np.abs(g).max(-1) / 31.0  # [n, nb, 16]
    d = (scf.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scf, df, out=np.zeros_like(scf), where=df > 0)), -128, 127)
    step = (df * sc)[..., None]
    q = np.divide(g, step, out=np.zeros_like(g), where=step != 0)
    q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(n, k // 256, 2, 4, 32)
    ql = np.zeros((n, k // 256, 2, 64), np.uint8)
    ql[..., :32] = (q[:, :, :, 0] & 15) | ((q[:, :, :, 2] & 15) << 4)
    ql[..., 32:] = (q[:, :, :, 1] & 15) | ((q[:, :, :, 3] & 15) << 4)
    qh = (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2)
    qh = qh | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6)
    out = np.concatenate(
        [
            ql.reshape(n, -1, 128),
            qh.reshape(n, -1, 64),
            sc.astype(np.int8).view(np.uint8).reshape(n, -1, 16),
            d.view(np.uint8).reshape(n, -1, 2),
        ],
        -1,
    )
    return out.reshape(n, -1)


def quantize_rows(w: np.ndarray, fmt: str) -> np.ndarray:
    import gguf

    if fmt == "q4_k":
        return quantize_q4_k(w)
    if fmt == "q6_k":
        return quantize_q6_k(w)
    qtype = getattr(gguf.GGMLQuantizationType, fmt.upper())
    return np.asarray(gguf.quants.quantize(w.astype(np.float32), qtype))


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion-time rotary permutation of q/k rows."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(
    folder: Path, path: Path, fmt: str, arch: str = "llama", mixed: dict[str, str] | None = None
) -> None:
    """The tiny float model in ``folder`` as a GGUF file whose matrices are in ``fmt`` (norms
    and biases stay float32); llama q/k rows permuted and Gemma norms stored as 1 + w, as
    llama.cpp stores them. ``mixed``: tensor-name substring -> another format for those
    matrices (as ``*-Q4_K_M.gguf`` files store some v and down projections in Q6_K)."""
    import gguf
    from safetensors.torch import load_file

    from engine.loading import load_config
    from engine.quant.load import gguf_name

    cfg = load_config(folder)
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.n_layers)
    for name, t in sorted(sd.items()):
        g = gguf_name(name, cfg.family)
        if g is None:
            continue
        a = t.to(torch.float32).numpy()
        if cfg.norm_plus_one and g.endswith("norm.weight"):
            a = a + np.float32(1.0)
        if arch == "llama" and ".q_proj." in name:
            a = permute_qk(a, cfg.n_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = permute_qk(a, cfg.n_kv_heads)
        f = next((v for k, v in (mixed or {}).items() if k in name), fmt)
        if a.ndim == 2 and a.shape[1] % BLOCKS[f][0] == 0:
            qt = getattr(gguf.GGMLQuantizationType, f.upper())
            writer.add_tensor(g, quantize_rows(a, f), raw_dtype=qt)
        else:
            writer.add_tensor(g, np.ascontiguousarray(a))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
