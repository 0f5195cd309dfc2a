"""The lean Llama forward gives transformers' forward's logits, bit for bit, over every linears mode,
and takes only the models it computes exactly."""

from __future__ import annotations

import copy

import pytest
import support
import torch

from specmesh_kernels import cpu_linear
from specmesh_server import lean_llama
from specmesh_server.model_runner import ModelRunner, causal_mask


@pytest.fixture
def tiny_llama():
    return support.tiny_llama(tie_word_embeddings=True)


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a prefill, a two-tree verification step (8 tokens) and a plain decode step (2 rows)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 25), generator=gen)
    pos = torch.arange(20)[None].expand(2, 20)
    tree_pos = torch.tensor([[20, 21, 21, 22], [20, 21, 22, 22]])  # two trees, by depth
    tree_mask = causal_mask(torch.arange(20, 24)[None].expand(2, 4), 24)
    tree_mask[0, 2, 21], tree_mask[1, 3, 22] = False, False  # siblings do not see each other
    write = torch.arange(20, 24)[None].expand(2, 4)
    last = torch.full((2, 1), 24)
    with runner.cache.measurement_rows(2, 32) as rows:
        return [
            runner.logits(runner.forward(rows, ids[:, :20], pos, causal_mask(pos, 20))),
            runner.logits(runner.forward(rows, ids[:, 20:24], tree_pos, tree_mask, write)),
            runner.logits(runner.forward(rows, ids[:, 24:], last, causal_mask(last, 25), last)),
        ]


@pytest.mark.parametrize("linears", ["stock", "packed", "gemv"])
@pytest.mark.parametrize("block_size", [None, 4])
def test_the_lean_forward_equals_transformers_forward_bit_for_bit(tiny_llama, linears, block_size):
    """Slot and paged caches; prefill (oneDNN or stock), tree steps, decode steps (the fused kernel)."""
    runners = [
        ModelRunner(copy.deepcopy(tiny_llama), torch.device("cpu"), torch.float32, 256, linears=linears,
                    block_size=block_size, lean=lean)
        for lean in (False, True)
    ]  # fmt: skip
    stock, lean = runners
    assert isinstance(lean.decoder, lean_llama.LeanLlama) and not isinstance(stock.decoder, lean_llama.LeanLlama)
    for want, got in zip(_steps(stock), _steps(lean), strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(not cpu_linear.cpu_supported(), reason="this CPU has no AVX2/FMA")
def test_the_fused_weights_are_the_layers_own_memory(tiny_llama):
    runner = ModelRunner(tiny_llama, torch.device("cpu"), torch.float32, 256, linears="gemv")
    layer = runner.decoder.layers[0]
    attn = tiny_llama.model.layers[0].self_attn
    assert layer.qkv is not None and layer.qkv.shape == (48 + 2 * 16, 48)  # 6 heads and 2 kv heads of 8
    for part, offset in ((attn.q_proj, 0), (attn.k_proj, 48), (attn.v_proj, 64)):
        assert part.plain.data_ptr() == layer.qkv[offset].data_ptr()


@pytest.mark.parametrize(
    "overrides",
    [dict(attention_bias=True), dict(mlp_bias=True), dict(hidden_act="gelu")],
)
def test_layers_it_does_not_compute_keep_transformers_forward(overrides):
    model = support.tiny_llama(**overrides)
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, 256)
    assert not lean_llama.supports(model) and not isinstance(runner.decoder, lean_llama.LeanLlama)
