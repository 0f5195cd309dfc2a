"""Paged KV cache: every layer's keys and values in one pool of fixed-size blocks, a request's positions
in the blocks its ``BlockTable`` lists (``kv_blocks``: allocation, reference counts, prefix caching).

Layout per layer, keys and values alike: ``[kv_heads, (num_blocks + 1) · block_size, head_dim]``, the
flat *slot* of position p of a request being ``table[p // block_size] · block_size + p % block_size``.
The extra last block is scratch: padding tokens of a padded forward write there, and the positions a
row reads past its own blocks come from there (its mask hides them).

A forward writes its new tokens' keys and values at their slots, then gathers the blocks holding each
row's first ``kv_len`` positions, block by block, into a buffer reused across layers and steps, read as
``[b, kv_heads, kv_len, head_dim]`` as the attention functions take it (``attention``): one copy of the
rows' context per layer, where the dense cache's rows were views (``benchmarks/paged_step.py`` measures
what that costs). The object duck-types the part of transformers' ``Cache`` the decoder layers call,
like ``kv_cache.SlotKVCache``, so the stock HF model runs over it (``cache=``).

Every slot holds a finite value before it is first written: a masked key still enters its score
(q · k, then the mask's large negative), and NaN there, from uninitialised memory, would make the
whole row NaN. On CUDA the pool is zeroed at start. On a CPU it comes from ``calloc``: the kernel's
zero pages, committed only as blocks are first written, so the process's memory grows with the
blocks used, up to the budget, not at start.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specmesh_server.kv_blocks import BlockManager, BlockPool, BlockTable
from specmesh_server.kv_cache import bytes_per_position


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on a CPU from ``calloc`` (numpy's zeros), whose pages are committed when first
    written rather than by a fill at allocation.

    >>> zeros((2, 3), torch.bfloat16, torch.device("cpu")).sum().item()
    0.0
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(size, dtype=np.uint8)).view(dtype).view(shape)


@dataclass(frozen=True)
class PagedRows:
    """The rows of one forward: their block tables as a tensor, padded with the scratch block.

    table: int64 [b, blocks]
    """

    table: torch.Tensor

    @property
    def batch(self) -> int:
        return self.table.shape[0]


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int = 16,
        caching: bool = True,
    ) -> None:
        self.num_layers = num_layers
        self.shape_tail = (num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.block_size = block_size
        self.manager = BlockManager(BlockPool(num_blocks, block_size, caching))
        self.scratch = num_blocks  # the block past the pool's
        slots = (num_blocks + 1) * block_size
        shape = (num_kv_heads, slots, head_dim)
        self.keys = [zeros(shape, dtype, device) for _ in range(num_layers)]
        self.values = [zeros(shape, dtype, device) for _ in range(num_layers)]
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # flat, grown as needed
        self._write = self._read = torch.empty(0, dtype=torch.long, device=device)
        self._rows_len = (0, 0)  # (b, kv_len) of the current forward

    # --- capacity -----------------------------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        return self.manager.pool

    @property
    def token_budget(self) -> int:
        """Positions the pool holds."""
        return self.pool.num_blocks * self.block_size

    @property
    def seq_limit(self) -> None:
        return None

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_position(self.num_layers, *self.shape_tail, self.dtype)

    @property
    def allocated_bytes(self) -> int:
        return (self.pool.num_blocks + 1) * self.block_size * self.bytes_per_token

    def rows(self, tables: Sequence[BlockTable], positions: int) -> PagedRows:
        """The forward rows of ``tables``, each padded with the scratch block to cover ``positions``.

        >>> c = PagedKVCache(1, 1, 2, torch.float32, torch.device("cpu"), num_blocks=4, block_size=2)
        >>> c.rows([BlockTable(b"", blocks=[3, 1]), BlockTable(b"", blocks=[0])], 5).table.tolist()
        [[3, 1, 4], [0, 4, 4]]
        """
        cols = max(-(-positions // self.block_size), 1)
        padded = [t.blocks[:cols] + [self.scratch] * (cols - len(t.blocks[:cols])) for t in tables]
        return PagedRows(torch.tensor(padded, dtype=torch.long, device=self.device))  # one host→device copy

    @contextlib.contextmanager
    def measurement_rows(self, rows: int, positions: int) -> Iterator[PagedRows]:
        """Rows of ``positions`` positions in blocks taken for the while (the step-cost measurement)."""
        tables = [BlockTable(b"") for _ in range(rows)]
        try:
            for t in tables:
                self.manager.grow(t, positions)
            yield self.rows(tables, positions)
        finally:
            for t in tables:
                self.manager.close(t)

    # --- forward protocol ---------------------------------------------------------------
    def slots(self, table: torch.Tensor, positions: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
        """Flat slots of ``positions`` (int64, any shape, each below the table's columns × block size) of
        rows ``row_index`` (broadcast with it)."""
        bs = self.block_size
        return table[row_index, positions // bs] * bs + positions % bs

    def begin_forward(
        self, rows: PagedRows, write_pos: torch.Tensor, kv_len: int, token_rows: torch.Tensor | None = None
    ) -> None:
        """Next forward runs over ``rows``; token j of row i goes to position ``write_pos[i, j]``
        (packed, ``token_rows`` [1, N]: token t of row ``token_rows[0, t]`` to ``write_pos[0, t]``);
        attention sees each row's positions < ``kv_len``."""
        b = rows.batch
        # Every position a forward writes or reads is below kv_len (the mask spans them all), and a row's
        # padding reaches up to it even where the row's own tokens end sooner (a ragged prefill): the
        # table covers kv_len, past a row's blocks with the scratch block, so padding never lands in a
        # block of the row's.
        cols = -(-kv_len // self.block_size)
        table = rows.table[:, :cols]
        if table.shape[1] < cols:
            table = torch.cat([table, table.new_full((b, cols - table.shape[1]), self.scratch)], dim=1)
        row_index = token_rows if token_rows is not None else torch.arange(b, device=self.device)[:, None]
        self._write = self.slots(table, write_pos, row_index).reshape(-1)  # [tokens]
        self._read = table.reshape(-1)  # [b · cols] whole blocks, gathered block by block
        self._rows_len = (b, kv_len)
        heads, dim = self.shape_tail
        need = heads * b * cols * self.block_size * dim
        if self._buffers is None or self._buffers[0].numel() < need:
            self._buffers = tuple(torch.empty(need, dtype=self.dtype, device=self.device) for _ in range(2))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values ([b, kv_heads, n, dim]; packed [1, kv_heads, N, dim]) at their slots and
        return the rows' [b, kv_heads, kv_len, dim] context, gathered."""
        heads, dim = self.shape_tail
        b, kv_len = self._rows_len
        bs, blocks = self.block_size, self._read.numel()
        out = []
        for pool, new, buf in zip((self.keys, self.values), (key_states, value_states), self._buffers, strict=True):
            layer = pool[layer_idx]  # [kv_heads, slots, dim]
            layer[:, self._write] = new.transpose(0, 1).reshape(heads, -1, dim).to(layer.dtype)
            # Whole blocks, each one contiguous run of block_size × dim values (as fast as position by
            # position here: the copy is bound by memory, not by the number of indices).
            flat = buf[: heads * blocks * bs * dim].view(heads, blocks, bs * dim)
            torch.index_select(layer.view(heads, -1, bs * dim), 1, self._read, out=flat)
            rows = flat.view(heads, b, -1, dim)[:, :, :kv_len]  # [kv_heads, b, kv_len, dim]
            out.append(rows.transpose(0, 1))  # [b, kv_heads, kv_len, dim]
        return out[0], out[1]

    def copy_positions(self, table: BlockTable, src: torch.Tensor, dst_start: int) -> None:
        """Move positions ``src`` (int64 [m], ascending) of ``table``'s request to ``dst_start..+m-1``:
        after tree verification, the accepted nodes' entries in path order."""
        bs = self.block_size
        blocks = torch.tensor(table.blocks, dtype=torch.long, device=self.device)
        dst = torch.arange(dst_start, dst_start + src.numel(), device=self.device)
        src_slots, dst_slots = (blocks[p // bs] * bs + p % bs for p in (src.to(self.device), dst))
        for layer in self.keys + self.values:
            layer[:, dst_slots] = layer[:, src_slots]

    # Methods transformers may probe on a cache object.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._rows_len[1]

    @property
    def is_compileable(self) -> bool:
        return False
