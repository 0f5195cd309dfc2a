"""Slot-based KV cache shared by all running requests of one verifier.

Each running request owns a *slot* (a row of every layer's key/value buffer) and keeps its
tokens left-aligned in it, so requests of different lengths live side by side without
re-padding when one joins or leaves. Running requests occupy slots ``0..n-1``; a leaving
request's slot is refilled by moving the last one in (one copy of one request's KV), so a
forward over the running batch takes a view of the buffers, never a gather.

The object duck-types the part of transformers' ``Cache`` that decoder layers call
(``update``), so the stock HF model runs over it. Which positions the new tokens are written to
is set per forward by :meth:`begin_forward`; masking is the caller's 4D attention mask.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        slot_capacity: int = 4,
        seq_capacity: int = 512,
        seq_limit: int | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.shape_tail = (num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.seq_limit = seq_limit
        self.keys: list[torch.Tensor] = []  # per layer [slots, kv_heads, seq_cap, head_dim]
        self.values: list[torch.Tensor] = []
        self._alloc(slot_capacity, seq_capacity)
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

    def _alloc(self, slots: int, seq: int) -> None:
        heads, dim = self.shape_tail
        old_k, old_v = self.keys, self.values
        self.keys = [
            torch.zeros(slots, heads, seq, dim, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        if old_k:
            s, t = min(slots, old_k[0].shape[0]), min(seq, old_k[0].shape[2])
            for new, old in zip(self.keys + self.values, old_k + old_v, strict=True):
                new[:s, :, :t].copy_(old[:s, :, :t])

    def reserve(self, slots: int, seq: int) -> None:
        """Grow (by doubling) so that ``slots`` rows of ``seq`` positions fit."""
        if slots <= self.slot_capacity and seq <= self.seq_capacity:
            return
        new_slots = self.slot_capacity
        while new_slots < slots:
            new_slots *= 2
        new_seq = self.seq_capacity
        while new_seq < seq:
            new_seq *= 2
        if self.seq_limit is not None:
            new_seq = max(seq, min(new_seq, self.seq_limit))
        self._alloc(new_slots, new_seq)

    # --- slots --------------------------------------------------------------------------
    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        if src == dst or length == 0:
            return
        for buf in self.keys + self.values:
            buf[dst, :, :length].copy_(buf[src, :, :length])

    # --- forward protocol ---------------------------------------------------------------
    def begin_forward(self, rows: slice, write_pos: torch.Tensor, kv_len: int) -> None:
        """Next forward runs over slots ``rows``; token j of row i goes to ``write_pos[i, j]``.

        write_pos: int64 [b, n]; kv_len: keys/values returned per layer cover positions < kv_len.
        """
        self.reserve(rows.stop, kv_len)
        self._rows, self._write_pos, self._kv_len = rows, write_pos, kv_len
        self._batch_index = torch.arange(rows.stop - rows.start, device=self.device)[:, None]  # [b, 1]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values ([b, kv_heads, n, dim]) and return [b, kv_heads, kv_len, dim] views."""
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
