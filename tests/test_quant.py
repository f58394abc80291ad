"""Quantized weights: block decoding, the GGUF reader, the quantized matrix products (equal to
dequantize-then-multiply, batch-invariant) and the int8/int4 quantizers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine import kernels
from engine.errors import ModelLoadError
from engine.quant import QuantWeight, fuse, quantize_int4, quantize_int8
from engine.quant.gguf import GGUFFile
from tests.tiny_quant import quantize_rows, rand_quant

GGUF_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "q5_0", "q5_1", "q5_k")
ALL_FORMATS = (*GGUF_FORMATS, "int8")


def reference(w: QuantWeight) -> np.ndarray:
    """Dequantized by the gguf package (int8: by hand)."""
    if w.fmt == "int8":
        return w.data.view(np.int8).astype(np.float32) * w.scale[:, None]  # type: ignore[no-any-return]
    qtype = getattr(gguf.GGMLQuantizationType, w.fmt.upper())
    return np.asarray(gguf.quants.dequantize(w.data, qtype), dtype=np.float32)


@pytest.fixture(scope="module")
def quant_on() -> None:
    if not kernels.quant_available():
        pytest.fail(f"the quantized kernels should compile here: {kernels.quant_status()}")


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_decoding_equals_the_gguf_reference_exactly(quant_on: None, fmt: str) -> None:
    w = rand_quant(fmt, 37, 512, seed=1)
    assert np.array_equal(w.dequantize().numpy(), reference(w))
    rows = [36, 0, 5, 5]
    assert np.array_equal(w[rows].numpy(), reference(w)[rows])
    assert torch.equal(w[3], w.dequantize()[3])


def test_known_blocks_through_the_gguf_writer(tmp_path: Path) -> None:
    """Hand-made blocks written by gguf's writer decode to the values they encode."""
    q = np.arange(32) % 16  # the 4-bit values 0..15, twice
    q41 = np.concatenate(
        [
            np.array([0.5], np.float16).view(np.uint8),  # d
            np.array([-1.0], np.float16).view(np.uint8),  # m
            (q[:16] | (q[16:] << 4)).astype(np.uint8),
        ]
    )
    q80 = np.concatenate(
        [
            np.array([0.25], np.float16).view(np.uint8),
            np.arange(-16, 16, dtype=np.int8).view(np.uint8),
        ]
    )
    path = tmp_path / "blocks.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("a", np.stack([q41, q41]), raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("b", q80[None, :], raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("c", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(path)
    assert f.architecture == "llama"
    assert (f.tensors["a"].kind, f.tensors["a"].shape) == ("q4_1", (2, 32))
    a = QuantWeight("q4_1", f.raw("a"), 32).dequantize()
    assert torch.equal(a[0], torch.tensor(0.5 * q - 1.0, dtype=torch.float32))
    assert torch.equal(a[1], a[0])
    b = QuantWeight("q8_0", f.raw("b"), 32).dequantize()
    assert torch.equal(b[0], torch.arange(-16, 16, dtype=torch.float32) * 0.25)
    assert f.raw("c").view(np.float32).reshape(-1).tolist() == list(range(6))
    f.close()


def test_gguf_reader_rejects_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        GGUFFile(bad)
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little"))
    with pytest.raises(ModelLoadError, match="damaged or cut short"):
        GGUFFile(short)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError):
        GGUFFile(empty)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_product_equals_dequantize_then_multiply(quant_on: None, fmt: str, rows: int) -> None:
    k = 1536 if fmt in ("q4_k", "q6_k", "q5_k") else 1120  # more than one decode chunk
    w = rand_quant(fmt, 45, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = kernels.linear(x, w)
    ref = x.double() @ torch.from_numpy(reference(w)).double().t()
    assert y.shape == (rows, 45) and y.dtype == torch.float32
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantized_products_are_batch_invariant(quant_on: None, fmt: str) -> None:
    """A row's result is bit-identical alone (decoded in registers), in a pair, or in any bigger
    block (decoded once into a buffer; four rows at a time, then one by one), at any position,
    with 1 or 2 threads; 1,536 inputs span two decode chunks."""
    w = rand_quant(fmt, 50, 1536, seed=3)
    x = torch.randn(21, 1536, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(21)])
    for size in (2, 3, 4, 5, 7, 8, 21):
        for start in range(0, 21 - size + 1, 6):
            assert torch.equal(
                kernels.linear(x[start : start + size], w), alone[start : start + size]
            )
    try:
        kernels.set_threads(1)
        one = kernels.linear(x, w)
        kernels.set_threads(2)
        two = kernels.linear(x, w)
    finally:
        kernels.set_threads(None)
    assert torch.equal(one, alone) and torch.equal(two, alone)


def test_prefill_sized_blocks_use_the_same_path(quant_on: None) -> None:
    w = rand_quant("q4_1", 20, 256, seed=5)
    x = torch.randn(kernels.QUANT_ROWS + 40, 256, generator=torch.Generator().manual_seed(5))
    big = kernels.linear(x, w)
    assert torch.equal(big[-3:], kernels.linear(x[-3:], w))


def test_fallback_without_kernels_is_correct() -> None:
    w = rand_quant("q4_k", 30, 512, seed=6)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(6))
    with_kernel = kernels.linear(x, w)
    kernels.set_enabled(False)
    try:
        assert kernels.quant_status().startswith("tile decode")
        plain = kernels.linear(x, w)
        assert torch.equal(w.dequantize(), torch.from_numpy(reference(w)))
    finally:
        kernels.set_enabled(True)
    assert torch.allclose(plain, with_kernel, rtol=1e-5, atol=1e-5)


def test_bfloat16_input_and_autograd() -> None:
    w = rand_quant("q8_0", 16, 64, seed=7)
    xb = torch.randn(2, 64).bfloat16()
    assert kernels.linear(xb, w).dtype == torch.bfloat16
    x = torch.randn(3, 64, requires_grad=True)
    kernels.linear(x, w).sum().backward()
    assert x.grad is not None
    assert torch.allclose(x.grad, w.dequantize().sum(0).expand(3, 64))


def test_int8_and_int4_quantizers() -> None:
    g = torch.Generator().manual_seed(8)
    w = torch.randn(64, 256, generator=g) * 0.05
    q8 = quantize_int8(w)
    assert q8.fmt == "int8" and q8.nbytes() == 64 * 256 + 64 * 4
    err8 = (q8.dequantize() - w).abs().max(dim=1).values
    assert torch.all(err8 <= w.abs().max(dim=1).values / 254 + 1e-7)
    q4 = quantize_int4(w)
    assert q4.fmt == "q4_1" and q4.nbytes() == 64 * 256 // 32 * 20
    d4 = q4.dequantize()
    groups = w.reshape(64, 8, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # [64, 8]
    err4 = (d4 - w).abs().reshape(64, 8, 32).amax(-1)
    assert torch.all(err4 <= step * 0.5 + 1e-3 * step + 1e-6)
    # the int4 layout is GGUF's q4_1: gguf's reference decodes it the same way
    assert np.array_equal(reference(q4), d4.numpy())


def test_fuse_and_sizes() -> None:
    a = rand_quant("q4_k", 8, 256, seed=1)
    b = rand_quant("q6_k", 4, 256, seed=2)
    c = rand_quant("q4_k", 2, 256, seed=3)
    same = fuse([a, c])
    assert isinstance(same, QuantWeight) and same.shape == (10, 256)
    mixed = fuse([a, b, c])
    assert mixed.shape == (14, 256) and mixed.nbytes() == a.nbytes() + b.nbytes() + c.nbytes()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9))
    ref = torch.cat([kernels.linear(x, p) for p in (a, b, c)], dim=1)
    assert torch.equal(kernels.linear(x, mixed), ref)
    with pytest.raises(ValueError):
        QuantWeight("q4_1", np.zeros((2, 19), np.uint8), 32)


def test_gguf_quantizers_round_trip() -> None:
    """The test helpers' K-quant quantizers make blocks gguf decodes close to the input."""
    w = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32) * 0.1
    for fmt, tol in (("q4_k", 0.03), ("q6_k", 0.01), ("q8_0", 0.002), ("q4_1", 0.03)):
        qw = QuantWeight(fmt, quantize_rows(w, fmt), 512)
        assert np.abs(reference(qw) - w).max() < tol, fmt


@pytest.fixture(autouse=True)
def _float_acts_unless_asked(exact_float: None) -> None:
    """The products below are checked in both arithmetics: float activations unless a test
    asks for int8 ones."""


@pytest.fixture
def int8_acts() -> object:
    kernels.set_int8_activations(True)
    yield None
    kernels.set_int8_activations(False)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_int8_activation_products(quant_on: None, int8_acts: object, fmt: str) -> None:
    """With int8 activations, the product is exactly (activations rounded per block of 32, or
    256 for the K-quants) x (dequantized weights), to float rounding, and a row's bits do not
    depend on its block."""
    from engine.kernels._int_mm import quantize_acts, quantize_acts_k
    from engine.kernels._ir_int import GROUP

    # 15 blocks of 32: 3 groups of 4 and 3 alone, or (512-bit VNNI) 1 group of 8 and 7 alone
    k = 512 if fmt.endswith("_k") else 480
    w = rand_quant(fmt, 37, k, seed=11)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(11))
    y = kernels.linear(x, w)
    block = 256 if fmt.endswith("_k") else 32  # K-quants: activations per 256 (Q8_K)
    xq = np.empty((9, k), np.int8)
    xd = np.empty((9, k // block), np.float32)
    sums = 16 if block == 256 else 32  # integer sums, for the offsets and minimums
    xs = np.empty((9, k // sums), np.int16 if block == 256 else np.int32)
    (quantize_acts_k if block == 256 else quantize_acts)(x.numpy(), xq, xd, xs)
    if block == 32:  # whole groups of G blocks are stored interleaved: put them back in order
        g_ = GROUP
        pos = [
            8 * g_ * (i // 8) + 4 * (j + g_ * (i // 4 % 2)) + i % 4
            for j in range(g_)
            for i in range(32)
        ]
        for g in range(k // (32 * g_)):
            at = 32 * g_ * g
            xq[:, at : at + 32 * g_] = xq[:, at + np.array(pos)]
    assert np.array_equal(xq.astype(np.int32).reshape(9, -1, sums).sum(-1), xs)
    xr = (xq.astype(np.float64).reshape(9, -1, block) * xd[..., None]).reshape(9, k)
    ref = xr @ reference(w).astype(np.float64).T
    assert np.allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    exact = x.double().numpy() @ reference(w).astype(np.float64).T
    assert np.abs(y.numpy() - exact).max() < 0.05 * np.abs(exact).max()  # 8-bit activations
    alone = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(9)])
    assert torch.equal(alone, y)
    for size in (2, 3, 5, 6, 7):  # tiles of 4 rows then one of 3, 2 or 1 rows
        for start in (0, 9 - size):
            assert torch.equal(
                kernels.linear(x[start : start + size], w), alone[start : start + size]
            )
    assert "int8 activations" in kernels.quant_status()


def test_layer_entries_are_generated_once_and_survive_an_unwritable_cache(
    quant_on: None, tmp_path: Path
) -> None:
    from engine.kernels import _fused_layer

    codes = (8, 7, 6, 5)  # a combination no model in the suite uses
    _fused_layer._entries.pop(codes, None)
    folder = tmp_path / "layers"
    fn = _fused_layer.entry(codes, str(folder))
    src = folder / "veil_layer_8_7_6_5.py"
    assert src.is_file() and "layer_body(8, 7, 6, 5," in src.read_text()
    assert _fused_layer.entry(codes, str(folder)) is fn  # one module per combination
    stamp = src.stat().st_mtime_ns
    _fused_layer._entries.pop(codes)
    _fused_layer.entry(codes, str(folder))
    assert src.stat().st_mtime_ns == stamp  # same text: not rewritten (numba's cache keeps)
    # a cache folder that cannot be created: a temporary copy instead of an error
    (tmp_path / "file").write_text("x")
    _fused_layer._entries.pop(codes)
    other = _fused_layer.entry(codes, str(tmp_path / "file" / "layers"))
    assert callable(other) and not (tmp_path / "file" / "layers").exists()
    _fused_layer._entries.pop(codes)


@pytest.mark.parametrize("block", [32, 256])
def test_activation_rounding_is_the_same_in_parallel_serial_and_row_by_row(block: int) -> None:
    """Prefill quantizes its activation rows on several threads (from ``PARALLEL_ROWS`` rows):
    every row gets the bits it gets alone, and (blocks of 256) exactly numpy's float32
    ``floor(x * (127 / amax) + 0.5)`` clipped to ±127 — zero blocks, halves and huge values
    included."""
    from engine.kernels import _int_mm as Q

    k, rows = 1024, Q.PARALLEL_ROWS + 5
    g = np.random.default_rng(5)
    x = (g.standard_normal((rows, k)) * g.choice([1e-3, 1.0, 40.0], size=(rows, 1))).astype(
        np.float32
    )
    x[0, :256] = 0.0  # a zero block
    x[1, :4] = [127.0, -63.5, 0.5, -0.5]  # amax 127: exact halves, rounded up
    x[2, 5] = 3e30
    sums = 16 if block == 256 else 32

    def run(f: Callable[..., None], xs: np.ndarray, *extra: int) -> tuple[np.ndarray, ...]:
        n = xs.shape[0]
        q, d = np.empty((n, k), np.int8), np.empty((n, k // block), np.float32)
        s = np.empty((n, k // sums), np.int16 if block == 256 else np.int32)
        f(xs, q, d, s, *extra)
        return q, d, s

    serial = Q.quantize_acts_k if block == 256 else Q.quantize_acts
    parallel = Q.quantize_acts_k_rows if block == 256 else Q.quantize_acts_rows
    want = run(serial, x)
    for threads in (1, 2, 3):
        assert all(map(np.array_equal, run(parallel, x, threads), want))
    for r in (0, 1, 2, rows - 1):
        assert all(
            np.array_equal(a, b[r : r + 1])
            for a, b in zip(run(serial, x[r : r + 1]), want, strict=True)
        )
    if block == 256:
        blocks = x.reshape(rows, -1, 256)
        amax = np.abs(blocks).max(-1, keepdims=True)
        inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0)
        ref = np.clip(np.floor(blocks * inv.astype(np.float32) + np.float32(0.5)), -127, 127)
        assert np.array_equal(want[0], ref.reshape(rows, k).astype(np.int8))
        assert np.array_equal(want[1], (amax[..., 0] / np.float32(127.0)).astype(np.float32))


def test_the_fused_layers_silu_gate_is_per_value_and_close_to_silu(quant_on: None) -> None:
    """The one-call layer's gate, act = silu(g) * u, in parallel jobs of ``SILU_COLS`` columns:
    every value gets the bits it gets in any other row, column or block (its own operations
    only, so a vector body and a scalar tail agree), from columns at any offset of the gate's
    and the up part's arrays, and within 2 float32 ulps of silu computed in float64 (with
    the kernel's floor: e^-87 for gates below -87)."""
    from engine.kernels._fused_layer import SILU_COLS, silu_gate

    inter = SILU_COLS + 37  # a full job and a short one, a scalar tail in each
    g = np.random.default_rng(8)
    gu = (g.standard_normal((5, 2 * inter + 3)) * 6).astype(np.float32)
    gu[0, 3:23] = [0, -0.0, 1e-30, -1e-30, 88, -88, 200, -200, 1, -1] + [3, -3] * 5
    act = np.empty((5, inter), np.float32)
    silu_gate(gu, 3, gu, 3 + inter, inter, act)  # gate at column 3, up right after it
    gate = gu[:, 3 : 3 + inter].astype(np.float64)
    up = gu[:, 3 + inter : 3 + 2 * inter]
    e = np.exp(np.maximum(-np.abs(gate), -87.0))  # below -87 the gate counts as -87 (< 1e-35)
    want = (gate * np.where(gate >= 0, 1.0, e) / (1.0 + e)).astype(np.float32) * up
    assert np.allclose(act, want, rtol=2.5e-7, atol=0)
    # the same values in another row, at another column, one row at a time
    moved = np.zeros((1, inter + 11), np.float32)
    one = np.empty((1, inter), np.float32)
    for r in range(5):
        moved[0, 11:] = gu[r, 3 : 3 + inter]
        silu_gate(moved, 11, up[r : r + 1].copy(), 0, inter, one)
        assert np.array_equal(one[0].view(np.uint32), act[r].view(np.uint32)), r
    # a value's bits do not depend on its column within a job (vector body vs scalar tail)
    shifted = np.empty((5, inter - 1), np.float32)
    silu_gate(gu, 4, gu, 4 + inter, inter - 1, shifted)
    assert np.array_equal(shifted.view(np.uint32), act[:, 1:].view(np.uint32))
