"""Tree attention inside a stock transformers model: an ``AttentionInterface`` entry and its per-forward metadata.

The verifier's ``ModelRunner`` describes each forward by a boolean mask ``[b, n, kv_len]`` and the
cache slots the new tokens are written to. :func:`tree_meta_from_mask` turns that into the kernel's
compact form (per request: the first new slot; per row: how much of the prefix it sees and an
ancestor bitmask over the new slots), on the device, and checks that the compact form reproduces
the mask exactly (one device-to-host sync per forward; ``None`` when it does not, or with more
than 64 new tokens per row, e.g. a long prefill chunk). The runner passes the result to the
decoder as the keyword ``specmesh_tree``; transformers hands it through to
:func:`tree_attention_forward`, which runs the kernel on the cache's own key/value views, or
falls back to SDPA where a forward carries none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specmesh_kernels.tree_attention import MAX_TREE_ROWS, launch_tree_attention

ATTN_NAME = "specmesh_tree"
META_KWARG = "specmesh_tree"


@dataclass(frozen=True)
class TreeMeta:
    """Kernel view of one forward's mask. start int32 [b]: first new slot (the tree window);
    row_prefix int32 [b, n]: keys < row_prefix always seen; bits int64 [b, n]: window keys seen."""

    start: torch.Tensor
    row_prefix: torch.Tensor
    bits: torch.Tensor


def _pack_bits(window: torch.Tensor) -> torch.Tensor:
    """bool [..., n] (n <= 64) → int64 [...], column j → bit j.

    >>> _pack_bits(torch.tensor([[True, False, True]])).tolist()
    [5]
    """
    j = torch.arange(window.shape[-1], device=window.device)
    return (window.long() << j).sum(-1)  # distinct bits; bit 63 alone makes it negative, no overflow


def tree_meta_from_mask(mask: torch.Tensor, write_pos: torch.Tensor) -> TreeMeta | None:
    """The kernel's form of ``mask`` (bool [b, n, kv]) for new tokens at ``write_pos`` (int64 [b, n]), or None.

    >>> m = torch.tensor([[[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]], dtype=torch.bool)
    >>> meta = tree_meta_from_mask(m, torch.tensor([[2, 3, 4]]))   # pending at 2, two root children
    >>> meta.start.tolist(), meta.row_prefix.tolist(), meta.bits.tolist()
    ([2], [[2, 2, 2]], [[1, 3, 5]])
    >>> tree_meta_from_mask(m, torch.tensor([[2, 4, 3]])) is None   # not written contiguously
    True
    """
    b, n, kv = mask.shape
    if n > MAX_TREE_ROWS or b == 0:
        return None
    dev = mask.device
    start = write_pos[:, 0]  # [b]
    offsets = torch.arange(n, device=dev)
    cols = start[:, None] + offsets  # [b, n] the window's key slots
    window = mask.gather(2, cols.clamp(max=kv - 1)[:, None, :].expand(b, n, n)) & (cols < kv)[:, None, :]  # [b, n, n]
    bits = _pack_bits(window)  # [b, n]
    keys = torch.arange(kv, device=dev)
    first_unseen = torch.where(mask, kv, keys).amin(dim=-1)  # [b, n] length of the all-seen run from key 0
    row_prefix = torch.minimum(first_unseen, start[:, None])
    rel = keys[None, None, :] - start[:, None, None]  # [b, 1, kv]
    in_window = (rel >= 0) & (rel < n)
    seen = ((bits[:, :, None] >> rel.clamp(0, n - 1)) & 1).bool() & in_window
    rebuilt = (keys[None, None, :] < row_prefix[:, :, None]) | seen  # [b, n, kv]
    ok = (write_pos == cols).all() & (cols[:, -1] < kv).all() & (rebuilt == mask).all()
    if not bool(ok):  # the one host sync of this forward
        return None
    return TreeMeta(start.to(torch.int32), row_prefix.to(torch.int32).contiguous(), bits.contiguous())


def tree_attention_forward(
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
    meta: TreeMeta | None = kwargs.pop(META_KWARG, None)
    if meta is None or query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or key.stride(3) != 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    b, heads, n, dim = query.shape
    out = torch.empty(b, n, heads, dim, dtype=query.dtype, device=query.device)
    launch_tree_attention(
        query,
        key,
        value.to(key.dtype),
        out,
        torch.zeros(b, dtype=torch.int32, device=query.device),
        torch.full((b,), n, dtype=torch.int32, device=query.device),
        torch.arange(b, dtype=torch.int32, device=query.device),
        meta.start,
        meta.bits,
        max_q=n,
        max_kv=key.shape[2],
        batch_strided=True,
        row_prefix=meta.row_prefix,
        scale=scaling,
    )
    return out, None


def register() -> str:
    """Register :func:`tree_attention_forward` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, tree_attention_forward)
    return ATTN_NAME
