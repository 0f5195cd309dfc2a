"""Tree attention inside the runner: the verifier's masks convert exactly to the kernel's form (or are refused),
and a Llama model run by ModelRunner through the tree-attention kernel gives the SDPA path's hidden
states for prefill, plain decode and batched tree steps with ragged, padded rows."""

from __future__ import annotations

import copy

import pytest
import support
import torch

from specmesh_kernels.tree_attention import tree_meta_from_mask
from specmesh_server.model_runner import ModelRunner, causal_mask
from specmesh_server.tree import verification_layout


def tree_step(lengths: list[int], trees: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """positions, mask and write positions exactly as Engine._decode lays out a tree step."""
    width = 1 + max(len(t) for t in trees)
    kv_len = max(lengths) + width
    write_pos = torch.tensor(lengths)[:, None] + torch.arange(width)[None, :]
    positions = write_pos.clone()
    mask = torch.zeros(len(trees), width, kv_len, dtype=torch.bool)
    mask[:, :, 0] = True  # padding queries see one key
    for i, (length, parents) in enumerate(zip(lengths, trees, strict=True)):
        pos, m = verification_layout(parents, length)
        positions[i, : len(parents) + 1] = pos
        mask[i, : len(parents) + 1, : m.shape[1]] = m
    return positions, mask, write_pos


def test_engine_masks_round_trip_through_the_kernel_form():
    _, mask, write_pos = tree_step([7, 3, 12], [[-1, 0, 0, 1], [], [-1, -1]])
    meta = tree_meta_from_mask(mask, write_pos)
    assert meta is not None
    assert meta.start.tolist() == [7, 3, 12]
    assert meta.row_prefix[1].tolist() == [3, 1, 1, 1, 1]  # request 1: pending row, then padding rows
    pos = torch.tensor([[5], [9]])
    decode = tree_meta_from_mask(causal_mask(pos, 10), pos)
    assert decode is not None and decode.bits.tolist() == [[1], [1]]


def test_masks_the_kernel_cannot_express_are_refused():
    pos = torch.arange(65)[None]
    assert tree_meta_from_mask(causal_mask(pos, 65), pos) is None  # 65 new tokens: over the bitmask
    _, mask, write_pos = tree_step([6], [[-1, 0]])
    holed = mask.clone()
    holed[0, 1, 2] = False  # a hole in the prefix of a tree row
    assert tree_meta_from_mask(holed, write_pos) is None
    assert tree_meta_from_mask(mask, write_pos.flip(1)) is None  # not written contiguously


@pytest.fixture(scope="module")
def tiny_llama():
    return support.tiny_llama()


@pytest.mark.usefixtures("cpu_kernels")
def test_model_runner_through_the_kernel_matches_the_sdpa_path(tiny_llama, monkeypatch):
    import specmesh_kernels.tree_attention as hook

    launches = []
    real_launch = hook.launch_tree_attention
    monkeypatch.setattr(hook, "launch_tree_attention", lambda *a, **k: launches.append(1) or real_launch(*a, **k))
    runners = [
        ModelRunner(copy.deepcopy(tiny_llama), torch.device("cpu"), torch.float32, 256, tree_kernel=flag)
        for flag in (False, True)
    ]
    assert [r.model.config._attn_implementation for r in runners] == ["specmesh", "specmesh"]  # one adapter
    assert [r.tree_kernel for r in runners] == [False, True]
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (3, 20), generator=gen)
    pos = torch.arange(20)[None].repeat(3, 1)
    steps = [(prompt, pos, causal_mask(pos, 20), None)]  # prefill of 20 tokens (kernel: causal bitmask)
    steps.append((torch.randint(0, 64, (3, 1), generator=gen), torch.full((3, 1), 20), None, None))  # decode
    positions, mask, write_pos = tree_step([21, 21, 21], [[-1, 0, -1, 1, 1], [-1], []])
    steps.append((torch.randint(0, 64, positions.shape, generator=gen), positions, mask, write_pos))
    for ids, p, m, w in steps:
        m = causal_mask(p, int(p.max()) + 1) if m is None else m
        want, got = (r.forward(slice(0, 3), ids, p, m, w) for r in runners)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)  # padding rows too: they see key 0 only
    assert len(launches) == len(steps) * 2  # every forward, both layers, went through the kernel


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (greedy equality with the kernel on)")
def test_greedy_tree_verification_on_the_gpu_matches_the_sdpa_path(lm, chat_ids):
    dev, dtype = torch.device("cuda"), torch.float32  # the runners' own: the weights are moved to match
    model = copy.deepcopy(lm.model).to(dev, dtype)
    ids = chat_ids("Write a haiku about the sea.")
    runners = [ModelRunner(copy.deepcopy(model), dev, dtype, 1024, tree_kernel=flag) for flag in (False, True)]
    assert [r.tree_kernel for r in runners] == [False, True]
    n = len(ids)
    pos = torch.arange(n, device=dev)[None]
    tok = torch.tensor([ids], device=dev)
    outs = []
    for r in runners:
        r.forward(slice(0, 1), tok[:, :-1], pos[:, :-1], causal_mask(pos[:, :-1], n - 1))
        positions, mask, write_pos = tree_step([n - 1], [[-1, 0, 1, -1, 3, 3]])
        tree_ids = torch.tensor([[ids[-1], 5, 6, 7, 8, 9, 10]], device=dev)
        hidden = r.forward(slice(0, 1), tree_ids, positions.to(dev), mask.to(dev), write_pos.to(dev))
        outs.append(r.logits(hidden))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-3, rtol=1e-3)
    assert torch.equal(outs[1].argmax(-1), outs[0].argmax(-1))


def test_the_engines_tree_meta_built_from_trees_equals_the_one_read_from_its_mask():
    """``tree_meta_from_trees`` (the engine's, no device read) gives exactly what ``tree_meta_from_mask``
    derives from ``decode_inputs``' mask, for random ragged batches and for plain decode steps."""
    import random

    from specmesh_kernels.tree_attention import tree_meta_from_trees
    from specmesh_server.tree import TokenTree
    from verifier_svc.step_inputs import decode_inputs

    rng = random.Random(3)
    for case in range(40):
        b = rng.randint(1, 6)
        max_nodes = 0 if case % 5 == 0 else rng.randint(1, 63)
        trees = []
        for _ in range(b):
            n = rng.randint(0, max_nodes)
            trees.append(TokenTree([rng.randrange(50) for _ in range(n)], [rng.randrange(-1, i) for i in range(n)]))
        lengths = [rng.randint(1, 90) for _ in range(b)]
        step = decode_inputs([7] * b, lengths, trees, torch.device("cpu"))
        want = tree_meta_from_mask(step.mask, step.write_pos)
        got = tree_meta_from_trees([t.parents for t in trees], lengths, step.input_ids.shape[1], "cpu")
        assert want is not None
        for field in ("start", "row_prefix", "bits"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (case, field)
