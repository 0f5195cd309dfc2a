"""Runs the stock HF causal LM over a KV cache with explicit positions and masks.

The cache is paged (``paged_kv``: the verifier's, rows given by their block tables) or slotted
(``kv_cache``: the draft proposer's, rows a contiguous range of slots). One call = one forward pass
over some rows, each bringing ``n`` new tokens: ragged rows right-padded, or packed into one row of
the real tokens alone (``attention.Packing``). Masks are boolean [b, n, kv_len] (True = attend) and become the float
4D mask transformers passes through unchanged. The same entry point serves chunked prefill,
plain decode and token-tree verification (ancestor masks).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from specmesh_router.cost_model import ContextCost, StepCost
from specmesh_server import attention, gguf_weights, lean_llama, packed_linear
from specmesh_server.gguf_weights import GGUFLinear
from specmesh_server.kv_blocks import BlockTable
from specmesh_server.kv_cache import SlotKVCache, bytes_per_position, default_budget_bytes
from specmesh_server.model_loading import head_dim as model_head_dim
from specmesh_server.model_loading import text_config
from specmesh_server.paged_kv import PagedKVCache, PagedRows, move_slots
from specmesh_server.static_step import StaticStep
from specmesh_server.tensor_parallel import Leader, RankFailure, Ranks, Shard
from specmesh_server.thread_budget import ThreadBudget
from specmesh_server.tree import TokenTree


def causal_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Each query sees every cached key up to and including its own position.

    positions: int64 [b, n] → bool [b, n, kv_len].

    >>> causal_mask(torch.tensor([[2], [0]]), 3).int().tolist()
    [[[1, 1, 1]], [[1, 0, 0]]]
    """
    keys = torch.arange(kv_len, device=positions.device)
    return keys[None, None, :] <= positions[:, :, None]


class ModelRunner:
    def __init__(
        self,
        model: Any,
        device: torch.device,
        dtype: torch.dtype,
        max_context: int,
        tree_kernel: bool | None = None,
        linears: str = "stock",
        kv_budget_bytes: int | None = None,
        block_size: int | None = None,
        prefix_caching: bool = True,
        shard: Shard | None = None,
        ranks: Ranks | None = None,
        leader: Leader | None = None,
        lean: bool = True,
        threads: ThreadBudget | None = None,
    ) -> None:
        """``tree_kernel``: tree steps through the Triton tree-attention kernel; default on CUDA only.
        Otherwise SDPA over the cache without repeating K/V (both in ``attention``; models it does not
        support keep transformers' attention, and no kernel).
        ``linears``: on a CPU in float32, ``packed`` replaces the model's linear layers in place by oneDNN
        ones with pre-packed weights, ``gemv`` also sends steps of a few rows through the matrix-vector
        kernel (``packed_linear``); where unsupported the runner falls back (``self.linears`` says which run).
        ``kv_budget_bytes``: the KV cache never allocates more (None: unbounded; paged: 30 % of what is free).
        ``block_size``: a paged cache of blocks of this many positions (``paged_kv``, prefix caching
        as ``prefix_caching`` says); None: the slot cache (``kv_cache``).
        ``shard``, ``ranks``: ``model`` is this rank's shard (``tensor_parallel.shard_model``): the cache
        holds its key/value heads, in as many blocks as every rank's budget holds (agreed over ``ranks``).
        ``leader`` (rank 0): every forward and cache copy is first sent to the other ranks.
        ``lean``: on a CPU in float32 without tensor parallelism, Llama layers run through ``lean_llama`` (the same
        logits from fewer operator calls); False keeps transformers' forward.
        ``threads``: before each forward, the torch threads follow the cores other processes leave free
        (``thread_budget``); None keeps them as they are."""
        self.threads = threads
        # Counted before packing (packed layers keep their weights outside nn.Parameters).
        weights = sum(
            p.numel() for name, p in model.named_parameters() if "embed" not in name and "lm_head" not in name
        ) + sum(  # and the layers on GGUF blocks (``gguf_weights``), which hold no parameters
            m.in_features * m.out_features
            for name, m in model.named_modules()
            if isinstance(m, GGUFLinear) and "lm_head" not in name
        )
        self.linears = packed_linear.effective(linears, device, dtype)
        if self.linears != "stock":
            packed_linear.pack_linears(model, gemv=self.linears == "gemv")
        gguf_weights.order_attention(model)  # over GGUF blocks: attention in key order, every path
        self.model = model
        self.decoder = model.get_decoder()  # the base model: hidden states, no lm_head
        self.lm_head = model.get_output_embeddings()
        self.device, self.dtype = device, dtype
        cfg = model.config
        text_cfg = text_config(cfg)
        head_dim = model_head_dim(text_cfg)
        kv_heads = getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads
        self.vocab_size = int(text_cfg.vocab_size)
        layers, heads = text_cfg.num_hidden_layers, text_cfg.num_attention_heads
        self.leader = leader
        budget_heads = kv_heads
        if shard is not None:  # this rank's heads; the budget in blocks of the rank holding the most
            kv_heads, budget_heads = shard.local_kv_heads, shard.max_kv_heads
            heads = shard.heads[1] - shard.heads[0]
        bytes_per_token = bytes_per_position(layers, budget_heads, head_dim, dtype)
        # A new token's linear layers (2 flops per weight) cost as much as attending this many cached
        # keys (4 flops per key, head dimension, head and layer): how prefill work grows with position.
        self.keys_per_token = max(weights / (2 * head_dim * heads * layers), 256.0)
        # The kernel applies neither sliding windows nor soft-capping either: supported models only.
        supported = attention.supports(cfg)
        self.tree_kernel = supported and (device.type == "cuda" if tree_kernel is None else tree_kernel)
        self.packs = supported  # packed forwards need this module's attention function
        self.cache: PagedKVCache | SlotKVCache
        if block_size is not None:
            budget = default_budget_bytes(device) if kv_budget_bytes is None else kv_budget_bytes
            if kv_budget_bytes is None and ranks is not None and device.type == "cpu":
                budget //= ranks.world  # the ranks share the host's memory
            blocks = budget // (bytes_per_token * block_size) - 1  # and the scratch block: within the budget
            if ranks is not None:  # block ids mean the same slots on every rank: the fewest blocks any holds
                blocks = _agreed_min(blocks, ranks)
            # On a CPU this module's attention reads the blocks where they lie; elsewhere (one launch over
            # the batch, the tree kernel) the rows' blocks are gathered.
            in_place = supported and device.type == "cpu" and not self.tree_kernel
            self.cache = PagedKVCache(
                layers, kv_heads, head_dim, dtype, device, max(blocks, 1), block_size, prefix_caching, in_place
            )
        else:
            self.cache = SlotKVCache(
                num_layers=text_cfg.num_hidden_layers,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                device=device,
                seq_limit=max_context,
                token_budget=None if kv_budget_bytes is None else kv_budget_bytes // bytes_per_token,
            )
        if supported:
            model.set_attn_implementation(attention.register())
        if lean and device.type == "cpu" and dtype == torch.float32 and shard is None and lean_llama.supports(model):
            self.decoder = lean_llama.LeanLlama(self.decoder)
        self.static: StaticStep | None = None  # decode and verification steps in static buffers (``use_static``)

    def use_static(self, max_batch: int, max_context: int, graphs: bool) -> StaticStep:
        """Run decode and verification steps as static steps (``static_step``): on CUDA those its captured
        CUDA graphs hold (captured here, where ``graphs``), on a CPU every one that fits a bucket, eagerly."""
        self.static = StaticStep(self, max_batch, max_context, graphs=graphs)
        self.static.capture()
        return self.static

    @torch.inference_mode()
    def forward(
        self,
        rows: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        write_pos: torch.Tensor | None = None,
        packing: attention.Packing | None = None,
        tree_meta: Any | None = None,
    ) -> torch.Tensor:
        """Hidden states of the new tokens of ``rows`` (a slice of slots, or ``PagedRows``: the cache's).

        input_ids, positions: int64 [b, n]; mask: bool [b, n, kv_len]; write_pos: int64 [b, n]
        (cache slots for the new tokens; defaults to ``positions``) → [b, n, hidden].
        ``packing`` (only where ``packs``): run only the real tokens it lists, as one row, and
        return theirs → [1, N, hidden] in its order (see ``attention``).
        ``tree_meta`` (where ``tree_kernel``): the kernel's form of ``mask``, built by the caller from its
        trees (``tree_meta_from_trees``); otherwise derived from ``mask``, which costs a device read.
        """
        if self.threads is not None:
            self.threads.adjust()
        if self.leader is None:
            return self._forward(rows, input_ids, positions, mask, write_pos, packing, tree_meta)
        # The other ranks run the same forward on their shards. Once they have started it, a failure
        # here may leave the ranks' all-reduces out of step: nothing they computed after could be trusted.
        self.leader.send("forward", rows, input_ids, positions, mask, write_pos, packing, tree_meta)
        try:
            return self._forward(rows, input_ids, positions, mask, write_pos, packing, tree_meta)
        except RankFailure:
            raise
        except Exception as exc:
            raise RankFailure(f"a forward failed on rank 0 after the other ranks began it: {exc!r}") from exc

    def _forward(
        self,
        rows: Any,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        write_pos: torch.Tensor | None,
        packing: attention.Packing | None,
        tree_meta: Any | None,
    ) -> torch.Tensor:
        kv_len = mask.shape[-1]
        write_pos = positions if write_pos is None else write_pos
        tree: dict[str, Any] = {}
        if self.tree_kernel:  # the kernel's form of the mask, or SDPA with the dense mask for this forward
            from specmesh_kernels.tree_attention import tree_meta_from_mask

            meta = tree_meta if tree_meta is not None else tree_meta_from_mask(mask, write_pos)
            if meta is not None:
                tree[attention.META_KWARG] = meta
        # Reading blocks in place, each row attends to its own blocks, unmasked below its first new token.
        reads: dict[str, Any] = {}
        if isinstance(self.cache, PagedKVCache) and attention.META_KWARG in tree:
            reads["through_table"] = True  # the tree kernel reads the blocks through the table
        elif getattr(self.cache, "in_place", False):
            reads["shared"] = write_pos[:, 0].tolist()
        if packing is not None:
            at = (packing.rows, packing.cols)
            input_ids, positions, write_pos = input_ids[at][None], positions[at][None], write_pos[at][None]  # [1, N]
            self.cache.begin_forward(rows, write_pos, kv_len, token_rows=packing.rows[None], **reads)
            tree[attention.PACK_KWARG] = packing
        else:
            self.cache.begin_forward(rows, write_pos, kv_len, **reads)
        attn = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
        attn.masked_fill_(~mask, torch.finfo(self.dtype).min)
        out = self.decoder(
            input_ids=input_ids,
            attention_mask=attn[:, None],  # [b, 1, n, kv_len]
            position_ids=positions,
            cache=self.cache,  # transformers removes the old name, past_key_values, in 5.40
            use_cache=True,
            **tree,
        )
        return out.last_hidden_state

    def move_positions(self, moves: list[tuple[BlockTable, list[int], int]]) -> None:
        """After a verification step, each request's accepted tree nodes into path order: per request (its
        table, the source positions, the first destination position), all in one copy on every rank."""
        src, dst = move_slots([(t.blocks, p, d) for t, p, d in moves], self.cache.block_size)
        if not src.numel():
            return
        if self.leader is not None:
            self.leader.send("copy", src, dst)
        self.cache.copy_slots(src, dst)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] → fp32 [..., vocab]."""
        return self.lm_head(hidden).float()


def _agreed_min(value: int, ranks: Ranks) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ranks.start)
    return int(t.item())


def measure_step_cost(
    runner: ModelRunner,
    rows: tuple[int, ...] = (1, 2, 4, 8),
    widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    prefix: int = 128,
    max_tokens: int = 128,
    repeats: int = 2,
) -> StepCost:
    """Time one forward (and its logits) over r rows × w new tokens after a ``prefix``-token context,
    for each r in ``rows`` and each w in ``widths`` with r·w ≤ ``max_tokens`` (best of ``repeats``).

    Runs in slots 0..max(rows)-1 of an empty cache at start-up (a few seconds on a CPU); the
    engine then corrects the table from live steps (``router.cost_model.LiveStepCost``).
    """
    dev = runner.device
    with torch.inference_mode():
        top = max(rows)
        ids = torch.randint(0, runner.vocab_size, (top, prefix + max(widths)), device=dev)
        pos = torch.arange(prefix, device=dev)[None].expand(top, prefix)
        with runner.cache.measurement_rows(top, prefix + max(widths)) as where:
            runner.forward(where, ids[:, :prefix], pos, causal_mask(pos, prefix))
            table = [
                [
                    _timed_forward(runner, where, ids[:r], prefix, w, repeats)
                    for w in widths
                    if r * w <= max(max_tokens, r)
                ]
                for r in rows
            ]
    # Costs never fall with more tokens or more rows; noise must not say otherwise.
    for i, seconds in enumerate(table):
        for j in range(len(seconds)):
            floor = max(seconds[j - 1] if j else 0.0, table[i - 1][j] if i and j < len(table[i - 1]) else 0.0)
            seconds[j] = max(seconds[j], floor)
    return StepCost(tuple(rows), tuple(widths), tuple(tuple(s) for s in table), measure_context_cost(runner, prefix))


def measure_context_cost(
    runner: ModelRunner,
    prefix: int = 128,
    longer: int = 960,  # with the widest query, within 1,024 positions (a power-of-two allocation)
    rows: int = 1,
    widths: tuple[int, int] = (1, 32),
    repeats: int = 3,
) -> ContextCost | None:
    """Fit ``ContextCost`` from forwards of ``rows`` rows × each of ``widths`` after ``prefix`` and
    after ``longer`` cached positions (best of ``repeats``): the difference per row and key at
    width 1, and its growth per query. None where the cache holds no context that much longer.

    No prefill: the forwards attend to whatever the cache holds (zeros past what the table's
    measurement wrote), which costs the same as a real context."""
    dev = runner.device
    cache, room = runner.cache, max(widths) + 1
    if cache.seq_limit is not None:
        longer = min(longer, cache.seq_limit - room)
    if isinstance(cache, SlotKVCache) and cache.token_budget is not None:  # every slot grows to the longest row
        slots = max(rows, cache.keys[0].shape[0] if cache.keys else 0)
        longer = min(longer, cache.token_budget // slots - room)
    elif isinstance(cache, PagedKVCache):
        longer = min(longer, cache.pool.free_blocks * cache.block_size // rows - room)
    if longer < prefix + 256:
        return None

    with torch.inference_mode(), cache.measurement_rows(rows, longer + room) as where:
        ids = torch.randint(0, runner.vocab_size, (rows, longer + max(widths)), device=dev)
        (w1, w2), keys = widths, longer - prefix
        d1, d2 = (
            _timed_forward(runner, where, ids, longer, w, repeats)
            - _timed_forward(runner, where, ids, prefix, w, repeats)
            for w in widths
        )
    per_query_key = max((d2 - d1) / (rows * keys * (w2 - w1)), 0.0)
    per_row_key = max(d1 / (rows * keys) - per_query_key * w1, 0.0)
    return ContextCost(prefix, per_row_key, per_query_key)


def _timed_forward(runner: ModelRunner, where: Any, ids: torch.Tensor, at: int, width: int, repeats: int) -> float:
    """Best of ``repeats`` seconds of one forward (and its logits) over the first len(ids) rows of
    ``where``, each bringing ``ids[:, at : at + width]`` after ``at`` cached positions."""
    import time

    dev, rows = runner.device, ids.shape[0]
    pos = torch.arange(at, at + width, device=dev)[None].expand(rows, width)
    mask = causal_mask(pos, at + width)
    static = runner.static if isinstance(where, PagedRows) else None
    if static is not None and static.serves(rows, width, at):  # as the engine runs it: the static step (a graph)
        host = ids[:, at : at + width].tolist()
        chain = [TokenTree(r[1:], list(range(-1, width - 2))) for r in host]
        tables = [runner.cache.own_blocks(b) for b in where.blocks[:rows]]
        step = functools.partial(static.forward, [r[0] for r in host], [at] * rows, chain, tables)
    else:
        step = functools.partial(runner.forward, _first(where, rows), ids[:, at : at + width], pos, mask)
    best = float("inf")
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.logits(step())
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _first(where: Any, rows: int) -> Any:
    """The first ``rows`` rows of a forward's rows (a slot slice or ``PagedRows``)."""
    if isinstance(where, slice):
        return slice(where.start, where.start + rows)
    return where.first(rows)
