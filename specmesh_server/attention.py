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
run the kernel on the cache's own key/value views instead, or, over the paged cache, through its
block table (``paged_kv.TableContext``). One attention function, registered with
transformers once, serves both paths.

Over the paged cache on a CPU, ``update`` hands this function a ``paged_kv.BlockContext`` instead of
key/value tensors: :func:`paged_attention` then attends each row to its own blocks where they lie.

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

from specmesh_server.paged_kv import BlockContext, TableContext, read_lists

ATTN_NAME = "specmesh"
META_KWARG = "specmesh_tree"  # the tree kernel's mask metadata, passed through the decoder's kwargs
PACK_KWARG = "specmesh_packed"  # a packed forward's Packing, passed the same way
# set on the attention modules of a model over GGUF blocks (``gguf_weights.order_attention``): attention in
# key order, :func:`ordered_attention`, as the native loop's GGUF steps (False: never; unset: see in_key_order)
ORDERED_ATTR = "specmesh_ordered"
# a float32 CPU forward whose rows bring at most this many queries each attends in key order too (see in_key_order)
ORDERED_WIDTH = 8


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


def folded_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """:func:`fold_mask`, once per forward: every layer gets the same mask object."""
    global _folded
    cached = _folded
    if cached is not None and cached[0] is mask and cached[1] == groups:
        return cached[2]
    folded = fold_mask(mask, groups)
    _folded = (mask, groups, folded)
    return folded


def paged_attention(
    query: torch.Tensor, keys: BlockContext, values: BlockContext, mask: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """query [b, H, n, D] over each row's own runs of blocks, where they lie in the pools → [b, n, H, D].

    A row's parts r — its long runs, and its short ones copied together (``paged_kv.plan_reads``) — are
    attended one by one (``aten._scaled_dot_product_flash_attention_for_cpu``, which
    also returns each query's log-sum-exp of scores ``lse_r``) and merged exactly:

        out = Σ_r exp(lse_r − LSE) · out_r,        LSE = log Σ_r exp(lse_r)

    (each run's softmax re-weighted by its share of the row's total mass). A run wholly below the
    row's ``shared`` position is seen by every query: attended without the mask. Queries are folded
    per key/value head as in :func:`attention_forward`, so no key or value is repeated or copied.
    """
    b, heads, n, dim = query.shape
    kv_heads = keys.pool.shape[0]
    groups = heads // kv_heads
    q = fold_queries(query, groups)  # [b, kv_heads, g·n, D]
    folded = folded_mask(mask, groups)  # [b, 1, g·n, kv_len]
    out = query.new_empty(b, kv_heads, groups * n, dim)
    for i, row in enumerate(keys.rows):
        parts = []
        for run in row.runs:
            end = run.slot + run.stop - run.start
            k, v = keys.pool[None, :, run.slot : end], values.pool[None, :, run.slot : end]  # [1, kv_heads, len, D]
            m = None if run.stop <= row.shared else folded[i : i + 1, :, :, run.start : run.stop]
            parts.append(_flash(q[i : i + 1], k, v, m, scaling))
        if (g := row.gathered) is not None:  # the row's short runs, copied together
            end = g.slot + g.positions.numel()
            k, v = keys.gathered[None, :, g.slot : end], values.gathered[None, :, g.slot : end]
            m = None if g.last < row.shared else folded[i : i + 1, :, :, g.positions]
            parts.append(_flash(q[i : i + 1], k, v, m, scaling))
        if len(parts) == 1:
            out[i] = parts[0][0][0]
            continue
        outs = torch.stack([o[0] for o, _ in parts]).float()  # [runs, kv_heads, g·n, D]
        weights = torch.softmax(torch.stack([lse[0] for _, lse in parts]), dim=0)  # [runs, kv_heads, g·n] fp32
        out[i] = (weights[..., None] * outs).sum(0)
    return out.view(b, heads, n, dim).transpose(1, 2).contiguous()


def ordered_attention(
    query: torch.Tensor,
    keys: BlockContext | torch.Tensor,
    values: BlockContext | torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """query [b, H, n, D] over the cache's keys and values (in place, or gathered [b, kv_heads, kv, D]) →
    [b, n, H, D], each query's sums over exactly the keys it sees (its mask above −1e30), in column order
    (``specmesh_kernels.cpu_decoder.cpp``, ``ordered_attention``): a token's output is the same bits
    whatever step it is in, which GGUF weights' int8-quantized activations need (a difference of an ulp
    may flip a rounding there). The native loop computes the same, bit for bit.
    """
    from specmesh_kernels import cpu_linear

    b, heads, n, dim = query.shape
    empty, none = torch.empty(0, dtype=torch.long), torch.empty(0)
    if isinstance(keys, BlockContext):
        pools = keys.pool, values.pool  # [kv_heads, slots, D]
        copies = (keys.gathered, values.gathered) if keys.gathered is not None else (none, none)
        runs, gathered, positions = read_lists(keys.rows)
    else:
        kv_heads, kv = keys.shape[1], keys.shape[2]
        pools = tuple(t.transpose(0, 1).reshape(kv_heads, b * kv, dim) for t in (keys, values))  # row i's at i·kv
        copies = none, none
        runs = [(i, i * kv, 0, kv, 1) for i in range(b)]
        gathered, positions = [(0, 0)] * b, [empty] * b
    if mask is None and isinstance(keys, BlockContext):
        raise ValueError("attention in key order over the cache in place needs the step's mask")
    kv_len = mask.shape[-1] if mask is not None else keys.shape[2]
    if mask is None:  # as transformers' SDPA: causal (query j sees columns up to j) for more than one query
        seen = (
            torch.arange(kv_len)[None] <= torch.arange(n)[:, None] if n > 1 else torch.ones(1, kv_len, dtype=torch.bool)
        )
        mask = seen[None, None]
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    groups = heads // pools[0].shape[0]
    out = cpu_linear.ordered_attention(
        fold_queries(query, groups), *pools, *copies, torch.tensor(runs, dtype=torch.long).view(-1, 5),
        torch.tensor(gathered, dtype=torch.long).view(b, 2), positions, folded_mask(mask, groups),
        scaling if scaling is not None else dim**-0.5,
    )  # [b, kv_heads, g·n, D]  # fmt: skip
    return out.view(b, heads, n, dim).transpose(1, 2).contiguous()


def in_key_order(module: torch.nn.Module, query: torch.Tensor, width: int, paged: bool) -> bool:
    """Whether a CPU forward whose rows bring ``width`` queries each attends in key order
    (:func:`ordered_attention`) rather than by flash attention: always over GGUF blocks (``ORDERED_ATTR``:
    their bits must not depend on the step; False there: never); in float32 over the paged cache (read in
    place, not copied as a slot cache's rows are) for ``width`` ≤ ``ORDERED_WIDTH``, where it is the
    faster of the two: flash attention's per-call set-up outweighs a few queries' work. SmolLM2-135M's
    whole step, key order over flash (``benchmarks/cpu_step.py --modes gemv/flash,gemv``, paired, 2-core
    EPYC): plain decoding 0.94x at batch 1 and 0.85x at batch 8 after 256 tokens, 0.90x and 0.68x after
    2,048; 3- and 5-token rows 0.86-0.97x; 17-token rows a tie (1.13x for one row after 2,048 tokens in
    a first run), where flash attention's blocked products win. The Python loop and the native one
    decide alike, so each computes the other's bits.

    >>> from specmesh_server.packed_linear import gemv_supported
    >>> loaded = gemv_supported()  # the CPU kernel library, built or loaded (where the CPU has AVX2)
    >>> q = torch.zeros(1, 9, 1, 64)
    >>> got = [in_key_order(torch.nn.Module(), q, width, paged) for width, paged in ((1, True), (17, True), (1, False))]
    >>> got == [loaded, False, False]
    True
    """
    from specmesh_kernels import cpu_linear

    if query.device.type != "cpu" or query.shape[-1] % 8:
        return False
    marked = getattr(module, ORDERED_ATTR, None)
    wanted = marked if marked is not None else paged and query.dtype == torch.float32 and width <= ORDERED_WIDTH
    return wanted and cpu_linear.decoder_loaded()  # the library lookup last: the Python loop asks every layer


def mark_attention(model: torch.nn.Module, ordered: bool) -> None:
    """Set ``model``'s attention modules to attend in key order at every step (True) or never (False),
    instead of as :func:`in_key_order` picks per step."""
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            setattr(module, ORDERED_ATTR, ordered)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [1, h, n, D], fp32 log-sum-exp [1, h, n]) of one run."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scaling
    )


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
    meta = kwargs.pop(META_KWARG, None)
    if (
        meta is None
        and not isinstance(key, TableContext)
        and in_key_order(module, query, query.shape[2], paged=isinstance(key, BlockContext))
    ):
        return ordered_attention(query, key, value, attention_mask, scaling), None
    if isinstance(key, TableContext):  # the cache hands its pool and block table to the tree kernel
        return _tree_kernel(query, key, value, meta, scaling), None
    if isinstance(key, BlockContext):
        return paged_attention(query, key, value, attention_mask, scaling), None
    if meta is not None and query.dtype in (torch.float16, torch.bfloat16, torch.float32) and key.stride(3) == 1:
        return _tree_kernel(query, key, value, meta, scaling), None
    b, heads, n, dim = query.shape
    groups = heads // key.shape[1]
    if attention_mask is None or groups == 1 or n == 1:  # implicit causality, no repeat, or a decode step
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    mask = folded_mask(attention_mask, groups)  # [b, 1, g·n, kv]
    out = torch.nn.functional.scaled_dot_product_attention(
        fold_queries(query, groups), key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False
    )  # [b, kv_heads, g·n, D]
    return out.reshape(b, heads, n, dim).transpose(1, 2).contiguous(), None


def _tree_kernel(query: torch.Tensor, key: Any, value: Any, meta: Any, scaling: float | None) -> torch.Tensor:
    """The Triton tree-attention kernel over the cache's key/value views, or through a paged pool's
    block table (``TableContext``) → [b, n, H, D]."""
    from specmesh_kernels import tree_attention

    b, heads, n, dim = query.shape
    dev = query.device
    out = torch.empty(b, n, heads, dim, dtype=query.dtype, device=dev)
    paged: dict[str, Any] = {}
    if isinstance(key, TableContext):  # one "slot", the pool [1, kv_heads, slots, D], read through the table
        paged = {"block_table": key.table, "block_size": key.block_size, "row_chunks": key.bound}
        slots, max_kv = torch.zeros(b, dtype=torch.int32, device=dev), key.kv_len
        key, value = key.pool[None], value.pool[None]
    else:
        slots, max_kv = torch.arange(b, dtype=torch.int32, device=dev), key.shape[2]
    tree_attention.launch_tree_attention(
        query,
        key,
        value.to(key.dtype),
        out,
        torch.zeros(b, dtype=torch.int32, device=dev),
        torch.full((b,), n, dtype=torch.int32, device=dev),
        slots,
        meta.start,
        meta.bits,
        max_q=n,
        max_kv=max_kv,
        batch_strided=True,
        row_prefix=meta.row_prefix,
        scale=scaling,
        **paged,
    )
    return out


def supports(config: object) -> bool:
    """Plain causal attention only: no sliding window, logit soft-capping or attention sinks, which
    this function does not apply (such models keep transformers' own attention)."""
    from specmesh_server.model_loading import text_config

    text = text_config(config)
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
