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

On CUDA the runner may also pass, per forward, the Triton tree-attention kernel's compact form of
the mask (``specmesh_kernels.tree_attention.TreeMeta``, keyword ``specmesh_tree``): such forwards
run the kernel on the cache's own key/value views instead. One attention function, registered with
transformers once, serves both paths.

A **packed** forward (keyword ``specmesh_packed``, a :class:`Packing`) brings the batch's real
tokens only, as one row [1, N]: the linear layers, most of a step's work, then skip the padding a
[b, width] layout gives every row shorter than the widest. Attention alone needs the rows apart
(each reads its own slot of the cache): its queries are scattered into the padded [b, H, width, D]
layout, attend as above under the padded mask, and are gathered back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

ATTN_NAME = "specmesh"
META_KWARG = "specmesh_tree"  # the tree kernel's mask metadata, passed through the decoder's kwargs
PACK_KWARG = "specmesh_packed"  # a packed forward's Packing, passed the same way


@dataclass(frozen=True)
class Packing:
    """Where packed token t sits in the padded layout: row ``rows[t]``, column ``cols[t]``.

    rows, cols: int64 [N] (row-major: row 0's tokens first); the padded layout is [batch, width].
    """

    rows: torch.Tensor
    cols: torch.Tensor
    batch: int
    width: int

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[1, H, N, D] → [b, H, width, D] (padding slots zero).

        >>> pk = Packing(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), batch=2, width=2)
        >>> pk.pad(torch.arange(3.0).view(1, 1, 3, 1))[:, 0, :, 0].tolist()
        [[0.0, 1.0], [2.0, 0.0]]
        """
        _, heads, _, dim = x.shape
        out = x.new_zeros(self.batch, self.width, heads, dim)
        out[self.rows, self.cols] = x[0].transpose(0, 1)  # [N, H, D]
        return out.transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[b, width, H, D] → [1, N, H, D]: the real tokens back in packed order."""
        return x[self.rows, self.cols][None]


_folded: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (mask, groups, fold): all layers share one mask


def fold_queries(query: torch.Tensor, groups: int) -> torch.Tensor:
    """query [b, H, n, D] → [b, H / g, g·n, D]: the heads sharing a key/value head, side by side.

    >>> q = torch.arange(8.0).reshape(1, 4, 2, 1)        # heads 0..3, two queries each
    >>> fold_queries(q, 2)[0, :, :, 0].tolist()          # kv head 0 serves heads 0 and 1
    [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    """
    b, heads, n, dim = query.shape
    return query.reshape(b, heads // groups, groups * n, dim)


def fold_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """mask [b, 1, n, kv] → [b, 1, g·n, kv], matching :func:`fold_queries` (one row for every query
    broadcasts as it is).

    >>> tuple(fold_mask(torch.zeros(1, 1, 2, 3), 2).shape), tuple(fold_mask(torch.zeros(1, 1, 1, 3), 2).shape)
    ((1, 1, 4, 3), (1, 1, 1, 3))
    """
    return mask if mask.shape[-2] == 1 else mask.repeat(1, 1, groups, 1)


def attention_forward(
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
    packing: Packing | None = kwargs.pop(PACK_KWARG, None)
    if packing is not None:
        out, _ = attention_forward(
            module, packing.pad(query), key, value, attention_mask, dropout, scaling, **kwargs
        )  # [b, width, H, D]
        return packing.unpad(out), None
    global _folded
    meta = kwargs.pop(META_KWARG, None)
    if meta is not None and query.dtype in (torch.float16, torch.bfloat16, torch.float32) and key.stride(3) == 1:
        return _tree_kernel(query, key, value, meta, scaling), None
    b, heads, n, dim = query.shape
    groups = heads // key.shape[1]
    if attention_mask is None or groups == 1 or n == 1:  # implicit causality, no repeat, or a decode step
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    cached = _folded
    if cached is not None and cached[0] is attention_mask and cached[1] == groups:
        mask = cached[2]  # folded once per forward, not once per layer
    else:
        mask = fold_mask(attention_mask, groups)  # [b, 1, g·n, kv]
        _folded = (attention_mask, groups, mask)
    out = torch.nn.functional.scaled_dot_product_attention(
        fold_queries(query, groups), key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False
    )  # [b, kv_heads, g·n, D]
    return out.reshape(b, heads, n, dim).transpose(1, 2).contiguous(), None


def _tree_kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: Any, scaling: float | None
) -> torch.Tensor:
    """The Triton tree-attention kernel over the cache's key/value views → [b, n, H, D]."""
    from specmesh_kernels import tree_attention

    b, heads, n, dim = query.shape
    dev = query.device
    out = torch.empty(b, n, heads, dim, dtype=query.dtype, device=dev)
    tree_attention.launch_tree_attention(
        query,
        key,
        value.to(key.dtype),
        out,
        torch.zeros(b, dtype=torch.int32, device=dev),
        torch.full((b,), n, dtype=torch.int32, device=dev),
        torch.arange(b, dtype=torch.int32, device=dev),
        meta.start,
        meta.bits,
        max_q=n,
        max_kv=key.shape[2],
        batch_strided=True,
        row_prefix=meta.row_prefix,
        scale=scaling,
    )
    return out


def supports(config: object) -> bool:
    """Plain causal attention only: no sliding window, logit soft-capping or attention sinks, which
    this function does not apply (such models keep transformers' own attention)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return not any(
        getattr(text, name, None) for name in ("sliding_window", "attn_logit_softcapping", "use_sliding_window")
    ) and getattr(text, "model_type", "") not in ("gpt_oss",)


def register() -> str:
    """Register :func:`attention_forward` with transformers (idempotent), with SDPA's mask builder; returns its name.

    The runner always passes its own 4D mask. A forward that brings none (``generate()``, or a model call
    over transformers' own cache) gets SDPA's mask: under a name without a mask builder transformers builds
    none, and SDPA's ``is_causal`` would align a block of new queries with the first cached keys, not the last.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_NAME, attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME
