"""Grouped-query attention over the slot cache without repeating keys and values.

transformers' SDPA path repeats every key/value head ``H / kv_heads`` times whenever a forward
brings more than one query token with a mask (tree verification, prefill chunks): on a CPU that
copy of the whole cached context per layer costs as much as the attention itself (SmolLM2-135M,
8 rows × 700 cached tokens × 4 new: ~23 ms of a ~120 ms step). Here the query heads that share a
key/value head are folded into the query axis instead:

    q [b, H, n, D] → [b, kv_heads, g·n, D]        (g = H / kv_heads; head h = kv·g + j)
    mask [b, 1, n, kv] → [b, 1, g·n, kv]          (the same mask for every head of a group)

so SDPA runs on the cache's own key/value views. Same arithmetic per (head, query), so the
result equals the repeated form up to floating-point reduction order. Forwards without a mask
(the model used outside the verifier, e.g. ``generate()``: causal by flag), without grouping, or
with one query token (transformers packs those itself) take transformers' own SDPA path.
"""

from __future__ import annotations

from typing import Any

import torch

ATTN_NAME = "specmesh_gqa"
_last_fold: tuple[torch.Tensor, int, torch.Tensor | None] | None = None  # every layer gets the same mask object


def fold_gqa(query: torch.Tensor, mask: torch.Tensor | None, groups: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query [b, H, n, D] → [b, H / g, g·n, D]; mask [b, 1, n, kv] → [b, 1, g·n, kv].

    >>> q = torch.arange(8.0).reshape(1, 4, 2, 1)        # heads 0..3, two queries each
    >>> fq, fm = fold_gqa(q, torch.zeros(1, 1, 2, 3), 2)
    >>> fq[0, :, :, 0].tolist(), tuple(fm.shape)         # kv head 0 serves heads 0 and 1
    ([[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]], (1, 1, 4, 3))
    """
    b, heads, n, dim = query.shape
    folded = query.reshape(b, heads // groups, groups * n, dim)
    if mask is not None and mask.shape[-2] == n and groups > 1:
        mask = mask.expand(mask.shape[0], mask.shape[1], n, mask.shape[-1]).repeat(1, 1, groups, 1)
    return folded, mask


def gqa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [b, H, n, D], key/value [b, kv_heads, kv, D] → ([b, n, H, D], None)."""
    global _last_fold
    b, heads, n, dim = query.shape
    groups = heads // key.shape[1]
    if attention_mask is None or groups == 1 or n == 1:  # implicit causality, no repeat, or a decode step
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    q, _ = fold_gqa(query, None, groups)  # [b, kv_heads, g·n, D]
    last = _last_fold
    same = last is not None and last[0] is attention_mask and last[1] == groups
    if same and (last[2] is None or last[2].shape[-2] == groups * n):
        mask = last[2]  # folded once per forward, not once per layer
    else:
        mask = fold_gqa(query, attention_mask, groups)[1]  # [b, 1, g·n, kv]
        _last_fold = (attention_mask, groups, mask)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False
    )  # [b, kv_heads, g·n, D]
    return out.reshape(b, heads, n, dim).transpose(1, 2).contiguous(), None


def supports(config: object) -> bool:
    """Plain causal attention only: no sliding window, logit soft-capping or attention sinks, which
    this function does not apply (such models keep transformers' own attention)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return not any(
        getattr(text, name, None) for name in ("sliding_window", "attn_logit_softcapping", "use_sliding_window")
    ) and getattr(text, "model_type", "") not in ("gpt_oss",)


def register() -> str:
    """Register :func:`gqa_attention_forward` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, gqa_attention_forward)
    return ATTN_NAME
