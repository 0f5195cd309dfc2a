"""Paged KV cache: every layer's keys and values in one pool of fixed-size blocks, a request's positions
in the blocks its ``BlockTable`` lists (``kv_blocks``: allocation, reference counts, prefix caching).

Layout per layer, keys and values alike: ``[kv_heads, (num_blocks + 1) · block_size, head_dim]``, the
flat *slot* of position p of a request being ``table[p // block_size] · block_size + p % block_size``.
The extra last block is scratch: padding tokens of a padded forward write there, and the positions a
row reads past its own blocks come from there (its mask hides them).

A forward writes its new tokens' keys and values at their slots, then hands attention each row's
context in one of three ways:

- **In place** (on a CPU, with this package's attention function): ``update`` returns a
  :class:`BlockContext` — the layer's pool and, per row, the runs of consecutive slots holding its
  first positions (:func:`row_runs`) — and ``attention.paged_attention`` attends each row to its own
  runs where they lie, merging the runs' partial softmaxes by their log-sum-exp. Nothing is copied,
  and a row attends to its own length, not the longest row's.
- **Through the table** (the Triton tree-attention kernel's forwards, on CUDA): ``update`` returns a
  :class:`TableContext`, the pool and the forward's block table, and the kernel reads each position
  at its slot.
- **Gathered** (the other forwards elsewhere: CUDA's prefill chunks, where one launch over the batch
  beats a loop over rows, and models with transformers' own attention): the blocks holding each row's
  first ``kv_len`` positions are copied, block by block, into a buffer reused across layers and
  steps, read as ``[b, kv_heads, kv_len, head_dim]``.

``benchmarks/paged_step.py`` measures the CPU's two against the dense slot cache. The object duck-types the
part of transformers' ``Cache`` the decoder layers call, like ``kv_cache.SlotKVCache``, so the stock HF
model runs over it (``cache=``).

Every slot holds a finite value before it is first written: a masked key still enters its score
(q · k, then the mask's large negative), and NaN there, from uninitialised memory, would make the
whole row NaN. On CUDA the pool is zeroed at start. On a CPU it comes from ``calloc``: the kernel's
zero pages, committed only as blocks are first written, so the process's memory grows with the
blocks used, up to the budget, not at start.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specmesh_kernels.cpu_linear import InPlaceReads
from specmesh_server.kv_blocks import BlockManager, BlockPool, BlockTable
from specmesh_server.kv_cache import bytes_per_position
from specmesh_server.staging import upload


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
class Run:
    """A row's positions [start, stop), held at consecutive slots from ``slot``."""

    slot: int
    start: int
    stop: int


def row_runs(blocks: Sequence[int], length: int, block_size: int) -> tuple[Run, ...]:
    """The runs of consecutive slots holding positions [0, ``length``) of a row whose table is ``blocks``.

    >>> row_runs([4, 5, 9, 10, 2], 9, 2)   # blocks 4-5, 9-10, then 2 (one position of it)
    (Run(slot=8, start=0, stop=4), Run(slot=18, start=4, stop=8), Run(slot=4, start=8, stop=9))
    """
    runs: list[Run] = []
    first = 0  # index in blocks of the current run's first block
    used = -(-length // block_size)
    for j in range(1, used + 1):
        if j == used or blocks[j] != blocks[j - 1] + 1:
            runs.append(Run(blocks[first] * block_size, first * block_size, min(j * block_size, length)))
            first = j
    return tuple(runs)


# Runs shorter than this many positions are copied rather than attended where they lie: attending one
# more run costs about as much on a CPU as copying ~400 positions of every layer's keys and values
# (SmolLM2-135M, 2 threads: ~25 µs a call against ~0.06 µs a position; ``benchmarks/paged_step.py``).
MIN_RUN = 256


@dataclass(frozen=True)
class Gathered:
    """A row's short runs, copied: its positions ``positions`` (int64 [m], ascending) at slots
    [slot, slot + m) of the forward's gather buffer."""

    slot: int
    positions: torch.Tensor
    last: int  # the largest of positions


@dataclass(frozen=True)
class RowReads:
    """Where a row's context lies: long runs in the pool, the rest copied (``gathered``); and how much
    of it every query of the row sees: positions below ``shared`` (the row's first new token: the
    cached prefix) are attended without the mask."""

    runs: tuple[Run, ...]
    shared: int
    gathered: Gathered | None = None


def read_lists(rows: Sequence[RowReads]) -> tuple[list[tuple[int, ...]], list[tuple[int, int]], list[torch.Tensor]]:
    """The rows' reads as the CPU kernels take them (``InPlaceReads``): every run (row, slot, start, stop,
    masked), each row's copied run (first slot in the copies, masked) and its positions (empty: none). A run
    wholly below the row's ``shared`` position is unmasked."""
    runs, gathered, positions = [], [], []
    empty = torch.empty(0, dtype=torch.long)
    for i, row in enumerate(rows):
        runs += [(i, r.slot, r.start, r.stop, int(r.stop > row.shared)) for r in row.runs]
        g = row.gathered
        gathered.append((0, 0) if g is None else (g.slot, int(g.last >= row.shared)))
        positions.append(empty if g is None else g.positions)
    return runs, gathered, positions


def plan_reads(
    blocks: Sequence[int], length: int, shared: int, block_size: int, slot: int
) -> tuple[RowReads, list[int]]:
    """A row's reads of positions [0, ``length``) (table ``blocks``): runs of at least ``MIN_RUN``
    positions in place, the others' blocks copied to the gather buffer from ``slot`` on; returns the
    reads and the blocks to copy.

    >>> reads, copy = plan_reads(list(range(20)) + [40, 30], 346, 340, 16, 0)
    >>> reads.runs, copy, reads.gathered.positions[[0, -1]].tolist()
    ((Run(slot=0, start=0, stop=320),), [40, 30], [320, 345])
    """
    keep, copy, positions = [], [], []
    for run in row_runs(blocks, length, block_size):
        if run.stop - run.start >= MIN_RUN:
            keep.append(run)
            continue
        # Whole blocks are copied; only a row's last run may end inside its last block, so the copied
        # positions sit at consecutive slots of the buffer, in this order.
        first = run.start // block_size
        positions.append(torch.arange(run.start, run.stop))
        copy += blocks[first : first + -(-(run.stop - run.start) // block_size)]
    if not copy:
        return RowReads(tuple(keep), shared), []
    at = torch.cat(positions)  # [m]
    return RowReads(tuple(keep), shared, Gathered(slot, at, int(at[-1]))), copy


def move_slots(
    moves: Sequence[tuple[Sequence[int], Sequence[int], int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (source, destination) slots of several requests' moves, each (its blocks, source positions,
    first destination position): the source positions go to consecutive positions from there. Positions
    already in place are left out. Host tensors, int64 [m] each.

    >>> [t.tolist() for t in move_slots([([7, 3], [2, 4, 5], 2), ([1], [0], 0)], 4)]
    [[12, 13], [31, 12]]
    """
    src, dst = [], []
    for blocks, positions, start in moves:
        table = np.asarray(blocks, dtype=np.int64)
        p = np.asarray(positions, dtype=np.int64)
        q = np.arange(start, start + p.size, dtype=np.int64)
        moved = p != q
        src.append(table[p[moved] // block_size] * block_size + p[moved] % block_size)
        dst.append(table[q[moved] // block_size] * block_size + q[moved] % block_size)
    if not src:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    return torch.from_numpy(np.concatenate(src)), torch.from_numpy(np.concatenate(dst))


@dataclass(frozen=True)
class BlockContext:
    """One layer's keys or values, left in its pool, with the rows' reads: what ``update`` returns in
    place of a gathered tensor when attention reads blocks in place (``attention.paged_attention``).

    pool: [kv_heads, slots, head_dim]; gathered: [kv_heads, copied slots, head_dim] (the rows' short runs)
    """

    pool: torch.Tensor
    rows: tuple[RowReads, ...]
    gathered: torch.Tensor | None = None


@dataclass(frozen=True)
class TableContext:
    """One layer's keys or values in its pool with the forward's block table: what ``update`` returns
    for a forward through the tree-attention kernel, which reads the blocks through the table
    (``specmesh_kernels.tree_attention.paged_tree_attention``).

    pool: [kv_heads, slots, head_dim]; table: int32 [b, blocks], covering ``kv_len`` positions
    """

    pool: torch.Tensor
    table: torch.Tensor
    block_size: int
    kv_len: int
    bound: bool = False  # kv_len is only the table's capacity (a static step): rows' lengths are data


@dataclass(frozen=True)
class PagedRows:
    """The rows of one forward: their block tables, padded with the scratch block, as host lists (the
    in-place read plans its runs from those, with no device read) and, when a forward first asks, as a
    tensor on the device (one host→device copy; a static step never asks).

    table: int64 [b, blocks]
    """

    blocks: tuple[tuple[int, ...], ...]
    device: torch.device

    @functools.cached_property
    def table(self) -> torch.Tensor:
        return torch.tensor(self.blocks, dtype=torch.long, device=self.device)

    def first(self, rows: int) -> PagedRows:
        return PagedRows(self.blocks[:rows], self.device)

    @property
    def batch(self) -> int:
        return len(self.blocks)


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
        in_place: bool = False,
    ) -> None:
        """``in_place``: forwards that give their rows' extents (``begin_forward``) get
        :class:`BlockContext` from ``update``, for an attention function that reads blocks where they
        lie; other forwards, and every forward without it, get gathered tensors."""
        self.in_place = in_place
        self.num_layers = num_layers
        self.shape_tail = (num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.block_size = block_size
        self.manager = BlockManager(BlockPool(num_blocks, block_size, caching))
        self.scratch = num_blocks  # the block past the pool's
        slots = (num_blocks + 1) * block_size
        # Keys and values of every layer in one tensor: a step's accepted nodes move in one copy.
        self._pools = zeros((2, num_layers, num_kv_heads, slots, head_dim), dtype, device)
        self.keys = [self._pools[0, i] for i in range(num_layers)]  # [kv_heads, slots, dim] per layer, views
        self.values = [self._pools[1, i] for i in range(num_layers)]
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # flat, grown as needed
        self._write = self._read = torch.empty(0, dtype=torch.long, device=device)
        self._rows_len = (0, 0)  # (b, kv_len) of the current forward
        self._reads: tuple[RowReads, ...] | None = None  # the current forward's, where it reads in place
        self._table: torch.Tensor | None = None  # the current forward's, where the tree kernel reads through it
        self._bound = False  # the current forward's kv_len is a static step's capacity

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
        >>> c.rows([BlockTable(b"", blocks=[3, 1]), BlockTable(b"", blocks=[0])], 5).blocks
        ((3, 1, 4), (0, 4, 4))
        """
        cols = max(-(-positions // self.block_size), 1)
        padded = tuple(tuple(t.blocks[:cols] + [self.scratch] * (cols - len(t.blocks[:cols]))) for t in tables)
        return PagedRows(padded, self.device)

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
        self,
        rows: PagedRows,
        write_pos: torch.Tensor,
        kv_len: int,
        token_rows: torch.Tensor | None = None,
        shared: Sequence[int] | None = None,
        through_table: bool = False,
    ) -> None:
        """Next forward runs over ``rows``; token j of row i goes to position ``write_pos[i, j]``
        (packed, ``token_rows`` [1, N]: token t of row ``token_rows[0, t]`` to ``write_pos[0, t]``);
        attention sees each row's positions < ``kv_len``. ``shared``, per row: its first new token's
        position, below which every query of the row sees every position. Given to a cache that reads
        in place, the forward does: each row attends to its own blocks, up to ``kv_len`` (a real query
        sees its own position and those before it, all in the row's blocks; what lies past them is
        padding's, in the scratch block, and read by no real query). ``through_table``: the forward's
        attention is the tree kernel, which reads the blocks through the table (:class:`TableContext`)."""
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
        self._rows_len = (b, kv_len)
        self._table = table.to(torch.int32).contiguous() if through_table else None
        self._bound = False
        if through_table:
            self._reads = None
            return
        if self.in_place and shared is not None:
            bs, reads, copy = self.block_size, [], []
            for blocks, first in zip(rows.blocks, shared, strict=True):
                own = self.own_blocks(blocks)
                row, more = plan_reads(own, min(kv_len, len(own) * bs), first, bs, len(copy) * bs)
                reads.append(row)
                copy += more
            self._reads = tuple(reads)
            self._read = torch.tensor(copy, dtype=torch.long, device=self.device)
            self._ensure_buffers(len(copy))
            return
        self._reads = None
        self._read = table.reshape(-1)  # [b · cols] whole blocks, gathered block by block
        self._ensure_buffers(b * cols)

    def begin_static(self, write_slots: torch.Tensor, table: torch.Tensor) -> None:
        """Next forward is a static step's (``static_step``): its tokens go to ``write_slots`` (int64
        [tokens], computed on the host) and the tree kernel reads its rows through ``table`` (int32
        [b, columns]), both views of the step's device buffers; its rows' lengths are in the kernel's
        metadata, so nothing here depends on them (a CUDA graph replays the same calls)."""
        self._write, self._table, self._reads, self._bound = write_slots, table, None, True
        self._rows_len = (table.shape[0], table.shape[1] * self.block_size)

    def _ensure_buffers(self, blocks: int) -> None:
        """Gather buffers for ``blocks`` blocks' keys and values."""
        heads, dim = self.shape_tail
        need = heads * blocks * self.block_size * dim
        if self._buffers is None or self._buffers[0].numel() < need:
            self._buffers = tuple(torch.empty(need, dtype=self.dtype, device=self.device) for _ in range(2))

    def own_blocks(self, blocks: tuple[int, ...]) -> tuple[int, ...]:
        """A padded table's own blocks: those before the scratch block."""
        return blocks[: blocks.index(self.scratch)] if self.scratch in blocks else blocks

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[BlockContext, BlockContext] | tuple[TableContext, TableContext]:
        """Write new keys/values ([b, kv_heads, n, dim]; packed [1, kv_heads, N, dim]) at their slots and
        return the rows' context: in place, a :class:`BlockContext` each; through the table, a
        :class:`TableContext` each; else [b, kv_heads, kv_len, dim] each, gathered."""
        heads, dim = self.shape_tail
        layers = (self.keys[layer_idx], self.values[layer_idx])  # [kv_heads, slots, dim] each
        for layer, new in zip(layers, (key_states, value_states), strict=True):
            layer[:, self._write] = new.transpose(0, 1).reshape(heads, -1, dim).to(layer.dtype)
        if self._table is not None:
            kv_len, bound = self._rows_len[1], self._bound
            return TableContext(layers[0], self._table, self.block_size, kv_len, bound), TableContext(
                layers[1], self._table, self.block_size, kv_len, bound
            )
        b, kv_len = self._rows_len
        bs, blocks = self.block_size, self._read.numel()
        out = []
        for layer, buf in zip(layers, self._buffers, strict=True):
            # Whole blocks, each one contiguous run of block_size × dim values (as fast as position by
            # position here: the copy is bound by memory, not by the number of indices).
            flat = buf[: heads * blocks * bs * dim].view(heads, blocks, bs * dim)
            if blocks:
                torch.index_select(layer.view(heads, -1, bs * dim), 1, self._read, out=flat)
            out.append(flat.view(heads, blocks * bs, dim))  # [kv_heads, blocks · bs, dim]
        if self._reads is not None:
            copied = [o if blocks else None for o in out]
            return BlockContext(layers[0], self._reads, copied[0]), BlockContext(layers[1], self._reads, copied[1])
        rows = [o.view(heads, b, -1, dim)[:, :, :kv_len].transpose(0, 1) for o in out]  # [b, kv_heads, kv_len, dim]
        return rows[0], rows[1]

    @property
    def pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's keys and values: [layers, kv_heads, slots, head_dim] each."""
        return self._pools[0], self._pools[1]

    def in_place_reads(self) -> InPlaceReads | None:
        """The current forward's writes and rows' reads as the native decoder loop takes them
        (``specmesh_kernels.cpu_linear.decode_layers``); None unless it reads in place."""
        if self._reads is None or self._table is not None:
            return None
        return InPlaceReads.of(self._write, self._read, self.block_size, *read_lists(self._reads))

    def copy_positions(self, table: BlockTable, src: torch.Tensor, dst_start: int) -> None:
        """Move positions ``src`` (int64 [m], ascending) of ``table``'s request to ``dst_start..+m-1``:
        after tree verification, the accepted nodes' entries in path order."""
        self.copy_slots(*move_slots([(table.blocks, src.tolist(), dst_start)], self.block_size))

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's keys and values at flat slots ``src`` (int64 [m]) to slots ``dst``, in one copy
        (the source is read whole before any of it is written, so the two may overlap)."""
        if src.numel():
            src, dst = upload([src, dst], self.device)  # one copy, no wait for the device
            self._pools[:, :, :, dst] = self._pools[:, :, :, src]

    # Methods transformers may probe on a cache object.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._rows_len[1]

    @property
    def is_compileable(self) -> bool:
        return False
