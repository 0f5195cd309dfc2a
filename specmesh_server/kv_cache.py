"""Slot-based KV cache: the draft proposer's (the verifier's is paged, ``paged_kv``).

Each running request owns a *slot* (a row of every layer's key/value buffer) and keeps its
tokens left-aligned in it, so requests of different lengths live side by side without
re-padding when one joins or leaves. Running requests occupy slots ``0..n-1``; a leaving
request's slot is refilled by moving the last one in (one copy of one request's KV), so a
forward over the running batch takes a view of the buffers, never a gather.

The object duck-types the part of transformers' ``Cache`` that decoder layers call
(``update(key_states, value_states, layer_idx, kwargs=…)``), so the stock HF model runs over it,
passed as the model's ``cache=`` argument. Which positions the new tokens are written to
is set per forward by :meth:`begin_forward`; masking is the caller's 4D attention mask.

The cache can be held to a token budget (``token_budget``: slots × positions allocated): growth
stops at it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

MIN_SLOTS, MIN_SEQ = 4, 512  # the smallest allocation; below it reallocating costs more than it saves


def bytes_per_position(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys and values of one position in every layer.

    >>> bytes_per_position(30, 3, 64, torch.float32)   # SmolLM2-135M in fp32
    46080
    """
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVBudgetExceeded(MemoryError):
    """Asked to hold more slots × positions than the cache's token budget."""


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        slot_capacity: int = MIN_SLOTS,
        seq_capacity: int = MIN_SEQ,
        seq_limit: int | None = None,
        token_budget: int | None = None,
    ) -> None:
        """``seq_limit``: positions per slot never exceed it (the model's context); ``token_budget``:
        slots × positions allocated never exceed it (None: unbounded)."""
        self.num_layers = num_layers
        self.shape_tail = (num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.seq_limit = seq_limit
        self.token_budget = token_budget
        self.keys: list[torch.Tensor] = []  # per layer [slots, kv_heads, seq_cap, head_dim]
        self.values: list[torch.Tensor] = []
        slots, seq = self.plan(1, 1)
        self._alloc(max(min(slot_capacity, slots), 1), max(min(seq_capacity, seq), 1))
        self._rows = slice(0, 0)
        self._write_pos: torch.Tensor | None = None  # [b, n] target positions of new tokens
        self._kv_len = 0

    # --- capacity -----------------------------------------------------------------------
    @property
    def slot_capacity(self) -> int:
        return self.keys[0].shape[0]

    @property
    def seq_capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one position in every layer."""
        return bytes_per_position(self.num_layers, *self.shape_tail, self.dtype)

    @property
    def allocated_bytes(self) -> int:
        return self.slot_capacity * self.seq_capacity * self.bytes_per_token

    def fits(self, slots: int, seq: int) -> bool:
        """Whether ``slots`` rows of ``seq`` positions fit in the token budget at all."""
        return self.token_budget is None or slots * seq <= self.token_budget

    def plan(self, slots: int, seq: int) -> tuple[int, int]:
        """The allocation for a need of ``slots`` × ``seq``: powers of two (at least MIN_SLOTS ×
        MIN_SEQ, at most ``seq_limit`` positions) so growth is amortised, then trimmed back toward the
        need where the budget is smaller.

        >>> c = SlotKVCache(1, 1, 1, torch.float32, torch.device("cpu"), token_budget=10_000)
        >>> c.plan(3, 600), c.plan(3, 3000), c.plan(5, 1900)
        ((4, 1024), (3, 3000), (5, 1900))
        """
        want_slots, want_seq = max(MIN_SLOTS, 1 << (slots - 1).bit_length()), max(MIN_SEQ, 1 << (seq - 1).bit_length())
        if self.seq_limit is not None:
            want_seq = max(seq, min(want_seq, self.seq_limit))
        budget = self.token_budget
        if budget is not None and want_slots * want_seq > budget:
            want_seq = max(seq, min(want_seq, budget // want_slots))
            if want_slots * want_seq > budget:
                want_slots = max(slots, budget // want_seq)
        return want_slots, want_seq

    def _alloc(self, slots: int, seq: int) -> None:
        """Reallocate to ``slots`` × ``seq``, keeping what fits. One layer at a time, so old and new
        buffers coexist for a layer, not for the whole cache."""
        heads, dim = self.shape_tail
        first = not self.keys
        if first:
            self.keys, self.values = [torch.empty(0)] * self.num_layers, [torch.empty(0)] * self.num_layers
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                new = torch.zeros(slots, heads, seq, dim, dtype=self.dtype, device=self.device)
                if not first:
                    s, t = min(slots, old.shape[0]), min(seq, old.shape[2])
                    new[:s, :, :t].copy_(old[:s, :, :t])
                bufs[i] = new
                del old

    def reserve(self, slots: int, seq: int) -> None:
        """Grow so that ``slots`` rows of ``seq`` positions fit (``plan``); KVBudgetExceeded if the
        budget cannot hold them."""
        if slots <= self.slot_capacity and seq <= self.seq_capacity:
            return
        if not self.fits(slots, seq):
            raise KVBudgetExceeded(
                f"{slots} × {seq} KV positions exceed the cache budget of {self.token_budget} positions"
            )
        new_slots, new_seq = self.plan(max(slots, self.slot_capacity), max(seq, self.seq_capacity))
        if not self.fits(new_slots, new_seq):  # keeping the other dimension's size does not fit: only the need
            new_slots, new_seq = self.plan(slots, seq)
        self._alloc(new_slots, new_seq)

    @contextlib.contextmanager
    def measurement_rows(self, rows: int, positions: int) -> Iterator[slice]:
        """Slots 0..rows-1, grown to ``positions`` positions (the step-cost measurement)."""
        self.reserve(rows, positions)
        yield slice(0, rows)

    # --- slots --------------------------------------------------------------------------
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        if src == dst or length == 0:
            return
        for buf in self.keys + self.values:
            buf[dst, :, :length].copy_(buf[src, :, :length])

    # --- forward protocol ---------------------------------------------------------------
    def begin_forward(
        self, rows: slice, write_pos: torch.Tensor, kv_len: int, token_rows: torch.Tensor | None = None
    ) -> None:
        """Next forward runs over slots ``rows``; token j of row i goes to ``write_pos[i, j]``.

        write_pos: int64 [b, n]; kv_len: keys/values returned per layer cover positions < kv_len.
        ``token_rows``: a packed forward (one row [1, N] of every request's tokens): token t belongs
        to row ``token_rows[0, t]`` (relative to ``rows``) and goes to its position ``write_pos[0, t]``.
        """
        self.reserve(rows.stop, kv_len)
        self._rows, self._write_pos, self._kv_len = rows, write_pos, kv_len
        if token_rows is not None:
            self._batch_index = token_rows  # [1, N]
        else:
            self._batch_index = torch.arange(rows.stop - rows.start, device=self.device)[:, None]  # [b, 1]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values ([b, kv_heads, n, dim]; packed: [1, kv_heads, N, dim]) and return the
        rows' [b, kv_heads, kv_len, dim] views."""
        k = self.keys[layer_idx][self._rows]  # [b, kv_heads, seq_cap, dim], a view
        v = self.values[layer_idx][self._rows]
        # Advanced indices around a slice put their dims first: k[b_idx, :, pos] is [b, n, kv_heads, dim].
        k[self._batch_index, :, self._write_pos] = key_states.transpose(1, 2).to(k.dtype)
        v[self._batch_index, :, self._write_pos] = value_states.transpose(1, 2).to(v.dtype)
        return k[:, :, : self._kv_len], v[:, :, : self._kv_len]

    def gather_positions(self, slot: int, src: torch.Tensor, dst_start: int) -> None:
        """Move positions ``src`` (int64 [m], ascending) of ``slot`` to ``dst_start..dst_start+m-1``.

        Used after tree verification to keep only the accepted nodes' entries.
        """
        m = src.numel()
        for buf in self.keys + self.values:
            buf[slot, :, dst_start : dst_start + m] = buf[slot, :, src]

    # Methods transformers may probe on a cache object.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    @property
    def is_compileable(self) -> bool:
        return False


def default_budget_bytes(device: torch.device) -> int:
    """The KV budget when none is given: 30 % of the memory free now (after the model is loaded):
    the device's free memory on a GPU; on a host MemAvailable (else physical memory), or what the
    container's cgroup limit leaves if that is less."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.3)
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # In a container /proc/meminfo shows the node: the cgroup's limit (less its usage) binds first.
    with contextlib.suppress(OSError, ValueError):
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                available = min(available, int(limit) - int(f.read()))
    return max(int(available * 0.3), 0)
