"""Packed steps (the batch's real tokens as one row) give the padded layout's hidden states and
leave the same KV cache, through the SDPA path and the tree-attention kernel alike."""

from __future__ import annotations

import copy

import pytest
import support
import torch

from specmesh_server.attention import Packing
from specmesh_server.model_runner import ModelRunner, measure_context_cost
from specmesh_server.tree import TokenTree
from verifier_svc.step_inputs import decode_inputs, prefill_inputs, unpadded

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15], [16, 17]]
# Ragged rows: a branching tree, none, a single node, a chain.
TREES = [TokenTree([20, 21, 22, 23, 24], [-1, 0, 0, 2, -1]), TokenTree([], []), TokenTree([30], [-1])]
TREES.append(TokenTree([40, 41, 42], [-1, 0, 1]))


@pytest.fixture(scope="module")
def tiny_llama():
    return support.tiny_llama()


def _tree_step(runner: ModelRunner, packed: bool, mask_fault: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill PROMPTS, verify TREES in one step, then one plain step that reads the cache the tree
    step wrote → (the tree step's real tokens' hidden states [N, h], the plain step's [b, 1, h])."""
    b, dev = len(PROMPTS), runner.device
    first = prefill_inputs(PROMPTS, [0] * b, dev)
    runner.forward(slice(0, b), first.input_ids, first.positions, first.mask)
    lengths = [len(p) for p in PROMPTS]
    step = decode_inputs([50 + i for i in range(b)], lengths, TREES, dev)
    counts = [len(t) + 1 for t in TREES]
    real = unpadded(counts, dev)
    mask = step.mask.clone()
    if mask_fault:
        mask[0, 3] = True  # node 2 of row 0 sees its sibling: a different (wrong) step
    if packed:
        packing = Packing(*real, b, step.input_ids.shape[1])
        hidden = runner.forward(slice(0, b), step.input_ids, step.positions, mask, step.write_pos, packing)[0]
    else:
        hidden = runner.forward(slice(0, b), step.input_ids, step.positions, mask, step.write_pos)[real]
    after = decode_inputs(
        [60 + i for i in range(b)], [n + c for n, c in zip(lengths, counts, strict=True)], [TREES[1]] * b, dev
    )
    return hidden, runner.forward(slice(0, b), after.input_ids, after.positions, after.mask, after.write_pos)


@pytest.mark.parametrize("kernel", [False, True], ids=["sdpa", "tree-kernel"])
def test_a_packed_tree_step_gives_the_padded_steps_states_and_cache(tiny_llama, kernel):
    if kernel:
        support.require_cpu_kernels()
    runners = [
        ModelRunner(copy.deepcopy(tiny_llama), torch.device("cpu"), torch.float32, 256, tree_kernel=kernel)
        for _ in range(3)
    ]
    assert all(r.packs for r in runners)
    padded, packed = _tree_step(runners[0], packed=False), _tree_step(runners[1], packed=True)
    assert packed[0].shape == (sum(len(t) + 1 for t in TREES), 48)
    for got, want in zip(packed, padded, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # Negative control: the packed forward obeys the mask (a wrong one changes that node's state).
    faulty, _ = _tree_step(runners[2], packed=True, mask_fault=True)
    assert (faulty[3] - packed[0][3]).abs().max() > 1e-3


def test_what_a_longer_context_adds_is_measured_where_the_cache_holds_one(tiny_llama):
    long = ModelRunner(copy.deepcopy(tiny_llama), torch.device("cpu"), torch.float32, 2048)
    ctx = measure_context_cost(long, repeats=1)
    assert ctx is not None and ctx.prefix == 128 and ctx.per_row_key >= 0 and ctx.per_query_key >= 0
    assert long.cache.seq_capacity <= 1024  # a power-of-two allocation, not the model's whole context
    short = ModelRunner(copy.deepcopy(tiny_llama), torch.device("cpu"), torch.float32, 256)
    assert measure_context_cost(short) is None  # no context much longer than the table's: not priced


def test_a_model_a_runner_wraps_still_attends_right_over_transformers_own_cache(tiny_llama):
    """A runner switches its model to this package's attention; a caller of the model itself (generate(),
    a block of queries over a DynamicCache, without a mask) must get the logits stock SDPA gives, whichever
    ran first (the test suite's session model is wrapped by some tests and called directly by others)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(3)
    context, block = torch.randint(0, 64, (2, 9), generator=gen), torch.randint(0, 64, (2, 4), generator=gen)

    def block_logits(model) -> torch.Tensor:  # [2, 4, vocab]: the block after the cached context
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(context, cache=cache, use_cache=True)
            return model(block, cache=cache, use_cache=True).logits

    model = copy.deepcopy(tiny_llama)
    want = block_logits(model)
    ModelRunner(model, torch.device("cpu"), torch.float32, 256)
    assert model.config._attn_implementation == "specmesh"
    torch.testing.assert_close(block_logits(model), want, atol=1e-5, rtol=1e-5)
