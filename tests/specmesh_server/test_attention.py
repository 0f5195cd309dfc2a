"""The folded grouped-query attention equals transformers' SDPA path (which repeats K/V); attention over a
paged pool's runs of blocks, where they lie, equals it over the same rows gathered."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specmesh_server import paged_kv
from specmesh_server.attention import attention_forward, ordered_attention, paged_attention, supports
from specmesh_server.kv_blocks import BlockTable
from specmesh_server.paged_kv import PagedKVCache


class _Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.layer_idx = groups, True, 0


def _tree_mask(b: int, n: int, prefix: int) -> torch.Tensor:
    """Float [b, 1, n, prefix + n]: every query sees the prefix, itself and a random earlier node."""
    allowed = torch.zeros(b, n, prefix + n, dtype=torch.bool)
    allowed[:, :, :prefix] = True
    for i in range(b):
        for j in range(n):
            allowed[i, j, prefix + j] = True
            if j:
                allowed[i, j, prefix + int(torch.randint(0, j, ()))] = True
    mask = torch.zeros(allowed.shape)
    return mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)[:, None]


@pytest.mark.parametrize("b,heads,kv_heads,n", [(1, 9, 3, 1), (3, 9, 3, 5), (2, 4, 4, 3), (4, 8, 2, 17)])
def test_folded_gqa_matches_repeated_kv_sdpa_on_tree_masks_and_strided_cache_views(b, heads, kv_heads, n):
    torch.manual_seed(0)
    prefix, dim, seq_cap = 11, 16, 64
    cache_k = torch.randn(b + 2, kv_heads, seq_cap, dim)  # slot buffers: the forward sees a strided view
    cache_v = torch.randn(b + 2, kv_heads, seq_cap, dim)
    key, value = cache_k[1 : b + 1, :, : prefix + n], cache_v[1 : b + 1, :, : prefix + n]
    query = torch.randn(b, heads, n, dim)
    mask = _tree_mask(b, n, prefix)
    layer = _Layer(heads // kv_heads)
    want, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=dim**-0.5)
    got, _ = attention_forward(layer, query, key, value, mask, scaling=dim**-0.5)
    assert got.shape == want.shape == (b, n, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_models_with_sliding_windows_or_softcaps_keep_their_own_attention():
    from transformers import LlamaConfig, MistralConfig

    assert supports(LlamaConfig())
    assert not supports(MistralConfig(sliding_window=4096))


def test_maskless_forwards_stay_causal_as_in_transformers():
    torch.manual_seed(1)
    query, key, value = torch.randn(1, 9, 6, 8), torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8)
    want, _ = sdpa_attention_forward(_Layer(3), query, key, value, None)
    got, _ = attention_forward(_Layer(3), query, key, value, None)
    torch.testing.assert_close(got, want)


def _kernel() -> bool:
    from specmesh_server.packed_linear import gemv_supported

    return gemv_supported()  # loads the CPU library, ordered_attention's


@pytest.mark.parametrize("dim", [16, 64, 128])  # any multiple of 8; the two held in registers
@pytest.mark.parametrize("b,heads,kv_heads,n", [(1, 9, 3, 1), (3, 9, 3, 5), (4, 8, 2, 17)])
def test_attention_in_key_order_matches_sdpa_over_gathered_keys(b, heads, kv_heads, n, dim):
    """GGUF models' attention (each query over the keys it sees, in column order), over gathered keys with
    transformers' finfo.min tree masks, and with no mask (causal), against SDPA."""
    if not _kernel():
        pytest.skip("no CPU kernel library here")
    torch.manual_seed(2)
    prefix = 11
    key, value = (torch.randn(b, kv_heads, prefix + n, dim) for _ in range(2))
    query = torch.randn(b, heads, n, dim)
    layer = _Layer(heads // kv_heads)
    for mask in (_tree_mask(b, n, prefix), None):
        want, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=dim**-0.5)
        got = ordered_attention(query, key, value, mask, dim**-0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,n", [(9, 3, 1), (9, 3, 6), (4, 4, 3)])
def test_attention_over_blocks_in_place_equals_the_rows_gathered(heads, kv_heads, n, dtype, ordered, monkeypatch):
    """Rows of different lengths whose tables are one long run; long runs around a short one; and
    short runs only (copied): after a forward writes each row's n new tokens, each row's parts merged
    by log-sum-exp (or, ``ordered``, every key it sees in column order, float32: GGUF models'), under a
    tree mask over its new tokens, equal SDPA over its own positions gathered, and no query sees a longer
    row's positions."""
    if ordered and (dtype != torch.float32 or not _kernel()):
        pytest.skip("attention in key order: float32, with the CPU kernel library")
    monkeypatch.setattr(paged_kv, "MIN_RUN", 8)  # runs of 2+ blocks of 4 read in place, shorter copied
    torch.manual_seed(1)
    bs, dim = 4, 16
    cache = PagedKVCache(1, kv_heads, dim, dtype, torch.device("cpu"), num_blocks=40, block_size=bs, in_place=True)
    for pool in (cache.keys[0], cache.values[0]):
        pool.copy_(torch.randn(pool.shape))
    tables = [[3, 4, 5, 6, 7, 8], [20, 21, 22, 9, 30, 31, 32], [12, 2, 35, 17]]
    prefixes = [13, 19, 9]  # cached positions per row; its n new tokens follow
    kv_len = max(prefixes) + n
    rows = cache.rows([BlockTable(b"", blocks=t) for t in tables], kv_len)
    write_pos = torch.tensor(prefixes)[:, None] + torch.arange(n)[None]  # [b, n]
    cache.begin_forward(rows, write_pos, kv_len, shared=prefixes)
    keys, values = cache.update(*(torch.randn(len(tables), kv_heads, n, dim) for _ in range(2)), 0)
    assert [(bool(r.runs), r.gathered is not None) for r in keys.rows] == [(True, False), (True, True), (False, True)]
    mask = torch.full((len(tables), 1, n, kv_len), torch.finfo(dtype).min, dtype=dtype)
    for i, p in enumerate(prefixes):
        mask[i, :, :, : p + n] = _tree_mask(1, n, p).to(dtype)[0]
    query = torch.randn(len(tables), heads, n, dim).to(dtype)
    got = (ordered_attention if ordered else paged_attention)(query, keys, values, mask, 0.25)
    for i, (t, p) in enumerate(zip(tables, prefixes, strict=True)):
        slots = torch.tensor([t[q // bs] * bs + q % bs for q in range(p + n)])
        k, v = (
            pool[:, slots].repeat_interleave(heads // kv_heads, 0)[None] for pool in (cache.keys[0], cache.values[0])
        )
        want = torch.nn.functional.scaled_dot_product_attention(
            query[i : i + 1].float(), k.float(), v.float(), attn_mask=mask[i : i + 1, :, :, : p + n].float(), scale=0.25
        ).transpose(1, 2)  # [1, n, H, D]
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[i : i + 1].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dim", [24, 64, 128])
def test_in_key_order_a_querys_output_is_the_same_bits_whatever_its_step_holds(dim):
    """A tree node's queries (3 heads a key/value head) see the prefix and their ancestors: in a step of the whole
    tree (a sibling branch's keys masked), in a step of three such rows (other tilings of the work), and alone
    over the same keys where they lie elsewhere (the prefix in place, the ancestors copied) they give the same
    bits."""
    if not _kernel():
        pytest.skip("no CPU kernel library here")
    from specmesh_kernels import cpu_linear

    torch.manual_seed(3)
    kv_heads, g, prefix = 2, 3, 37
    parents = [-1, 0, 0, 1, 2]  # node 3's ancestors: 0, 1; node 2 is a sibling of 1
    n = len(parents)
    pool_k, pool_v = (torch.randn(kv_heads, 200, dim) for _ in range(2))
    for pool in (pool_k, pool_v):
        pool[:, 100:137] = pool[:, 0:prefix]  # the prefix again, elsewhere
    seen = torch.zeros(n, n, dtype=torch.bool)
    for t, parent in enumerate(parents):
        seen[t, t] = True
        if parent >= 0:
            seen[t] |= seen[parent]
    tree_mask = torch.zeros(n, prefix + n).masked_fill_(
        torch.cat([torch.zeros(n, prefix, dtype=torch.bool), ~seen], 1), torch.finfo(torch.float32).min
    )
    none = torch.empty(0, dtype=torch.long)
    parts = [(0, prefix), (prefix, prefix + n)]  # the prefix seen by all, the tree under its mask

    def tree_step(rows: int) -> torch.Tensor:
        q = torch.randn(rows, kv_heads, g * n, dim)
        q[0] = queries
        runs = torch.tensor([[i, start, start, stop, start > 0] for i in range(rows) for start, stop in parts])
        mask = tree_mask.repeat(g, 1)[None, None].expand(rows, 1, g * n, prefix + n).contiguous()
        empty = torch.empty(0)
        gathered = torch.zeros(rows, 2, dtype=torch.long)
        out = cpu_linear.ordered_attention(q, pool_k, pool_v, empty, empty, runs, gathered, [none] * rows, mask, 0.3)
        return out[:1]

    queries = torch.randn(kv_heads, g * n, dim)
    one, three = tree_step(1), tree_step(3)
    assert torch.equal(one, three)
    node = 3
    chain = [0, 1, 3]  # its ancestors and itself, copied as a short run is
    copies_k, copies_v = (pool[:, prefix + torch.tensor(chain)] for pool in (pool_k, pool_v))
    runs = torch.tensor([[0, 100, 0, prefix, 0]])
    gathered = torch.tensor([[0, 0]])
    positions = [torch.arange(prefix, prefix + len(chain))]
    picks = [h * n + node for h in range(g)]
    alone = cpu_linear.ordered_attention(
        queries[None, :, picks], pool_k, pool_v, copies_k, copies_v, runs, gathered, positions,
        torch.zeros(1, 1, 1, prefix + len(chain)), 0.3,
    )  # fmt: skip
    assert torch.equal(alone, one[:, :, picks])
