"""Torch threads that follow the cores the machine leaves free: a busy neighbour costs its share.

A step's parallel regions (the linears' kernel, oneDNN, attention) split their work evenly over the
torch threads and end at a barrier that waits for the last thread. When another process keeps one of
two cores busy, the kernel's scheduler runs one of the verifier's two threads only in slices between
the neighbour's, and every region waits for that thread's next slice: measured on a 2-core EPYC beside
a compile, a 1536 × 576 Q4_1 product took 16 ms at the median with 2 threads and 0.17 ms with 1; 24 plain
requests took 611 s instead of 44 s. One thread on the free core loses at most that core's share.

So between steps (:meth:`ThreadBudget.adjust`, at most once per ``interval_s``) the CPU time other
processes used on this process's cores over the last interval is read from ``/proc/stat`` less this
process's own (``os.times``), and the torch threads set to the cores left free (:func:`threads_for`),
never more than the configured ``--threads``. A new count is applied once two intervals in a row ask
for it, so a burst of a neighbour's work does not flip the count back and forth.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)
HEADROOM = 0.4  # a core counts as free once at most 0.6 of it is used by others (see threads_for)


def threads_for(free_cores: float, max_threads: int) -> int:
    """Threads for ``free_cores`` (cores others left idle over the last interval): the whole free cores,
    counting a core free from 0.6 of it on, at least 1 and at most ``max_threads``.

    >>> threads_for(2.0, 2), threads_for(1.7, 2), threads_for(1.5, 2), threads_for(0.3, 2), threads_for(7.9, 4)
    (2, 2, 1, 1, 4)
    """
    return max(1, min(max_threads, math.floor(free_cores + HEADROOM)))


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds: busy on this process's cores (every process), and this process's own."""

    at: float  # the clock's reading
    busy_s: float
    own_s: float


def read_sample(cpus: frozenset[int], clock: Callable[[], float] = time.monotonic) -> CpuSample | None:
    """The current :class:`CpuSample` over ``cpus``; None where ``/proc/stat`` cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
        busy += user + nice + system + irq + softirq + steal  # guest time is inside user
    own = os.times()
    return CpuSample(clock(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system)


def free_cores(before: CpuSample, after: CpuSample, cores: int) -> float:
    """Cores left idle by other processes between two samples.

    >>> free_cores(CpuSample(0.0, 10.0, 4.0), CpuSample(1.0, 11.8, 4.9), cores=2)   # others: 0.9 of a core
    1.1
    """
    wall = after.at - before.at
    others = max(0.0, (after.busy_s - before.busy_s) - (after.own_s - before.own_s)) / wall if wall > 0 else 0.0
    return round(cores - others, 6)


class ThreadBudget:
    """Sets the calling thread's torch threads to the cores others leave free (see the module's doc). Call
    :meth:`adjust` from the thread that runs the forwards, before each one."""

    def __init__(
        self,
        max_threads: int,
        interval_s: float = 0.5,
        sample: Callable[[], CpuSample | None] | None = None,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        cpus = frozenset(os.sched_getaffinity(0))
        self.cores, self.max_threads, self.interval_s = len(cpus), max_threads, interval_s
        self._clock = clock
        self._sample = sample or (lambda: read_sample(cpus, clock))
        self._set = set_threads
        self.threads = max_threads
        self._last = self._sample()
        self._asked: int | None = None  # what the previous interval asked for

    def adjust(self) -> int:
        """The torch threads for the next step (changed at most once an interval); cheap between intervals."""
        last = self._last
        if last is None or self._clock() - last.at < self.interval_s:
            return self.threads
        now = self._sample()
        if now is None:
            return self.threads
        self._last = now
        free = free_cores(last, now, self.cores)
        asked = threads_for(free, self.max_threads)
        if asked != self.threads and asked == self._asked:
            log.info("torch threads %d → %d: %.1f of %d cores free", self.threads, asked, free, self.cores)
            self._set(asked)
            self.threads = asked
        self._asked = asked
        return self.threads


def describe(budget: ThreadBudget | None) -> str:
    """The start-up line's words for the torch threads."""
    if budget is None:
        return f"torch threads {torch.get_num_threads()} (--adaptive-threads off, or not a one-rank CPU verifier)"
    return f"torch threads {budget.max_threads}, fewer while other processes keep cores busy (--adaptive-threads)"
