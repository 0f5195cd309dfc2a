"""The local verifier's own step timings, read from its Prometheus /metrics around each run.

With ``--tensor-parallel-size N > 1`` the bench reads the verifier's /metrics before and after the
requests of every mode in every wave and adds up the differences per (sampling, concurrency, mode):
decode steps and their forward seconds (``specmesh_step_seconds{phase="decode"}``, every batch
label) and the seconds rank 0 spent in all-reduces in them
(``specmesh_tensor_parallel_all_reduce_seconds{phase="decode"}``). Warm-ups, first answers and the
probes before the run fall outside every wave, so they count nowhere.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass

STEP = "specmesh_step_seconds"
ALL_REDUCE = "specmesh_tensor_parallel_all_reduce_seconds"


@dataclass(frozen=True)
class DecodeTotals:
    """Cumulative decode-step counters of one /metrics reading (or the difference of two)."""

    steps: float = 0.0  # decode forwards
    step_seconds: float = 0.0  # their forward time
    all_reduce_seconds: float = 0.0  # rank 0's time in all-reduces within them
    all_reduce_steps: float = 0.0  # decode forwards that did any all-reduce

    def __sub__(self, other: DecodeTotals) -> DecodeTotals:
        return self + DecodeTotals(*(-x for x in astuple(other)))

    def __add__(self, other: DecodeTotals) -> DecodeTotals:
        return DecodeTotals(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def decode_totals(text: str) -> DecodeTotals:
    """The decode counters of a Prometheus text exposition (0 for a histogram it lacks).

    >>> decode_totals('specmesh_step_seconds_count{phase="decode",batch="1",model="m"} 3\\n'
    ...               'specmesh_step_seconds_sum{phase="decode",batch="1",model="m"} 0.3\\n')
    DecodeTotals(steps=3.0, step_seconds=0.3, all_reduce_seconds=0.0, all_reduce_steps=0.0)
    """
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {f"{name}_{part}" for name in (STEP, ALL_REDUCE) for part in ("sum", "count")}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):  # by sample name: typed (# TYPE) or not
        for s in family.samples:
            if s.name in wanted and s.labels.get("phase") == "decode":
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    return DecodeTotals(
        steps=sums.get(f"{STEP}_count", 0.0),
        step_seconds=sums.get(f"{STEP}_sum", 0.0),
        all_reduce_seconds=sums.get(f"{ALL_REDUCE}_sum", 0.0),
        all_reduce_steps=sums.get(f"{ALL_REDUCE}_count", 0.0),
    )


@dataclass
class DecodeRow:
    """One mode at one concurrency: its decode steps, and the all-reduces in them (rank 0; none at TP=1)."""

    sampling: str
    concurrency: int
    mode: str
    decode_steps: int
    decode_step_s: float | None  # mean forward seconds per decode step
    all_reduce_s: float | None  # mean all-reduce seconds per decode step
    all_reduce_share: float | None  # all_reduce_s / decode_step_s


def decode_row(sampling: str, concurrency: int, mode: str, d: DecodeTotals) -> DecodeRow:
    """A run's row from its summed differences.

    >>> r = decode_row("greedy", 1, "plain", DecodeTotals(4, 0.2, 0.05, 4))
    >>> r.decode_steps, r.decode_step_s, r.all_reduce_s, r.all_reduce_share
    (4, 0.05, 0.0125, 0.25)
    """
    steps = round(d.steps)
    step_s = d.step_seconds / steps if steps else None
    reduce_s = d.all_reduce_seconds / steps if steps else None
    share = d.all_reduce_seconds / d.step_seconds if d.step_seconds > 0 else None
    return DecodeRow(sampling, concurrency, mode, steps, step_s, reduce_s, share)


class VerifierMeter:
    """Reads ``url`` (the verifier's /metrics) around each run's waves (``BenchRunner``'s
    ``meter``) and sums the decode differences per (sampling, concurrency, mode)."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.totals: dict[tuple[str, int, str], DecodeTotals] = {}
        self._warned = False

    def read(self) -> DecodeTotals | None:
        """The counters now; None (with a warning, once) where /metrics does not answer."""
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as resp:
                return decode_totals(resp.read().decode())
        except (urllib.error.URLError, OSError) as exc:
            if not self._warned:
                print(f"bench: cannot read the verifier's metrics at {self.url} ({exc}); skipped", file=sys.stderr)
                self._warned = True
            return None

    @contextmanager
    def wave(self, mode: str, sampling: str, concurrency: int) -> Iterator[None]:
        before = self.read()
        yield
        after = self.read()
        if before is not None and after is not None:
            key = (sampling, concurrency, mode)
            self.totals[key] = self.totals.get(key, DecodeTotals()) + (after - before)

    def rows(self) -> list[DecodeRow]:
        return [decode_row(s, c, m, d) for (s, c, m), d in self.totals.items()]
