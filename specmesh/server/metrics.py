"""Prometheus metrics of the SpecMesh services, served on each service's ``/metrics`` port.

Exporters only: the engine, the router and the proposers keep their own statistics and report
events here (``VerifierMetrics.speculation`` …), or are read at scrape time (gauges backed by a
function, ``RouterStatsCollector`` over a statistics backend). Nothing here is read back by a
service. Services import this module; the client SDK never does (prometheus_client is a
``serve`` dependency).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

REGISTRY = CollectorRegistry()  # this process's metrics (not prometheus_client's global default)

STEP_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
REQUEST_STATUSES = ("ok", "error", "rejected", "cancelled", "deadline_exceeded", "invalid")
FALLBACK_CATEGORIES = ("timeout", "unavailable", "stream_ended", "precondition", "invalid_argument", "error")


def fallback_category(reason: str) -> str:
    """A bounded label for a free-text fallback reason (engine / proposer session messages).

    >>> fallback_category("proposer 'draft' sent no tree for 2.0 s")
    'timeout'
    >>> fallback_category("proposer 'rag' failed: UNAVAILABLE: failed to connect to all addresses")
    'unavailable'
    >>> fallback_category("proposer 'ngram' failed: proposer ended the stream")
    'stream_ended'
    """
    text = reason.lower()
    for pattern, category in (
        (r"sent no tree|deadline_exceeded|timed? ?out", "timeout"),
        (r"unavailable|failed to connect|connection refused", "unavailable"),
        (r"ended the stream|cancelled", "stream_ended"),
        (r"failed_precondition", "precondition"),
        (r"invalid_argument", "invalid_argument"),
    ):
        if re.search(pattern, text):
            return category
    return "error"


class VerifierMetrics:
    """Counters, histograms and gauges of a verifier; the engine and servicers call the methods."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        r = registry
        self.requests = Counter("specmesh_requests", "Generate requests by outcome", ["status"], registry=r)
        for status in REQUEST_STATUSES:  # every outcome exported from the start, at 0
            self.requests.labels(status)
        self.prompt_tokens = Counter("specmesh_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("specmesh_generated_tokens", "Tokens generated (streamed)", registry=r)
        self.ttft = Histogram(
            "specmesh_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.spec_steps = Counter(
            "specmesh_speculation_steps", "Verification steps that carried a draft", ["proposer"], registry=r
        )
        self.drafted = Counter("specmesh_drafted_tokens", "Draft tokens verified", ["proposer"], registry=r)
        self.accepted = Counter("specmesh_accepted_tokens", "Draft tokens accepted", ["proposer"], registry=r)
        self.accepted_length = Histogram(
            "specmesh_accepted_length",
            "Draft tokens accepted per verification step",
            ["proposer"],
            buckets=ACCEPTED_BUCKETS,
            registry=r,
        )
        self.position_tried = Counter(
            "specmesh_position_tried",
            "Steps that decided the draft token at this depth (1-based)",
            ["proposer", "position"],
            registry=r,
        )
        self.position_accepted = Counter(
            "specmesh_position_accepted",
            "Steps that accepted the draft token at this depth (1-based)",
            ["proposer", "position"],
            registry=r,
        )
        self.step_seconds = Histogram(
            "specmesh_step_seconds", "Engine forward time by phase", ["phase"], buckets=STEP_BUCKETS, registry=r
        )
        self.step_tokens = Counter(
            "specmesh_step_tokens", "New tokens fed to forwards, by phase", ["phase"], registry=r
        )
        self.decisions = Counter(
            "specmesh_router_decisions",
            "Router decisions by proposer and whether it speculates now",
            ["proposer", "speculate"],
            registry=r,
        )
        self.invalid_trees = Counter(
            "specmesh_invalid_trees", "Malformed draft trees rejected", ["proposer"], registry=r
        )
        self.fallbacks = Counter(
            "specmesh_proposer_fallbacks",
            "Requests that lost their proposer and went on without speculation",
            ["proposer", "reason"],
            registry=r,
        )
        self.running = Gauge("specmesh_running_requests", "Requests in the running batch", registry=r)
        self.waiting = Gauge("specmesh_waiting_requests", "Requests admitted, not yet running", registry=r)

    def track_queue(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Read (running, waiting) at scrape time, e.g. ``engine.counts``."""
        self.running.set_function(lambda: counts()[0])
        self.waiting.set_function(lambda: counts()[1])

    def request_finished(self, status: str, prompt_tokens: int = 0, ttft_s: float | None = None) -> None:
        """Once per request: ``status`` one of REQUEST_STATUSES; generated tokens go through ``tokens``."""
        self.requests.labels(status if status in REQUEST_STATUSES else "error").inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)

    def tokens(self, n: int) -> None:
        self.generated_tokens.inc(n)

    def step(self, phase: str, seconds: float, tokens: int) -> None:
        """One forward: ``phase`` "prefill" | "decode"; ``tokens``: new tokens fed (padding included)."""
        self.step_seconds.labels(phase).observe(seconds)
        self.step_tokens.labels(phase).inc(tokens)

    def speculation(
        self,
        proposer: str,
        steps: float,
        drafted: float,
        accepted: float,
        hits: Iterable[float],
        trials: Iterable[float],
    ) -> None:
        """Counts of one or more verification steps (``router.stats.AcceptanceStats`` fields:
        ``hits[d]`` / ``trials[d]`` steps accepted / decided the token at depth d + 1)."""
        self.spec_steps.labels(proposer).inc(steps)
        self.drafted.labels(proposer).inc(drafted)
        self.accepted.labels(proposer).inc(accepted)
        hits, trials = list(hits), list(trials)
        for d, n in enumerate(trials):
            if n:
                self.position_tried.labels(proposer, str(d + 1)).inc(n)
        reached = steps  # steps that accepted at least d tokens
        for d, h in enumerate([*hits, 0.0]):
            if h:
                self.position_accepted.labels(proposer, str(d + 1)).inc(h)
            for _ in range(round(reached - h)):  # steps that accepted exactly d tokens
                self.accepted_length.labels(proposer).observe(d)
            reached = h

    def decision(self, proposer: str, speculate: bool) -> None:
        self.decisions.labels(proposer, "true" if speculate else "false").inc()

    def invalid_tree(self, proposer: str, n: int = 1) -> None:
        if n:
            self.invalid_trees.labels(proposer).inc(n)

    def fallback(self, proposer: str, reason: str) -> None:
        self.fallbacks.labels(proposer, fallback_category(reason)).inc()


class ProposerMetrics:
    """Metrics of a proposer service (n-gram, draft, rag)."""

    def __init__(self, proposer: str, registry: CollectorRegistry = REGISTRY) -> None:
        r = registry
        self.proposer = proposer
        self.sessions = Gauge("specmesh_proposer_open_sessions", "Open Propose streams", ["proposer"], registry=r)
        self.sessions_total = Counter(
            "specmesh_proposer_sessions", "Propose streams by outcome", ["proposer", "outcome"], registry=r
        )
        self.proposals = Counter("specmesh_proposals", "Draft trees sent", ["proposer"], registry=r)
        self.proposed_tokens = Counter("specmesh_proposed_tokens", "Draft tree nodes sent", ["proposer"], registry=r)
        self.proposal_seconds = Histogram(
            "specmesh_proposal_seconds",
            "Time to build one draft tree",
            ["proposer"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def session_started(self) -> None:
        self.sessions.labels(self.proposer).inc()

    def session_ended(self, outcome: str = "ok") -> None:
        """``outcome``: "ok" | "cancelled" | "error" | "rejected"."""
        self.sessions.labels(self.proposer).dec()
        self.sessions_total.labels(self.proposer, outcome).inc()

    def proposal(self, nodes: int, seconds: float) -> None:
        self.proposals.labels(self.proposer).inc()
        self.proposed_tokens.labels(self.proposer).inc(nodes)
        self.proposal_seconds.labels(self.proposer).observe(seconds)


class RouterStatsCollector:
    """Exports a router statistics backend (``router.stats.StatsBackend``) at scrape time.

    Workload tags are client text: beyond ``max_series`` keys only the busiest are exported
    (the pooled per-proposer keys, tag "", always are).
    """

    def __init__(self, backend, model: str = "", max_series: int = 200) -> None:
        self.backend, self.model, self.max_series = backend, model, max_series

    def collect(self):
        labels = ["model", "proposer", "workload_tag"]
        families = {
            "steps": GaugeMetricFamily("specmesh_router_steps", "Decayed verification steps", labels=labels),
            "accepted_per_step": GaugeMetricFamily(
                "specmesh_router_accepted_per_step", "Decayed mean accepted draft tokens per step", labels=labels
            ),
            "drafted_per_step": GaugeMetricFamily(
                "specmesh_router_drafted_per_step", "Decayed mean draft tokens per step", labels=labels
            ),
            "proposer_s_per_step": GaugeMetricFamily(
                "specmesh_router_proposer_wait_seconds_per_step",
                "Decayed mean verifier wait for drafts per step",
                labels=labels,
            ),
        }
        snap = self.backend.snapshot()
        rows = [(k, s) for k, s in snap.items() if not self.model or k.model == self.model]
        rows.sort(key=lambda ks: (ks[0].workload_tag != "", -ks[1].steps))
        for key, stats in rows[: self.max_series]:
            values = [key.model, key.proposer, key.workload_tag]
            for name, family in families.items():
                family.add_metric(values, getattr(stats, name))
        yield from families.values()
        status = self.backend.status()
        up = GaugeMetricFamily(
            "specmesh_router_stats_connected", "1 when the statistics backend is reachable", labels=["backend"]
        )
        up.add_metric([status.backend], 1.0 if status.connected else 0.0)
        yield up


@dataclass
class MetricsServer:
    port: int
    _server: object
    _thread: object

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_metrics_server(
    port: int, addr: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY
) -> MetricsServer | None:
    """Serve ``registry`` on http://addr:port/metrics in a daemon thread; port 0 = metrics off (None)."""
    if port <= 0:
        return None
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server.server_port, server, thread)
