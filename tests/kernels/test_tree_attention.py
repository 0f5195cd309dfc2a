"""Tree attention: the torch reference equals dense-mask SDPA over the verifier's own layout, and the
Triton kernel (Triton's interpreter on CPU, compiled on CUDA) equals the reference across batch sizes,
tree shapes, prefix lengths, GQA ratios, dtypes and key splits, reading the slot cache in place, and
reading a paged pool through block tables (blocks shuffled, unused slots NaN) as it reads the rows."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from specmesh_kernels.tree_attention import (
    MAX_TREE_ROWS,
    ancestor_bits,
    paged_tree_attention,
    paged_tree_attention_reference,
    tree_attention,
    tree_attention_reference,
)
from specmesh_server.tree import verification_layout

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU: these shapes take minutes in Triton's CPU interpreter"
)
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_batch(
    seed: int,
    n_req: int,
    max_nodes: int,
    max_prefix: int,
    n_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
    exact: bool = False,
) -> tuple[tuple, list[list[int]]]:
    """Random trees in a slot cache whose unused positions hold NaN (reading them would show)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_nodes = [max_nodes if exact else rng.randint(0, max_nodes) for _ in range(n_req)]
    prefixes = [max_prefix if exact else rng.randint(1, max_prefix) for _ in range(n_req)]
    parents = [[rng.randrange(-1, i) for i in range(n)] for n in n_nodes]
    seq = max(p + n + 1 for p, n in zip(prefixes, n_nodes, strict=True)) + 3
    slots_total = n_req + 2
    k_cache = torch.full((slots_total, kv_heads, seq, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    slots = torch.randperm(slots_total, generator=gen)[:n_req]
    for b in range(n_req):
        used = prefixes[b] + n_nodes[b] + 1
        k_cache[slots[b], :, :used] = torch.randn(kv_heads, used, head_dim, generator=gen).to(dtype)
        v_cache[slots[b], :, :used] = torch.randn(kv_heads, used, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + [n + 1 for n in n_nodes]).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), n_heads, head_dim, generator=gen).to(dtype)
    bits = torch.tensor([b for p in parents for b in ancestor_bits(p)], dtype=torch.int64)
    args = (q, k_cache, v_cache, cu, slots.to(torch.int32), torch.tensor(prefixes, dtype=torch.int32), bits)
    return tuple(t.to(device) for t in args), parents


def test_ancestor_bits_reproduce_the_verification_layout_mask():
    rng = random.Random(3)
    for n in (0, 1, 5, 63):
        parents = [rng.randrange(-1, i) for i in range(n)]
        _, mask = verification_layout(parents, prefix_len=4)
        bits = torch.tensor(ancestor_bits(parents))
        tree_part = ((bits[:, None] >> torch.arange(n + 1)) & 1).bool()
        assert torch.equal(tree_part, mask[:, 4:])


@pytest.mark.parametrize("kv_heads,group", [(4, 1), (2, 3), (1, 8)])
def test_reference_matches_dense_mask_sdpa_over_the_verification_layout(kv_heads, group):
    (q, k_cache, v_cache, cu, slots, prefix, bits), parents = make_batch(
        1, n_req=4, max_nodes=20, max_prefix=70, n_heads=kv_heads * group, kv_heads=kv_heads, head_dim=16,
        dtype=torch.float32,
    )  # fmt: skip
    got = tree_attention_reference(q, k_cache, v_cache, cu, slots, prefix, bits)
    assert torch.isfinite(got).all()
    for b, par in enumerate(parents):
        lo, hi, length = int(cu[b]), int(cu[b + 1]), int(prefix[b])
        _, mask = verification_layout(par, length)  # [n+1, length+n+1], built by the verifier's own code
        k = k_cache[slots[b], :, : mask.shape[1]][None]  # [1, kv_heads, kv, dim]
        v = v_cache[slots[b], :, : mask.shape[1]][None]
        want = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1)[None], k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(got[lo:hi], want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


CASES = {
    # name: (n_req, max_nodes, max_prefix, n_heads, kv_heads, head_dim, dtype, splits, exact)
    "decode-1-request-prefix-1": (1, 0, 1, 4, 4, 16, torch.float32, None, True),
    "trees-gqa3-fp16-3-splits": (3, 12, 300, 6, 2, 32, torch.float16, 3, False),
    "64-rows-all-bits-gqa8-bf16": (2, MAX_TREE_ROWS - 1, 50, 8, 1, 64, torch.bfloat16, None, True),
    "64-requests": (64, 3, 40, 1, 1, 16, torch.float32, None, False),
    "prefix-4096-split-k": (1, 6, 4096, 2, 1, 16, torch.float32, 2, True),
    "head-dim-not-a-power-of-two": (2, 5, 30, 3, 1, 24, torch.float32, 2, False),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.usefixtures("cpu_kernels")
def test_kernel_matches_reference(name):
    n_req, nodes, prefix, heads, kv_heads, dim, dtype, splits, exact = CASES[name]
    args, _ = make_batch(7, n_req, nodes, prefix, heads, kv_heads, dim, dtype, exact=exact)
    got = tree_attention(*args, num_splits=splits)
    want = tree_attention_reference(*args)
    assert got.dtype == dtype and torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.usefixtures("cpu_kernels")
def test_kernel_differs_from_reference_when_a_tree_bit_is_flipped():
    """The comparison above can fail: one ancestor bit changes the kernel's output for that row."""
    args, _ = make_batch(11, 1, 6, 20, 2, 1, 16, torch.float32, exact=True)
    q, k, v, cu, slots, prefix, bits = args
    want = tree_attention_reference(*args)
    flipped = bits.clone()
    flipped[-1] ^= 1 << 1  # the last node now also sees (or stops seeing) node 0
    got = tree_attention(q, k, v, cu, slots, prefix, flipped)
    assert (got[-1] - want[-1]).abs().max() > 1e-3
    torch.testing.assert_close(got[:-1], want[:-1], atol=2e-5, rtol=2e-5)


def to_paged(args: tuple, block_size: int, seed: int) -> tuple:
    """The batch's slot-cache rows copied into one pool per K and V, at shuffled blocks; unused slots NaN.
    → (q, k_pool, v_pool, cu, block_table, prefix_lens, tree_bits)."""
    q, k_cache, v_cache, cu, slots, prefix, bits = args
    n_req, kv_heads, seq, dim = slots.shape[0], *k_cache.shape[1:]
    cols = -(-seq // block_size)
    blocks = n_req * cols + 3
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))[: n_req * cols].view(n_req, cols)
    pools = [torch.full((kv_heads, blocks * block_size, dim), float("nan"), dtype=k_cache.dtype) for _ in range(2)]
    pos = torch.arange(seq)
    for b in range(n_req):
        at = table[b, pos // block_size] * block_size + pos % block_size
        for pool, cache in zip(pools, (k_cache, v_cache), strict=True):
            pool[:, at] = cache[int(slots[b])].to(pool.device)
    dev = q.device
    return q, pools[0].to(dev), pools[1].to(dev), cu, table.to(torch.int32).to(dev), prefix, bits


PAGED_CASES = {
    # name: (CASES entry, block size)
    "decode-1-request-prefix-1": ("decode-1-request-prefix-1", 16),
    "trees-gqa3-fp16-3-splits-block-5": ("trees-gqa3-fp16-3-splits", 5),
    "64-rows-all-bits-gqa8-bf16": ("64-rows-all-bits-gqa8-bf16", 16),
    "prefix-4096-split-k-block-64": ("prefix-4096-split-k", 64),
}


@pytest.mark.parametrize("name", list(PAGED_CASES))
@pytest.mark.usefixtures("cpu_kernels")
def test_the_kernel_through_block_tables_matches_it_over_rows(name):
    case, bs = PAGED_CASES[name]
    n_req, nodes, prefix, heads, kv_heads, dim, dtype, splits, exact = CASES[case]
    args, _ = make_batch(7, n_req, nodes, prefix, heads, kv_heads, dim, dtype, exact=exact)
    paged = to_paged(args, bs, seed=3)
    want = tree_attention_reference(*args)
    torch.testing.assert_close(paged_tree_attention_reference(*paged, block_size=bs), want, atol=0, rtol=0)
    got = paged_tree_attention(*paged, block_size=bs, num_splits=splits)
    assert got.dtype == dtype and torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("name", list(PAGED_CASES)[:3])
@pytest.mark.usefixtures("cpu_kernels")
def test_with_row_chunks_a_capacity_bound_grid_gives_the_same_attention(name):
    """A CUDA graph's launch: the grid planned for the table's whole capacity (``max_kv``), each request
    spreading its own keys over the splits; rows far shorter than the capacity leave most splits empty."""
    case, bs = PAGED_CASES[name]
    n_req, nodes, prefix, heads, kv_heads, dim, dtype, _, exact = CASES[case]
    args, _ = make_batch(7, n_req, nodes, prefix, heads, kv_heads, dim, dtype, exact=exact)
    q, kp, vp, cu, table, prefix_lens, bits = to_paged(args, bs, seed=3)
    extra = torch.full((table.shape[0], 8), kp.shape[1] // bs - 1, dtype=torch.int32)  # capacity past every row
    table = torch.cat([table, extra], dim=1)
    want = tree_attention_reference(*args)
    capacity = table.shape[1] * bs
    got = paged_tree_attention(
        q, kp, vp, cu, table, prefix_lens, bits, block_size=bs, max_kv=capacity, num_splits=5, row_chunks=True
    )
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_launcher_rejects_bad_shapes_and_dtypes():
    args, _ = make_batch(2, 2, 3, 10, 4, 2, 16, torch.float32)
    q, k, v, cu, slots, prefix, bits = args
    with pytest.raises(TypeError, match="share one of"):
        tree_attention(q.half(), k, v, cu, slots, prefix, bits)
    with pytest.raises(TypeError, match="int64"):
        tree_attention(q, k, v, cu, slots, prefix, bits.int())
    with pytest.raises(ValueError, match="GQA"):
        tree_attention(q[:, :3], k, v, cu, slots, prefix, bits)
    with pytest.raises(ValueError, match="disagree"):
        tree_attention(q, k, v, cu[:-1], slots, prefix, bits)
    with pytest.raises(ValueError, match="cache holds"):
        tree_attention(q, k, v, cu, slots, prefix + k.shape[2], bits)
    with pytest.raises(ValueError, match="at most 64"):
        tree_attention(q, k, v, torch.tensor([0, 65], dtype=torch.int32), slots[:1], prefix[:1], bits, max_kv=1)
    q, kp, vp, cu, table, prefix, bits = to_paged(args, 4, seed=0)
    with pytest.raises(ValueError, match="int32"):
        paged_tree_attention(q, kp, vp, cu, table.long(), prefix, bits, block_size=4)
    with pytest.raises(ValueError, match="cache holds"):
        paged_tree_attention(q, kp, vp, cu, table[:, :1], prefix, bits, block_size=4)


def orthogonal_array(levels: tuple[tuple, ...]) -> list[tuple]:
    """27 cases over five 3-level factors in which every pair of levels of any two factors occurs (the
    strength-2 orthogonal array over Z3: columns a, b, c, a+b, a+c mod 3), instead of all 243.

    >>> len(orthogonal_array(((0, 1, 2),) * 5)), orthogonal_array(((0, 1, 2),) * 5)[5]
    (27, (0, 1, 2, 1, 2))
    """
    assert len(levels) == 5 and all(len(f) == 3 for f in levels)
    rows = [(a, b, c, (a + b) % 3, (a + c) % 3) for a in range(3) for b in range(3) for c in range(3)]
    return [tuple(f[i] for f, i in zip(levels, row, strict=True)) for row in rows]


def test_the_sweep_covers_every_pair_of_levels():
    cases = orthogonal_array(((0, 1, 2),) * 5)
    for i in range(5):
        for j in range(i + 1, 5):
            assert {(c[i], c[j]) for c in cases} == {(x, y) for x in range(3) for y in range(3)}


@requires_cuda
def test_kernel_matches_reference_on_the_gpu_across_the_shape_sweep():
    """1-64 requests, 1-63 nodes, prefixes 1-4096, GQA 1/3/8, Llama head_dim 128, all dtypes: every pair of
    levels of any two of these (27 cases; all 243 did not finish in the GPU check's two minutes)."""
    sweep = orthogonal_array(
        ((1, 8, 64), (1, 16, 63), (1, 1000, 4096), (1, 3, 8), (torch.float16, torch.bfloat16, torch.float32))
    )
    for i, (n_req, nodes, prefix, group, dtype) in enumerate(sweep):
        kv_heads = 8 if group != 3 else 3
        args, _ = make_batch(i, n_req, nodes, prefix, kv_heads * group, kv_heads, 128, dtype, device="cuda")
        got = tree_attention(*args)
        want = tree_attention_reference(*args)
        torch.testing.assert_close(
            got.float(),
            want.float(),
            atol=TOL[dtype],
            rtol=TOL[dtype],
            msg=lambda m, c=(n_req, nodes, prefix, group, dtype): f"{c}: {m}",
        )
