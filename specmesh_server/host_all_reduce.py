"""All-reduce through shared memory, for tensor-parallel ranks on one host's CPUs.

gloo's all-reduce goes through TCP on the loopback: on a 2-core host each call costs about 1 ms (two
processes woken in turn), and a SmolLM2 forward makes 60 of them (two per layer), most of the step
(``docs/bench``). Here the ranks of one host share one mapped file (in ``/dev/shm``):

    flags  int64 [world, 8]               rank r's count of all-reduces it has written (one cache line each)
    data   [2, world, capacity] bytes     rank r's operand of call s at data[s % 2, r]

Call s: write the operand to ``data[s % 2, rank]``, publish ``flags[rank] = s``, wait until every
rank's flag reaches s, then sum the world rows in rank order into the operand — the same sum, in
the same order, on every rank, so the ranks' hidden states stay equal. Two buffers suffice: a rank
writes call s + 1's operand only after it has seen every flag reach s, and a rank raises its flag to s
only after it has read call s − 1's rows. Stores are ordered on x86-64 (the operand before the flag),
which this module requires; elsewhere, or for an operand over ``capacity``, the caller uses gloo.
vLLM's CPU backend does the same in C++ (``shm_allreduce``).

A wait longer than ``timeout_s``, or ``abort`` set (rank 0's watch saw a rank die), raises
:class:`RankFailure`.
"""

from __future__ import annotations

import os
import platform
import threading
import time

import torch


class RankFailure(RuntimeError):
    """A collective failed or timed out: a rank died or hangs. The service cannot go on."""


FLAG_STRIDE = 8  # int64s per rank's flag: one 64-byte cache line each
HEADER = 4096  # bytes before the data (flags of up to 64 ranks)


def supported() -> bool:
    """x86-64 (ordered stores) with a shared-memory file system."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class HostAllReduce:
    """One group's shared-memory all-reduce (module docstring). Rank 0 creates the file, the others
    map it after a barrier (``attach``)."""

    def __init__(self, path: str, rank: int, world: int, capacity_bytes: int, timeout_s: float) -> None:
        self.path, self.rank, self.world = path, rank, world
        self.capacity = capacity_bytes
        self.timeout_s = timeout_s
        self.abort = threading.Event()
        self.seq = 0
        self._size = HEADER + 2 * world * capacity_bytes
        self._mem: torch.Tensor | None = None

    def create(self) -> None:
        """Rank 0, before the others ``attach``: the zeroed file."""
        with open(self.path, "wb") as f:
            f.truncate(self._size)
        self.attach()

    def attach(self) -> None:
        self._mem = torch.from_file(self.path, shared=True, size=self._size, dtype=torch.uint8)
        self._flags = self._mem[:HEADER].view(torch.int64).numpy()  # shares the mapping
        self._data = self._mem[HEADER:].view(2, self.world, self.capacity)

    def unlink(self) -> None:
        """Rank 0, once every rank has attached: the mapping stays, the name goes."""
        if os.path.exists(self.path):
            os.unlink(self.path)

    def fits(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.is_contiguous() and t.numel() * t.element_size() <= self.capacity

    def __call__(self, t: torch.Tensor) -> None:
        """Sum ``t`` (contiguous, on the CPU, within ``capacity``) over the ranks, in place."""
        self.seq += 1
        rows = self._data[self.seq % 2][:, : t.numel() * t.element_size()].view(t.dtype)  # [world, n]
        rows[self.rank].copy_(t.view(-1))
        self._flags[self.rank * FLAG_STRIDE] = self.seq
        self._wait(self.seq)
        torch.sum(rows, dim=0, out=t.view(-1))

    def _wait(self, seq: int) -> None:
        flags = self._flags[::FLAG_STRIDE][: self.world]
        spins = 0
        while flags.min() < seq:
            spins += 1
            if spins % 64 == 0:
                os.sched_yield()  # a rank waiting for another on the same cores lets it run
                if spins % 4096 == 0:
                    if self.abort.is_set():
                        raise RankFailure("all-reduce abandoned: a rank failed")
                    if spins == 4096:
                        deadline = time.monotonic() + self.timeout_s
                    elif time.monotonic() > deadline:
                        late = [r for r in range(self.world) if flags[r] < seq]
                        raise RankFailure(f"all-reduce timed out after {self.timeout_s:g} s waiting for ranks {late}")
