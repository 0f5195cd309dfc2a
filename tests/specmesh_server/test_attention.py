"""The folded grouped-query attention equals transformers' SDPA path (which repeats K/V)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specmesh_server.attention import attention_forward, supports


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
