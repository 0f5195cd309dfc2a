"""What the engine reports about its work: to ``/metrics`` (``specmesh_server.metrics``), or to nobody.

The engine calls one :class:`EngineObserver` unconditionally. The base class ignores every call (a
verifier without metrics); :class:`MetricsObserver` turns them into ``VerifierMetrics`` observations.
``observer_for`` picks one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specmesh_server.metrics import VerifierMetrics
    from verifier_svc.sequence import Sequence


class EngineObserver:
    """The engine's events, ignored: the observer of an engine without metrics."""

    def step_started(self, evictions: int) -> None:
        """An engine step starts; ``evictions``: the block pool's evictions so far."""

    def preempted(self, seq: Sequence) -> None:
        """``seq`` left the running batch to wait again (its KV is recomputed on return)."""

    def joined(self, seq: Sequence, first: bool) -> None:
        """``seq`` joined the running batch with ``seq.length`` of its ``seq.cache_target`` tokens
        from the prefix cache; ``first``: its first join (it waited ``seq.prefill_start - seq.arrival``)."""

    def step(self, phase: str, seconds: float, tokens: int, rows: int, path: str | None = None) -> None:
        """One forward (``VerifierMetrics.step``)."""

    def first_token(self, seq: Sequence) -> None:
        """``seq``'s prefill ended at ``seq.first_token``."""

    def grammar_step(self, seconds: float, pruned: int) -> None:
        """A decode step's grammar masks (and pruning) took ``seconds`` and cut ``pruned`` nodes."""

    def streamed(self, seq: Sequence, n: int) -> None:
        """A chunk of ``n`` tokens is streamed to ``seq``."""

    def finished(self, seq: Sequence, now: float) -> None:
        """``seq`` finished (not failed) at ``now``."""


class MetricsObserver(EngineObserver):
    """The engine's events as ``VerifierMetrics`` observations."""

    def __init__(self, metrics: VerifierMetrics) -> None:
        self.metrics = metrics
        self._evictions_seen = 0  # the pool's evictions already counted

    def step_started(self, evictions: int) -> None:
        # Blocks the last step's growth took from the prefix cache.
        self.metrics.kv_evictions.inc(evictions - self._evictions_seen)
        self._evictions_seen = evictions

    def preempted(self, seq: Sequence) -> None:
        self.metrics.preemptions.inc()

    def joined(self, seq: Sequence, first: bool) -> None:
        self.metrics.prefix_queries.inc(seq.cache_target)
        self.metrics.prefix_hits.inc(seq.length)
        if first:
            self.metrics.queued(seq.prefill_start - seq.arrival)

    def step(self, phase: str, seconds: float, tokens: int, rows: int, path: str | None = None) -> None:
        self.metrics.step(phase, seconds, tokens, rows, path)

    def first_token(self, seq: Sequence) -> None:
        self.metrics.first_token(seq.first_token - seq.arrival)

    def grammar_step(self, seconds: float, pruned: int) -> None:
        self.metrics.grammar_step(seconds, pruned)

    def streamed(self, seq: Sequence, n: int) -> None:
        """One observation per chunk: the gap since this request's last one (none for its first)."""
        now, last = time.perf_counter(), seq.last_chunk
        self.metrics.tokens(n, None if last is None else now - last)
        seq.last_chunk = now

    def finished(self, seq: Sequence, now: float) -> None:
        self.metrics.request_finished(
            "ok", len(seq.req.prompt_ids), generation_tokens=len(seq.output), e2e_s=now - seq.arrival
        )


def observer_for(metrics: VerifierMetrics | None) -> EngineObserver:
    """The engine's observer: its metrics' where it has them, else one that ignores everything."""
    return EngineObserver() if metrics is None else MetricsObserver(metrics)
