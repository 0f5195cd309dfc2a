"""The lean Llama forward gives transformers' forward's logits, bit for bit, over every linears mode,
and takes only the models it computes exactly."""

from __future__ import annotations

import copy

import pytest
import support
import torch

from specmesh_kernels import cpu_linear
from specmesh_server import lean_llama
from specmesh_server.model_runner import ModelRunner
from specmesh_server.packed_linear import GEMV_ROWS


@pytest.fixture
def tiny_llama():
    # 40 MLP columns: SiLU's vectorised body and scalar tail both run on a step's rows
    return support.tiny_llama(tie_word_embeddings=True, intermediate_size=40)


@pytest.mark.parametrize("linears", ["stock", "packed", "gemv"])
@pytest.mark.parametrize("block_size", [None, 4])
def test_the_lean_forward_equals_transformers_forward_bit_for_bit(tiny_llama, linears, block_size):
    """Slot and paged caches; prefill (oneDNN or stock), tree steps, decode steps of 1 and 2 rows (with
    gemv, the fused kernel)."""
    runners = [
        ModelRunner(copy.deepcopy(tiny_llama), torch.device("cpu"), torch.float32, 256, linears=linears,
                    block_size=block_size, lean=lean)
        for lean in (False, True)
    ]  # fmt: skip
    stock, lean = runners
    assert isinstance(lean.decoder, lean_llama.LeanLlama) and not isinstance(stock.decoder, lean_llama.LeanLlama)
    assert (lean.decoder.layers[0].qkv is not None) == (lean.linears == "gemv")
    for want, got in zip(support.runner_steps(stock), support.runner_steps(lean), strict=True):
        assert torch.equal(got, want)


class Calls(list):
    """The token shapes of the native loop's steps; ``ordered``: whether each attended in key order."""

    ordered: list[bool]


@pytest.fixture
def native_calls(monkeypatch):
    """The token shapes of the steps the native decoder loop ran (a spy on ``cpu_linear.decode_layers``)."""
    calls, native = Calls(), cpu_linear.decode_layers
    calls.ordered = []

    def spy(x, *args, **kwargs):
        calls.append(tuple(x.shape[:2]))
        calls.ordered.append(kwargs["ordered"])
        return native(x, *args, **kwargs)

    monkeypatch.setattr(cpu_linear, "decode_layers", spy)
    return calls


@pytest.mark.skipif(not cpu_linear.cpu_supported(), reason="this CPU has no AVX2/FMA")
def test_the_native_loop_runs_every_step_over_the_paged_cache(tiny_llama, native_calls):
    """Every step over the paged cache runs natively: the 40-token prefill on oneDNN's products where the
    kernel takes fewer rows (GEMV_ROWS: 24 with AVX2 alone, 48 with AVX-512), on the fused ones otherwise, as
    the 20-token one, the 8-token tree step and the decode steps. Steps whose rows bring at most
    ORDERED_WIDTH tokens attend in key order, the 20-token prefills by flash attention."""
    runner = ModelRunner(tiny_llama, torch.device("cpu"), torch.float32, 256, linears="gemv", block_size=4)
    native = runner.decoder.native
    assert native is not None and native.small.rows == GEMV_ROWS and native.large is not None
    support.runner_steps(runner)
    assert native_calls == [(2, 20), (2, 4), (2, 1), (1, 20), (1, 1)]
    assert native_calls.ordered == [False, True, True, False, True]


@pytest.mark.skipif(not cpu_linear.cpu_supported(), reason="this CPU has no AVX2/FMA")
@pytest.mark.parametrize("weights", ["gemv", "gguf"])
def test_the_native_loop_equals_the_python_loop_over_long_runs_in_place(weights, native_calls):
    """Contexts of ~600 positions: rows of two long runs read in place (their softmaxes merged by log-sum-exp)
    and short runs copied, at decode (2 rows × 1), tree (1 row × 4, masked) and packed steps (a 4-token
    tree beside 1 token), bit for bit."""
    from specmesh_server.attention import Packing
    from specmesh_server.kv_blocks import BlockTable
    from specmesh_server.model_runner import causal_mask

    model = support.tiny_llama(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    if weights == "gguf":
        _to_gguf(model)
    runners = [
        ModelRunner(copy.deepcopy(model), torch.device("cpu"), torch.float32, 1024, linears="gemv", block_size=16,
                    kv_budget_bytes=1 << 22)
        for _ in range(2)
    ]  # fmt: skip
    runners[0].decoder.native = None  # the reference: the same loop in Python
    # row 0: blocks 0-19 and 40-59 (two runs of 320 positions in place); row 1: blocks 20-39 in place, then
    # 61, 63 … 99 (short runs, copied)
    tables = [
        BlockTable(b"", blocks=[*range(20), *range(40, 60)]),
        BlockTable(b"", blocks=[*range(20, 40), *range(61, 100, 2)]),
    ]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 660), generator=gen)
    out = []
    for runner in runners:
        rows = runner.cache.rows(tables, 640)
        pos = torch.arange(600)[None].expand(2, 600)
        logits = [runner.logits(runner.forward(rows, ids[:, :600], pos, causal_mask(pos, 600)))]
        for p in range(600, 604):  # four decode steps of both rows
            last = torch.full((2, 1), p)
            logits.append(runner.logits(runner.forward(rows, ids[:, p : p + 1], last, causal_mask(last, p + 1))))
        tree = torch.tensor([[604, 605, 605, 606]])  # one row's tree, siblings apart
        mask = causal_mask(torch.arange(604, 608)[None], 608)
        mask[0, 2, 605] = False
        write = torch.arange(604, 608)[None]
        one = runner.cache.rows(tables[:1], 640)
        logits.append(runner.logits(runner.forward(one, ids[:1, 604:608], tree, mask, write)))
        # packed: row 0's 4-token tree beside row 1's one token (5 tokens, not the padded 8)
        pos = torch.tensor([[608, 609, 609, 610], [604, 604, 604, 604]])
        mask = causal_mask(pos, 612)
        mask[0, 2, 609] = False
        write = torch.tensor([[608, 609, 610, 611], [604, 605, 606, 607]])
        packing = Packing(torch.tensor([0, 0, 0, 0, 1]), torch.tensor([0, 1, 2, 3, 0]), batch=2, width=4)
        logits.append(runner.logits(runner.forward(rows, ids[:, 608:612], pos, mask, write, packing=packing)))
        out.append(logits)
    for want, got in zip(*out, strict=True):
        assert torch.equal(got, want)
    assert native_calls == [(2, 600)] + [(2, 1)] * 4 + [(1, 4), (1, 5)]
    assert native_calls.ordered == [weights == "gguf"] + [True] * 6  # float32: flash attention for the prefill


@pytest.mark.skipif(not cpu_linear.cpu_supported(), reason="this CPU has no AVX2/FMA")
def test_over_gguf_blocks_a_tokens_logits_are_the_same_bits_in_any_step(native_calls):
    """GGUF products quantize their input to int8, so an ulp anywhere before may flip a rounding: a token's
    logits must not depend on its step at all. Three tokens of two rows (~600 positions, long runs in place
    and short ones copied) decoded one step at a time, as one tree each with a sibling branch beside the
    path, and packed beside the other row's tree: the same bits every way (what makes speculation over
    these weights token-identical to plain decoding)."""
    from specmesh_server.attention import Packing
    from specmesh_server.kv_blocks import BlockTable
    from specmesh_server.model_runner import causal_mask

    model = support.tiny_llama(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    _to_gguf(model)
    tables = [
        BlockTable(b"", blocks=[*range(20), *range(40, 60)]),
        BlockTable(b"", blocks=[*range(20, 40), *range(61, 100, 2)]),
    ]
    ids = torch.randint(0, 64, (2, 610), generator=torch.Generator().manual_seed(4))

    def prefilled():
        runner = ModelRunner(copy.deepcopy(model), torch.device("cpu"), torch.float32, 1024, linears="gemv",
                             block_size=16, kv_budget_bytes=1 << 22)  # fmt: skip
        rows = runner.cache.rows(tables, 640)
        pos = torch.arange(600)[None].expand(2, 600)
        runner.forward(rows, ids[:, :600], pos, causal_mask(pos, 600))
        return runner, rows

    runner, rows = prefilled()
    alone = []  # [2, vocab] per token 600, 601, 602
    for p in range(600, 603):
        last = torch.full((2, 1), p)
        alone.append(runner.logits(runner.forward(rows, ids[:, p : p + 1], last, causal_mask(last, p + 1)))[:, 0])
    # each row: 600, 601, a sibling of 601 (token 7), then 602 below 601; written at columns 600-603
    tree_ids = torch.stack([ids[:, 600], ids[:, 601], torch.full((2,), 7), ids[:, 602]], dim=1)
    tree_pos = torch.tensor([[600, 601, 601, 602]] * 2)
    mask = causal_mask(torch.arange(600, 604)[None].expand(2, 4), 604)
    mask[:, 2, 601], mask[:, 3, 602] = False, False  # the sibling apart from the path
    write = torch.arange(600, 604)[None].expand(2, 4)
    runner, rows = prefilled()
    tree = runner.logits(runner.forward(rows, tree_ids, tree_pos, mask, write))  # [2, 4, vocab]
    for token, node in ((0, 0), (1, 1), (2, 3)):
        assert torch.equal(tree[:, node], alone[token]), token
    # packed: row 0's tree (4 tokens) beside row 1's token 600 alone
    runner, rows = prefilled()
    pos = torch.tensor([[600, 601, 601, 602], [600, 600, 600, 600]])
    mask = causal_mask(torch.tensor([[600, 601, 602, 603], [600, 600, 600, 600]]), 604)  # by column
    mask[0, 2, 601], mask[0, 3, 602] = False, False
    write = torch.tensor([[600, 601, 602, 603], [600, 601, 602, 603]])
    packing = Packing(torch.tensor([0, 0, 0, 0, 1]), torch.tensor([0, 1, 2, 3, 0]), batch=2, width=4)
    packed_ids = torch.cat([tree_ids[:1], ids[1:, 600:601].expand(1, 4)], dim=0)
    packed = runner.logits(runner.forward(rows, packed_ids, pos, mask, write, packing=packing))  # [1, 5, vocab]
    assert torch.equal(packed[0, 0], alone[0][0]) and torch.equal(packed[0, 3], alone[2][0])
    assert torch.equal(packed[0, 4], alone[0][1])
    assert all(shape[1] in (600, 1, 4, 5) for shape in native_calls) and len(native_calls) == 8


def _to_gguf(model) -> None:
    """Every linear on Q4_1 blocks, the head on Q8_0."""
    from gguf import GGMLQuantizationType, quantize

    from specmesh_server.gguf_weights import GGUFLinear
    from specmesh_server.packed_linear import gemv_supported

    assert gemv_supported()  # the kernel library, whichever test of the shuffled order comes first
    swaps = [(p, n, c) for p in model.modules() for n, c in p.named_children() if isinstance(c, torch.nn.Linear)]
    for parent, name, linear in swaps:
        kind = GGMLQuantizationType.Q8_0 if name == "lm_head" else GGMLQuantizationType.Q4_1
        blocks = torch.from_numpy(quantize(linear.weight.detach().numpy(), kind).copy())
        setattr(parent, name, GGUFLinear(blocks, int(kind), linear.in_features))


@pytest.mark.skipif(not cpu_linear.cpu_supported(), reason="this CPU has no AVX2/FMA")
def test_the_fused_weights_are_the_layers_own_memory(tiny_llama):
    runner = ModelRunner(tiny_llama, torch.device("cpu"), torch.float32, 256, linears="gemv")
    layer = runner.decoder.layers[0]
    attn = tiny_llama.model.layers[0].self_attn
    assert layer.qkv is not None and layer.qkv.weight.shape == (48 + 2 * 16, 48)  # 6 heads and 2 kv heads of 8
    for part, offset in ((attn.q_proj, 0), (attn.k_proj, 48), (attn.v_proj, 64)):
        assert part.plain.data_ptr() == layer.qkv.weight[offset].data_ptr()


@pytest.mark.skipif(not cpu_linear.cpu_supported(), reason="this CPU has no AVX2/FMA")
@pytest.mark.parametrize("block_size", [None, 4])
def test_over_gguf_blocks_the_lean_forward_equals_transformers_forward_over_them(block_size):
    """Every linear on Q4_1 blocks (the head on Q8_0): fused q/k/v and gate/up products at every step size."""
    from gguf import GGMLQuantizationType

    model = support.tiny_llama(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    _to_gguf(model)
    stock, lean = (
        ModelRunner(copy.deepcopy(model), torch.device("cpu"), torch.float32, 256, block_size=block_size, lean=lean)
        for lean in (False, True)
    )
    assert lean.decoder.layers[0].qkv.kind == int(GGMLQuantizationType.Q4_1)
    for want, got in zip(support.runner_steps(stock), support.runner_steps(lean), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "overrides",
    [dict(attention_bias=True), dict(mlp_bias=True), dict(hidden_act="gelu")],
)
def test_layers_it_does_not_compute_keep_transformers_forward(overrides):
    model = support.tiny_llama(**overrides)
    runner = ModelRunner(model, torch.device("cpu"), torch.float32, 256)
    assert not lean_llama.supports(model) and not isinstance(runner.decoder, lean_llama.LeanLlama)


def test_half_precision_keeps_transformers_forward(tiny_llama):
    """transformers' RMSNorm rounds to the weight's dtype before its product; torch.rms_norm after."""
    runner = ModelRunner(tiny_llama.to(torch.bfloat16), torch.device("cpu"), torch.bfloat16, 256)
    assert lean_llama.supports(tiny_llama) and not isinstance(runner.decoder, lean_llama.LeanLlama)
