"""The torch threads follow the cores other processes leave free (specmesh_server.thread_budget)."""

from __future__ import annotations

import os
import subprocess
import sys

from specmesh_server import thread_budget
from specmesh_server.thread_budget import CpuSample, ThreadBudget, free_cores, read_sample, threads_for


def test_threads_are_the_whole_free_cores_within_bounds():
    assert [threads_for(f, 2) for f in (2.0, 1.6, 1.59, 1.0, 0.0)] == [2, 2, 1, 1, 1]
    assert threads_for(16.0, 4) == 4 and threads_for(3.2, 8) == 3


class Machine:
    """A fake /proc/stat: ``others`` cores busy with other processes' work since the last reading."""

    def __init__(self) -> None:
        self.t, self.busy, self.own, self.others = 0.0, 0.0, 0.0, 0.0

    def run(self, seconds: float, own_cores: float = 1.0) -> None:
        self.t += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + self.others) * seconds

    def sample(self) -> CpuSample:
        return CpuSample(self.t, self.busy, self.own)


def _budget(m: Machine, set_to: list[int]) -> ThreadBudget:
    budget = ThreadBudget(2, interval_s=0.5, sample=m.sample, set_threads=set_to.append, clock=lambda: m.t)
    budget.cores = 2
    return budget


def test_a_busy_neighbour_takes_a_thread_after_two_intervals_and_gives_it_back_when_it_leaves():
    m, set_to = Machine(), []
    budget = _budget(m, set_to)
    m.run(0.6)
    assert budget.adjust() == 2 and set_to == []  # quiet
    m.others = 1.0  # a compile starts on one core
    m.run(0.6)
    assert budget.adjust() == 2 and set_to == []  # asked once: not yet
    m.run(0.1)
    assert budget.adjust() == 2 and set_to == []  # within the interval: not even read
    m.run(0.5)
    assert budget.adjust() == 1 and set_to == [1]  # asked twice in a row
    m.others = 0.0
    for _ in range(2):
        m.run(0.6)
        budget.adjust()
    assert budget.threads == 2 and set_to == [1, 2]


def test_a_short_burst_does_not_flip_the_count():
    m, set_to = Machine(), []
    budget = _budget(m, set_to)
    for others in (0.0, 1.2, 0.0, 1.5, 0.1, 0.0):
        m.others = others
        m.run(0.6)
        budget.adjust()
    assert set_to == [] and budget.threads == 2


def test_never_more_threads_than_configured():
    m, set_to = Machine(), []
    budget = ThreadBudget(1, interval_s=0.5, sample=m.sample, set_threads=set_to.append, clock=lambda: m.t)
    for _ in range(4):
        m.run(0.6)
        assert budget.adjust() == 1
    assert set_to == []


def test_proc_stat_counts_another_process_and_not_this_one():
    cpus = frozenset(os.sched_getaffinity(0))
    before = read_sample(cpus)
    assert before is not None
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass"])
    _, _, usage = os.wait4(child.pid, 0)
    child.returncode = 0
    spent = usage.ru_utime + usage.ru_stime  # the child's CPU seconds
    after = read_sample(cpus)
    others = len(cpus) - free_cores(before, after, len(cpus))  # cores, over the wall time
    assert others * (after.at - before.at) >= 0.8 * spent - 0.05
    assert spent > 0.3


def test_describe_says_which():
    assert "adaptive-threads" in thread_budget.describe(None)
    assert "fewer while" in thread_budget.describe(ThreadBudget(2, sample=lambda: None))
