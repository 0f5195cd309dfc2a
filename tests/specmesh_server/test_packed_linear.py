"""oneDNN linears with pre-packed weights compute what the stock linears compute."""

from __future__ import annotations

import copy

import pytest
import support
import torch

from specmesh_server.model_runner import ModelRunner, causal_mask
from specmesh_server.packed_linear import PackedLinear, linear_reference, pack_linears, supported

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


@pytest.fixture
def tiny_llama():
    return support.tiny_llama(tie_word_embeddings=True)


def test_pack_linears_swaps_every_linear_including_the_tied_head_and_keeps_the_embedding(tiny_llama):
    linears = sum(isinstance(m, torch.nn.Linear) for m in tiny_llama.modules())
    assert pack_linears(tiny_llama) == linears == 2 * 7 + 1  # q k v o gate up down per layer + lm_head
    assert not any(isinstance(m, torch.nn.Linear) for m in tiny_llama.modules())
    assert isinstance(tiny_llama.get_output_embeddings(), PackedLinear)
    assert isinstance(tiny_llama.get_input_embeddings(), torch.nn.Embedding)


def test_packed_runner_gives_the_stock_runners_logits_on_prefill_and_a_tree_step(tiny_llama):
    stock = ModelRunner(copy.deepcopy(tiny_llama), torch.device("cpu"), torch.float32, 256)
    packed = ModelRunner(copy.deepcopy(tiny_llama), torch.device("cpu"), torch.float32, 256, packed_linears=True)
    assert packed.packed_linears and not stock.packed_linears
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 24), generator=gen)
    pos = torch.arange(20)[None].expand(2, 20)
    tree_pos = torch.tensor([[20, 21, 21, 22], [20, 21, 22, 22]])  # two trees, by depth
    tree_mask = causal_mask(torch.arange(20, 24)[None].expand(2, 4), 24)
    tree_mask[0, 2, 21], tree_mask[1, 3, 22] = False, False  # siblings do not see each other
    write = torch.arange(20, 24)[None].expand(2, 4)
    out = []
    for runner in (stock, packed):
        prefill = runner.logits(runner.forward(slice(0, 2), ids[:, :20], pos, causal_mask(pos, 20)))
        step = runner.logits(runner.forward(slice(0, 2), ids[:, 20:], tree_pos, tree_mask, write))
        out.append((prefill, step))
    for want, got in zip(out[0], out[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
