"""The float32 row kernel: equal to torch, batch-invariant, and safe fallbacks."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from engine import kernels
from engine.split import SplitRunner, load_client, load_trunk


@pytest.fixture
def kernel_on() -> None:
    if not kernels.available():
        pytest.fail(f"the kernel should compile on the test machine: {kernels.status()}")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64])
@pytest.mark.parametrize("shape", [(576, 960), (37, 11), (1536, 576), (64, 100)])
def test_kernel_matches_torch(kernel_on: None, rows: int, shape: tuple[int, int]) -> None:
    k_in, n_out = shape
    g = torch.Generator().manual_seed(rows * 1000 + k_in)
    x = torch.randn(rows, k_in, generator=g)
    w = torch.randn(n_out, k_in, generator=g)
    y = kernels.linear(x, w)
    ref = torch.nn.functional.linear(x.double(), w.double()).float()
    assert y.shape == (rows, n_out)
    assert torch.allclose(y, ref, atol=2e-4 * k_in**0.5, rtol=1e-4)


@pytest.mark.parametrize("shape", [(300, 576), (70, 579)])
def test_kernel_is_batch_invariant(kernel_on: None, shape: tuple[int, int]) -> None:
    """A row gets bit-identical results alone or inside any block, at any position — across
    the 4-row register blocks, the 16-row groups, a short last weight tile (70 = 2 x 32 + 6)
    and an input width that is not a multiple of 16 (579: the scalar tail)."""
    n_out, k_in = shape
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n_out, k_in, generator=g)
    x = torch.randn(41, k_in, generator=g)
    alone = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(41)])  # [41, N]
    for size in (2, 3, 4, 5, 8, 9, 13, 17, 23, 36, 41):
        for start in range(0, 41 - size + 1, 5):
            block = kernels.linear(x[start : start + size], w)
            assert torch.equal(block, alone[start : start + size]), (size, start)


def test_the_client_and_the_batching_worker_share_one_kernel(kernel_on: None) -> None:
    """The trunk worker's invariant product gives the client kernel's bits (one kernel)."""
    from engine.kernels import batched

    assert batched.available(), batched.status()
    g = torch.Generator().manual_seed(11)
    w = torch.randn(45, 200, generator=g)
    x = torch.randn(9, 200, generator=g)
    assert torch.equal(batched.linear(x, w), kernels.linear(x, w))


def test_non_contiguous_input_and_threads(kernel_on: None) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(50, 40, generator=g)
    x = torch.randn(40, 6, generator=g).t()  # [6, 40], not contiguous
    ref = kernels.linear(x.contiguous(), w)
    assert torch.equal(kernels.linear(x, w), ref)
    # from another thread, with a different torch thread count
    out: list[torch.Tensor] = []

    def work() -> None:
        torch.set_num_threads(1)
        out.append(kernels.linear(x, w))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert torch.equal(out[0], ref)


def test_fallbacks_use_torch() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(20, 16, generator=g)
    # autograd: the kernel has no backward, so grads must flow through torch
    x = torch.randn(3, 16, generator=g, requires_grad=True)
    kernels.linear(x, w).sum().backward()
    assert x.grad is not None and torch.allclose(x.grad, w.sum(0).expand(3, 16))
    # other dtypes and big blocks go to torch and keep their dtype
    xb = torch.randn(2, 16, generator=g).bfloat16()
    assert kernels.linear(xb, w.bfloat16()).dtype == torch.bfloat16
    big = torch.randn(kernels.MAX_ROWS + 1, 16, generator=g)
    assert torch.allclose(kernels.linear(big, w), big @ w.t(), atol=1e-5)


def test_disabled_kernel_gives_the_same_tokens(tiny_llama: Path) -> None:
    """The model runs the same with the kernel and with BLAS (to float tolerance)."""
    client = load_client(str(tiny_llama), 1)
    s, e = client.plan.trunk_range
    runner = SplitRunner(client, load_trunk(str(tiny_llama), s, e))
    ids = list(range(5, 40))
    with_kernel = runner.forward(ids, range(len(ids)))
    runner.reset()
    step = [runner.forward(ids[:30], range(30))[-1:]]
    step += [runner.forward([t], [i]) for i, t in enumerate(ids[30:], 30)]
    kernels.set_enabled(False)
    try:
        assert not kernels.available()
        assert kernels.status().startswith("BLAS")
        runner.reset()
        blas = [runner.forward(ids[:30], range(30))[-1:]]
        blas += [runner.forward([t], [i]) for i, t in enumerate(ids[30:], 30)]
    finally:
        kernels.set_enabled(True)
    assert torch.allclose(torch.cat(step), torch.cat(blas), atol=1e-4)
    assert torch.allclose(torch.cat(step), with_kernel[29:], atol=1e-4)


def test_kernel_threads_do_not_change_results(kernel_on: None) -> None:
    """Threads split the weight rows, never a dot product: the bits do not depend on them."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(1000, 576, generator=g)
    x = torch.randn(9, 576, generator=g)
    try:
        kernels.set_threads(1)
        one = kernels.linear(x, w)
        kernels.set_threads(2)
        assert kernels.threads() == 2
        two = kernels.linear(x, w)
    finally:
        kernels.set_threads(None)
    assert torch.equal(one, two)
    assert kernels.threads() == torch.get_num_threads()
    with pytest.raises(ValueError):
        kernels.set_threads(0)


def test_starting_the_kernel_keeps_torchs_thread_count() -> None:
    """numba's OpenMP pool used to reset the process's thread count to every core on its first
    product, so a process told to use one thread silently used all of them (in a fresh process:
    the pool starts once)."""
    code = (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "torch.randn(64, 64) @ torch.randn(64, 64)\n"  # torch's thread state in use
        "assert torch.get_num_threads() == 1\n"
        "from engine import kernels\n"
        "assert kernels.available(), kernels.status()\n"
        "kernels.linear(torch.randn(3, 64), torch.randn(128, 64))\n"
        "kernels.set_threads(2)\n"
        "kernels.linear(torch.randn(3, 64), torch.randn(128, 64))\n"
        "print(torch.get_num_threads())\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_top_k_softmax_matches_torch(kernel_on: None) -> None:
    """The verification's top-k successors: torch's ids and softmax probabilities; ties keep
    the lower token id first."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 5003, generator=g) * 6  # [B, V]
    got = kernels.top_k_softmax(logits, 8)
    assert got is not None
    ids, probs = got
    ref = logits.softmax(-1).topk(8, dim=-1)
    assert torch.equal(ids, ref.indices)
    assert torch.allclose(probs, ref.values, rtol=1e-5, atol=1e-8)
    ties = (logits / 4).round()  # few distinct values: many ties at the top
    ids, probs = kernels.top_k_softmax(ties, 8) or (None, None)
    assert ids is not None and probs is not None
    vals = ties.gather(1, ids)
    assert torch.equal(vals, ties.topk(8, dim=-1).values)
    for r in range(ties.shape[0]):
        for i in range(7):
            if vals[r, i] == vals[r, i + 1]:
                assert ids[r, i] < ids[r, i + 1]
    assert torch.allclose(probs, ties.softmax(-1).gather(1, ids), rtol=1e-5, atol=1e-8)
    # where it does not apply, the caller falls back to torch
    assert kernels.top_k_softmax(logits.double(), 8) is None
    assert kernels.top_k_softmax(logits, 6000) is None


@pytest.mark.parametrize(
    "shape",
    [(6, 2, 64, 5), (9, 3, 64, 19), (4, 1, 24, 11), (2, 2, 128, 3), (4, 2, 8, 9), (4, 2, 80, 9)],
    ids=["gqa", "smollm2-heads", "hd24", "hd128", "hd8", "hd80"],
)
def test_attention_depends_only_on_the_keys_a_row_sees(
    kernel_on: None, shape: tuple[int, int, int, int]
) -> None:
    """A row's attention over the keys its mask allows has the bits of the same query over
    just those keys, packed at the start of the cache and nothing masked — whatever slots they
    sat in (tree verification vs sequential decoding) and whatever block it is computed in
    (across the kernel's 8-row tiles, its 256-key value blocks, vector and scalar lanes of
    the head, the value sums of one query taken four 16-lane chunks at a time and of eight
    queries one chunk at a time: hd 80 has a group of four and one more) — and matches
    torch's SDPA."""
    nh, nkv, hd, rows = shape
    g = torch.Generator().manual_seed(5)
    cap = 300
    for end in (1, 7, 8, 9, 17, 40, 71, 257, 300):
        q = torch.randn(nh, rows, hd, generator=g)
        kc = torch.randn(nkv, cap, hd, generator=g) * 2
        vc = torch.randn(nkv, cap, hd, generator=g)
        mask = torch.rand(rows, end, generator=g) < 0.6
        mask[:, 0] = True
        if end > 40:  # a causal run of rows at the end, as a prompt chunk has
            mask[-1, -1] = False
        out = kernels.attention(q, kc, vc, end, mask)
        assert out is not None
        for b in range(rows):
            seen = mask[b].nonzero().flatten()
            kp = torch.zeros_like(kc)
            vp = torch.zeros_like(vc)
            kp[:, : seen.numel()] = kc[:, seen]
            vp[:, : seen.numel()] = vc[:, seen]
            alone = kernels.attention(q[:, b : b + 1].contiguous(), kp, vp, seen.numel(), None)
            assert alone is not None
            assert torch.equal(out[b], alone[0]), (end, b)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[:, b : b + 1][None],
                kc[:, seen].repeat_interleave(nh // nkv, 0)[None],
                vc[:, seen].repeat_interleave(nh // nkv, 0)[None],
            )[0]  # [nh, 1, hd]
            want = ref.transpose(0, 1).reshape(-1)  # [nh hd]
            torch.testing.assert_close(out[b], want, atol=3e-6, rtol=1e-5)


def test_capped_attention_is_row_invariant_and_matches_eager(kernel_on: None) -> None:
    """Soft-capped scores (Gemma 2) with a custom scale: the same bits alone and in a block,
    and the eager formula's values."""
    g = torch.Generator().manual_seed(7)
    nh, nkv, hd, rows, end = 4, 2, 32, 10, 50
    q = torch.randn(nh, rows, hd, generator=g) * 3
    kc = torch.randn(nkv, end, hd, generator=g) * 3
    vc = torch.randn(nkv, end, hd, generator=g)
    mask = torch.ones(rows, end, dtype=torch.bool).tril(end - rows)  # causal prompt rows
    out = kernels.attention(q, kc, vc, end, mask, scale=0.1, softcap=5.0)
    assert out is not None
    k = kc.repeat_interleave(nh // nkv, 0)
    scores = torch.tanh((q @ k.transpose(1, 2)) * 0.1 / 5.0) * 5.0  # [nh, B, T]
    att = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vc.repeat_interleave(2, 0)
    torch.testing.assert_close(out, att.transpose(0, 1).reshape(rows, -1), atol=3e-6, rtol=1e-5)
    for b in range(rows):
        n = int(mask[b].sum())
        alone = kernels.attention(
            q[:, b : b + 1].contiguous(), kc, vc, n, None, scale=0.1, softcap=5.0
        )
        assert alone is not None and torch.equal(out[b], alone[0]), b
