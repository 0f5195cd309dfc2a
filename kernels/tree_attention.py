"""Tree attention over per-request key/value rows: a Triton kernel, its host launcher, and the torch reference.

One launch covers every request of a verification step. Queries are ragged: request ``b`` brings
``q_len[b]`` rows (its pending token and its tree nodes), flattened without padding and located by
``cu_seqlens`` (``[0, n_0, n_0 + n_1, …]``). Keys and values are read in place, any strides, from a
layout ``[slots, kv_heads, seq, head_dim]`` (a slot cache's rows, or rows gathered for a forward):
request ``b`` lives in slot ``slots[b]``; or, paged (:func:`paged_tree_attention`, the verifier's
``specmesh_server.paged_kv``), from one layer's pool ``[kv_heads, blocks · block_size, head_dim]``
through a block table, request ``b``'s position ``p`` at offset ``p % block_size`` of block
``table[b, p // block_size]``. Its cached prefix is positions ``0 .. prefix_lens[b]-1`` and its new
rows were written at ``prefix_lens[b] + j``. Query ``i`` of request ``b`` sees the whole prefix and the
new keys ``j`` whose bit is set in ``tree_bits[cu_seqlens[b] + i]`` (an int64 ancestor bitmask, so at
most 64 new rows per request; see :func:`ancestor_bits`). Plain decode is the case ``q_len = 1``, bits
``1``; a causal chunk of ``n <= 64`` tokens has bits ``2**(i+1) - 1``.

Kernel (flash-decoding style): one program per (request, block of ``BLOCK_M`` query rows, kv head,
key split). A block's rows are (node, query head of the kv head's GQA group) pairs, so each key/value
block is loaded once for all heads sharing it and all nodes of the tree. Softmax is online
(running max and sum, fp32); long prefixes are split over several programs (split-K) whose partial
results a second small kernel combines. fp16, bf16 and fp32 inputs; fp32 accumulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specmesh_kernels._runtime import interpreted, num_sms, runnable

MAX_TREE_ROWS = 64  # new rows per request (pending token + 63 nodes): one int64 bitmask each
_LOG2E = 1.4426950408889634


def ancestor_bits(parents: list[int]) -> list[int]:
    """Ancestor bitmask of each row of ``[pending token, node 0, …]`` as signed int64 values.

    Bit ``j`` of row ``i`` is set when row ``i`` may attend to new row ``j``: the pending token
    (row 0), its ancestors and itself. ``parents`` as in ``specmesh_server.tree.TokenTree`` (-1 = root).

    >>> ancestor_bits([-1, 0, -1])   # rows: pending, a, a→b, c
    [1, 3, 7, 9]
    >>> ancestor_bits(list(range(-1, 62)))[-1]   # a 63-node chain: all 64 bits set
    -1
    """
    if len(parents) + 1 > MAX_TREE_ROWS:
        raise ValueError(f"{len(parents)} nodes: tree attention takes at most {MAX_TREE_ROWS - 1}")
    bits = [1]
    for i, p in enumerate(parents):
        bits.append(bits[p + 1] | (1 << (i + 1)))
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]


def bits_to_mask(bits: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [...] bitmasks → bool [..., n] (bit j → column j).

    >>> bits_to_mask(torch.tensor([5, -1]), 3).int().tolist()
    [[1, 0, 1], [1, 1, 1]]
    """
    j = torch.arange(n, device=bits.device)
    return ((bits[..., None] >> j) & 1).bool()


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_bits: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as :func:`tree_attention`, one request at a time in plain torch (fp32 math).

    q: [total_q, n_heads, head_dim]; k_cache, v_cache: [slots, kv_heads, seq, head_dim];
    cu_seqlens: int [b + 1]; slots, prefix_lens: int [b]; tree_bits: int64 [total_q]
    → [total_q, n_heads, head_dim] in q's dtype.
    """
    n_heads, head_dim = q.shape[1], q.shape[2]
    group = n_heads // k_cache.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    cu, sl, pl = cu_seqlens.tolist(), slots.tolist(), prefix_lens.tolist()
    for b in range(len(sl)):
        lo, hi, prefix = cu[b], cu[b + 1], pl[b]
        n = hi - lo
        k = k_cache[sl[b], :, : prefix + n].float().repeat_interleave(group, dim=0)  # [n_heads, kv, dim]
        v = v_cache[sl[b], :, : prefix + n].float().repeat_interleave(group, dim=0)
        qb = q[lo:hi].float().transpose(0, 1)  # [n_heads, n, dim]
        mask = torch.cat(
            [torch.ones(n, prefix, dtype=torch.bool, device=q.device), bits_to_mask(tree_bits[lo:hi], n)], dim=1
        )  # [n, kv]
        scores = (qb @ k.transpose(1, 2)) * scale  # [n_heads, n, kv]
        scores = scores.masked_fill(~mask, float("-inf"))
        out[lo:hi] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(q.dtype)
    return out


@triton.jit
def _tree_attention_kernel(
    Q,
    K,
    V,
    Out,
    PartO,
    PartM,
    PartL,
    QStart,
    QLen,
    Slot,
    Prefix,
    RowPrefix,
    Bits,
    Table,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_kt,
    stride_vs,
    stride_vh,
    stride_vt,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_bb,
    stride_tb,
    n_req,
    n_m_blocks,
    max_q,
    n_heads,
    chunk,
    sm_scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_ROW_PREFIX: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    PAGE: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // n_m_blocks
    m_block = pid % n_m_blocks
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(QStart + b)
    q_len = tl.load(QLen + b)
    prefix = tl.load(Prefix + b)
    slot = tl.load(Slot + b).to(tl.int64)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # (node, head in group) pairs
    node = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = node < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q_ptrs = Q + b * stride_qb + (q_start + node)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    row_idx = b * stride_bb + q_start + node
    bits = tl.load(Bits + row_idx, mask=row_ok, other=0)  # [M] int64
    if HAS_ROW_PREFIX:
        visible = tl.load(RowPrefix + row_idx, mask=row_ok, other=0)  # [M]: keys < visible always seen
    else:
        visible = tl.zeros([BLOCK_M], dtype=tl.int32) + prefix

    kv_len = prefix + q_len
    if ROW_CHUNK:  # the row's own keys spread over the grid's splits: lengths are data, the grid is fixed
        chunk = tl.cdiv(tl.cdiv(kv_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    k_lo = split * chunk
    k_hi = tl.minimum(k_lo + chunk, kv_len)
    k_hi = tl.where(m_block * BLOCK_M < q_len * GROUP, k_hi, k_lo)  # empty block: no keys

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = K + slot * stride_ks + kvh * stride_kh
    v_base = V + slot * stride_vs + kvh * stride_vh
    for start in range(k_lo, k_hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < k_hi
        kv_mask = k_ok[:, None] & d_ok[None, :]
        if PAGE > 0:  # paged: position p at offset p % PAGE of block Table[b, p // PAGE]
            blk = tl.load(Table + b * stride_tb + kpos // PAGE, mask=k_ok, other=0).to(tl.int64)
            kslot = blk * PAGE + kpos % PAGE  # [N]
        else:
            kslot = kpos
        k = tl.load(k_base + kslot[:, None] * stride_kt + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if DOT_F32:  # the interpreter multiplies bf16 as raw uint16: compute its dots in fp32
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = s * sm_scale_log2  # [M, N], log2 units
        j = tl.maximum(kpos - prefix, 0).to(tl.int64)
        in_tree = (kpos >= prefix)[None, :] & (((bits[:, None] >> j[None, :]) & 1) != 0)
        allowed = ((kpos[None, :] < visible[:, None]) | in_tree) & k_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kslot[:, None] * stride_vt + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if DOT_F32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLIT:
        part = ((split * n_req + b) * max_q + node) * n_heads + head  # [M]
        tl.store(PartM + part, m_i, mask=row_ok)
        tl.store(PartL + part, l_i, mask=row_ok)
        tl.store(PartO + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that sees nothing gives zeros
        o_ptrs = Out + b * stride_ob + (q_start + node)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(
    PartO,
    PartM,
    PartL,
    Out,
    QStart,
    QLen,
    stride_ob,
    stride_ot,
    stride_oh,
    n_req,
    max_q,
    n_heads,
    n_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    b = pid // max_q
    node = pid % max_q
    q_start = tl.load(QStart + b)
    q_len = tl.load(QLen + b)
    s = tl.arange(0, BLOCK_S)
    s_ok = (s < n_splits) & (node + s * 0 < q_len)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    row_ok = node + d * 0 < q_len  # [D]
    part = ((s * n_req + b) * max_q + node) * n_heads + head  # [S]
    m = tl.load(PartM + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(PartL + part, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # [S]
    total = tl.sum(w * l_s, 0)
    o = tl.load(PartO + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)  # [D]
    o_ptrs = Out + b * stride_ob + (q_start + node) * stride_ot + head * stride_oh + d
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_ok & row_ok)


def _plan(n_req: int, m_blocks: int, kv_heads: int, max_kv: int, block_n: int, device: torch.device) -> int:
    """Keys per split: enough programs to fill the GPU twice over, at least one key block each."""
    base = n_req * m_blocks * kv_heads
    splits = max(1, min(math.ceil(2 * num_sms(device) / base), math.ceil(max_kv / block_n)))
    return math.ceil(math.ceil(max_kv / splits) / block_n) * block_n


def launch_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_bits: torch.Tensor,
    *,
    max_q: int,
    max_kv: int,
    batch_strided: bool,
    row_prefix: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    block_table: torch.Tensor | None = None,
    block_size: int = 0,
    row_chunks: bool = False,
) -> torch.Tensor:
    """Low-level launch on already-checked tensors; :func:`tree_attention` and
    :func:`paged_tree_attention` are the public entries.

    Two query/output layouts: ragged (``batch_strided=False``: q [total_q, n_heads, dim], out the
    same, row (b, i) at ``q_start[b] + i``, tree_bits [total_q]) and padded (``batch_strided=True``:
    q [b, n_heads, n, dim] as transformers passes it, out [b, n, n_heads, dim], q_start zeros,
    tree_bits [b, n]). ``row_prefix`` (same layout as tree_bits, int32) optionally narrows the keys
    of the prefix a row sees to ``< row_prefix`` (padding rows of a batch). ``block_table`` (int32
    [b, blocks]): the caches are one paged pool each, [1, kv_heads, slots, dim], request b's position
    p at slot ``block_table[b, p // block_size] · block_size + p % block_size`` (``slots`` all 0).
    ``row_chunks``: ``max_kv`` is only a bound (a CUDA graph's capacity): the grid's key splits are
    planned for it, and each request spreads its own ``prefix_lens[b] + q_len[b]`` keys over them,
    read from the device; nothing in the launch depends on the lengths, so it can be captured and replayed.
    """
    n_req = slots.shape[0]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    n_heads = q.shape[1]
    group = n_heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = max(16, min(64 if head_dim > 64 else 128, triton.next_power_of_2(max_q * group)))
    block_n = 64 if head_dim <= 128 else 32
    m_blocks = math.ceil(max_q * group / block_m)
    if num_splits is None:
        chunk = _plan(n_req, m_blocks, kv_heads, max_kv, block_n, q.device)
    else:
        chunk = math.ceil(math.ceil(max_kv / num_splits) / block_n) * block_n
    splits = math.ceil(max_kv / chunk)
    if batch_strided:  # q [b, H, n, D]; out [b, n, H, D]; bits [b, n]
        sq, so, sbits = (q.stride(0), q.stride(2), q.stride(1)), (out.stride(0), out.stride(1), out.stride(2)), max_q
    else:  # q, out [total, H, D]; bits [total]
        sq, so, sbits = (0, q.stride(0), q.stride(1)), (0, out.stride(0), out.stride(1)), 0
    if splits > 1:
        part_o = torch.empty(splits, n_req, max_q, n_heads, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(splits, n_req, max_q, n_heads, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = out
    scale = head_dim**-0.5 if scale is None else scale
    kernel = runnable(_tree_attention_kernel, q.device)
    kernel[(n_req * m_blocks, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_o,
        part_m,
        part_l,
        q_start,
        q_len,
        slots,
        prefix_lens,
        tree_bits if row_prefix is None else row_prefix,
        tree_bits,
        slots if block_table is None else block_table,
        *sq,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        *so,
        sbits,
        0 if block_table is None else block_table.stride(0),
        n_req,
        m_blocks,
        max_q,
        n_heads,
        chunk,
        scale * _LOG2E,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPLIT=splits > 1,
        HAS_ROW_PREFIX=row_prefix is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=q.dtype == torch.bfloat16 and interpreted(kernel),
        PAGE=0 if block_table is None else block_size,
        ROW_CHUNK=row_chunks,
    )
    if splits > 1:
        combine = runnable(_combine_kernel, q.device)
        combine[(n_req * max_q, n_heads)](
            part_o,
            part_m,
            part_l,
            out,
            q_start,
            q_len,
            *so,
            n_req,
            max_q,
            n_heads,
            splits,
            HEAD_DIM=head_dim,
            BLOCK_S=max(2, triton.next_power_of_2(splits)),
            BLOCK_D=block_d,
        )
    return out


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_bits: torch.Tensor,
    *,
    scale: float | None = None,
    max_q: int | None = None,
    max_kv: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of every request's new rows over its cached prefix and its tree (one launch).

    q: [total_q, n_heads, head_dim] fp16/bf16/fp32; k_cache, v_cache: [slots, kv_heads, seq, head_dim]
    (same dtype, last dim contiguous; the new rows' keys already written at prefix_lens[b] + j);
    cu_seqlens: int32 [b + 1]; slots, prefix_lens: int32 [b]; tree_bits: int64 [total_q]
    → [total_q, n_heads, head_dim] in q's dtype. ``max_q`` (largest q_len) and ``max_kv`` (largest
    prefix_len + q_len) are host-side bounds; when omitted they are read from the device (a sync).
    ``num_splits`` forces the number of key splits (default: chosen from the GPU's size).
    """
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q must be [total, heads, dim] and caches [slots, kv_heads, seq, dim]: {q.shape} {k_cache.shape}"
        )
    if slots.shape != prefix_lens.shape:
        raise ValueError("cu_seqlens [b+1], slots [b], prefix_lens [b] and tree_bits [total_q] disagree")
    return _checked_launch(
        q, k_cache, v_cache, cu_seqlens, slots, prefix_lens, tree_bits, k_cache.shape[2], None, 0,
        scale=scale, max_q=max_q, max_kv=max_kv, num_splits=num_splits,
    )  # fmt: skip


def paged_tree_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_bits: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    max_q: int | None = None,
    max_kv: int | None = None,
    num_splits: int | None = None,
    row_chunks: bool = False,
) -> torch.Tensor:
    """:func:`tree_attention` over a paged cache, read through the block table where the blocks lie.

    k_pool, v_pool: [kv_heads, slots, head_dim], one layer's pool (``specmesh_server.paged_kv``);
    block_table: int32 [b, blocks], request b's position p at slot
    ``block_table[b, p // block_size] · block_size + p % block_size``, its table covering
    prefix_lens[b] + q_len[b] positions; the rest as :func:`tree_attention`. ``row_chunks``: ``max_kv`` is a
    bound (the table's capacity, say) and each request spreads its own keys over the splits planned for it:
    the launch then depends on no length (what a CUDA graph captures).
    """
    if q.dim() != 3 or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        raise ValueError(f"q must be [total, heads, dim] and pools [kv_heads, slots, dim]: {q.shape} {k_pool.shape}")
    if block_table.dim() != 2 or block_table.shape[0] != prefix_lens.shape[0] or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [b, blocks], one row per request: {tuple(block_table.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, not {block_size}")
    zeros = torch.zeros_like(prefix_lens, dtype=torch.int32)  # one "slot": the pool
    return _checked_launch(
        q, k_pool[None], v_pool[None], cu_seqlens, zeros, prefix_lens, tree_bits,
        block_table.shape[1] * block_size, block_table, block_size,
        scale=scale, max_q=max_q, max_kv=max_kv, num_splits=num_splits, row_chunks=row_chunks,
    )  # fmt: skip


def paged_tree_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_bits: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as :func:`paged_tree_attention`: each request's blocks gathered into a row of its
    own, then :func:`tree_attention_reference`."""
    pos = torch.arange(block_table.shape[1] * block_size, device=q.device)
    slots = block_table.long()[:, pos // block_size] * block_size + pos % block_size  # [b, seq]
    k, v = (pool[:, slots].transpose(0, 1) for pool in (k_pool, v_pool))  # [b, kv_heads, seq, dim]
    rows = torch.arange(block_table.shape[0], device=q.device)
    return tree_attention_reference(q, k, v, cu_seqlens, rows, prefix_lens, tree_bits, scale)


def _checked_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_bits: torch.Tensor,
    capacity: int,
    block_table: torch.Tensor | None,
    block_size: int,
    *,
    scale: float | None,
    max_q: int | None,
    max_kv: int | None,
    num_splits: int | None,
    row_chunks: bool = False,
) -> torch.Tensor:
    """The checks both public entries share, then the launch (``capacity``: positions a request may reach)."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k_cache.dtype != q.dtype:
        raise TypeError(f"q/k/v must share one of fp16, bf16, fp32: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if v_cache.dtype != q.dtype or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"head dims / GQA grouping mismatch: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the head_dim axis of q, k_cache and v_cache must be contiguous")
    n_req = slots.shape[0]
    if cu_seqlens.shape != (n_req + 1,) or prefix_lens.shape != (n_req,) or tree_bits.shape != (q.shape[0],):
        raise ValueError("cu_seqlens [b+1], slots [b], prefix_lens [b] and tree_bits [total_q] disagree")
    if tree_bits.dtype != torch.int64:
        raise TypeError(f"tree_bits must be int64, got {tree_bits.dtype}")
    tensors = (q, k_cache, v_cache, cu_seqlens, slots, prefix_lens, tree_bits)
    devices = {t.device for t in tensors + (() if block_table is None else (block_table,))}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    q_len = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    if max_q is None:
        max_q = int(q_len.max()) if n_req else 0
    if max_kv is None:
        max_kv = int((prefix_lens + q_len).max()) if n_req else 0
    if max_q > MAX_TREE_ROWS:
        raise ValueError(f"{max_q} rows in one request: tree attention takes at most {MAX_TREE_ROWS}")
    if max_kv > capacity:
        raise ValueError(f"prefix + rows reach {max_kv}, the cache holds {capacity} positions")
    out = torch.empty_like(q)
    if n_req == 0 or q.shape[0] == 0:
        return out
    return launch_tree_attention(
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens[:-1].to(torch.int32),
        q_len,
        slots.to(torch.int32),
        prefix_lens.to(torch.int32),
        tree_bits,
        max_q=max_q,
        max_kv=max_kv,
        batch_strided=False,
        scale=scale,
        num_splits=num_splits,
        block_table=block_table,
        block_size=block_size,
        row_chunks=row_chunks,
    )


# --- the kernel's form of a dense tree mask -----------------------------------------------------


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


def tree_meta_from_trees(
    parents: list[list[int]], lengths: list[int], width: int, device: torch.device | str
) -> TreeMeta:
    """The kernel's form of a verification step's mask, built on the host from the trees themselves.

    The step layout (the verifier's ``decode_inputs``): row ``i`` holds its pending token at slot
    ``lengths[i]`` and its tree's nodes right after it, padded to ``width`` rows; padding rows see key 0
    only. Same result as :func:`tree_meta_from_mask` on that layout's mask, without the device read that
    validates a mask of unknown shape: three small host-to-device copies instead.

    >>> m = tree_meta_from_trees([[-1, -1], []], [3, 2], 3, "cpu")
    >>> m.start.tolist(), m.row_prefix.tolist(), m.bits.tolist()
    ([3, 2], [[3, 3, 3], [2, 1, 1]], [[1, 3, 5], [1, 0, 0]])
    """
    if width > MAX_TREE_ROWS:
        raise ValueError(f"{width} rows: tree attention takes at most {MAX_TREE_ROWS}")
    pad = [width - len(tree) - 1 for tree in parents]  # padding rows: no tree bit, key 0 only
    bits = [ancestor_bits(tree) + [0] * n for tree, n in zip(parents, pad, strict=True)]
    row_prefix = [[length] * (width - n) + [1] * n for length, n in zip(lengths, pad, strict=True)]
    return TreeMeta(
        torch.tensor(lengths, dtype=torch.int32, device=device),
        torch.tensor(row_prefix, dtype=torch.int32, device=device),
        torch.tensor(bits, dtype=torch.int64, device=device),
    )


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
