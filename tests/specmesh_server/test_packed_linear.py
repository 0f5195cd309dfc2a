"""oneDNN linears with pre-packed weights, and the matrix-vector kernel for steps of a few rows,
compute what the stock linears compute."""

from __future__ import annotations

import copy

import pytest
import support
import torch

from specmesh_kernels import cpu_linear
from specmesh_server import packed_linear
from specmesh_server.model_runner import ModelRunner
from specmesh_server.packed_linear import GEMV_ROWS, PackedLinear, linear_reference, pack_linears, supported

pytestmark = pytest.mark.skipif(
    not supported(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN linear packing"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (2, 96), (7, 96), (65, 96), (3, 5, 96)])
def test_packed_linear_matches_the_stock_linear_for_every_row_count_and_rank(shape, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        got, want = PackedLinear(linear)(x), linear_reference(x, linear)
    assert got.shape == want.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_kernel_builds_wherever_the_cpu_has_avx2():
    """The default ``--linears gemv`` must not fall back silently on the machines CI runs on."""
    assert packed_linear.gemv_supported() == cpu_linear.cpu_supported()


gemv_only = pytest.mark.skipif(not cpu_linear.cpu_supported(), reason="this CPU has no AVX2/FMA")


@gemv_only
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "rows,k,n",
    [(1, 96, 40), (2, 96, 40), (3, 13, 9), (5, 100, 17), (8, 576, 192), (17, 64, 8), (1, 7, 3), (6, 5, 9)],
)
def test_the_kernel_matches_the_reference_for_any_rows_and_ragged_widths(rows, k, n, bias):
    """Weight blocks of 8 rows and 8-lane sums over k, with tails on both (k = 13, n = 17 …)."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    assert packed_linear.gemv_supported()
    got = cpu_linear.linear(x, w, b)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, cpu_linear.linear_reference(x, w, b), rtol=1e-5, atol=1e-5)


@gemv_only
def test_the_kernel_takes_any_leading_shape_and_non_contiguous_input_and_refuses_other_dtypes():
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 3, 48, generator=gen).transpose(0, 1), torch.randn(24, 48, generator=gen)
    assert packed_linear.gemv_supported() and not x.is_contiguous()
    got = cpu_linear.linear(x, w, None)
    assert got.shape == (3, 2, 24)
    torch.testing.assert_close(got, cpu_linear.linear_reference(x, w, None), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.linear(x.double(), w.double(), None)
    with pytest.raises(RuntimeError, match=r"x \[\.\.\., K\]"):
        cpu_linear.linear(x, w.t().contiguous(), None)


@gemv_only
@pytest.mark.parametrize("rows", [1, GEMV_ROWS, GEMV_ROWS + 1, 40])
def test_gemv_packed_linear_takes_the_kernel_up_to_its_rows_and_onednn_beyond(rows, monkeypatch):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(64, 24, bias=True)
    layer = PackedLinear(linear, gemv=True)
    calls = []
    kernel = cpu_linear.linear
    monkeypatch.setattr(cpu_linear, "linear", lambda *a: calls.append(a) or kernel(*a))
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), linear_reference(x, linear), rtol=1e-5, atol=1e-5)
    assert len(calls) == (1 if rows <= GEMV_ROWS else 0)


def test_effective_linears_fall_back_where_unsupported():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    want = "gemv" if cpu_linear.cpu_supported() else "packed"
    assert packed_linear.effective("gemv", cpu, torch.float32) == want
    assert packed_linear.effective("packed", cpu, torch.float32) == "packed"
    assert packed_linear.effective("gemv", cpu, torch.bfloat16) == "stock"
    assert packed_linear.effective("gemv", cuda, torch.float32) == "stock"
    with pytest.raises(ValueError, match="linears"):
        packed_linear.effective("fast", cpu, torch.float32)


@pytest.fixture
def tiny_llama():
    return support.tiny_llama(tie_word_embeddings=True)


def test_pack_linears_swaps_every_linear_including_the_tied_head_and_keeps_the_embedding(tiny_llama):
    linears = sum(isinstance(m, torch.nn.Linear) for m in tiny_llama.modules())
    assert pack_linears(tiny_llama) == linears == 2 * 7 + 1  # q k v o gate up down per layer + lm_head
    assert not any(isinstance(m, torch.nn.Linear) for m in tiny_llama.modules())
    assert isinstance(tiny_llama.get_output_embeddings(), PackedLinear)
    assert isinstance(tiny_llama.get_input_embeddings(), torch.nn.Embedding)


@pytest.mark.parametrize("linears", ["packed", "gemv"])
def test_packed_runner_gives_the_stock_runners_logits_on_prefill_and_a_tree_step(tiny_llama, linears):
    stock = ModelRunner(copy.deepcopy(tiny_llama), torch.device("cpu"), torch.float32, 256)
    packed = ModelRunner(copy.deepcopy(tiny_llama), torch.device("cpu"), torch.float32, 256, linears=linears)
    assert (packed.linears, stock.linears) == (packed_linear.effective(linears, packed.device, packed.dtype), "stock")
    out = [support.runner_steps(runner) for runner in (stock, packed)]
    for want, got in zip(out[0], out[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@gemv_only
@pytest.mark.parametrize("n", [1, 5, 64, 97])
def test_a_rows_product_has_the_same_bits_whatever_else_the_step_holds(n):
    """Tiles of weight rows by rows of x (3 × 4 in 8 lanes; with AVX-512 4 × 6 pairs of rows in 16), single
    rows, and their tails sum every output alike: a row's result is the same bits alone or beside any others
    (so a verification step multiplies a token as the plain step before it did). K = 100 leaves a 4-wide
    tail after the 8-lane sums: it is fused explicitly, as GCC with AVX-512 split it into products and sums
    in some tile shapes and not others."""
    gen = torch.Generator().manual_seed(n)
    x, w = torch.randn(GEMV_ROWS + 2, 100, generator=gen), torch.randn(n, 100, generator=gen)
    assert packed_linear.gemv_supported()  # built and loaded, whichever test ran first
    alone = torch.cat([cpu_linear.linear(x[i : i + 1], w, None) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 7, 8, 11, 12, 13, 17, 26, GEMV_ROWS - 1, GEMV_ROWS, GEMV_ROWS + 2):
        assert torch.equal(cpu_linear.linear(x[:rows], w, None), alone[:rows]), rows
