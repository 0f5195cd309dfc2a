"""Prometheus metrics of the SpecMesh services, served on each service's ``/metrics`` port.

Exporters only: the engine, the router and the proposers keep their own statistics and report
events here (``VerifierMetrics.speculation`` …), or are read at scrape time (gauges backed by a
function, ``RouterStatsCollector`` over a statistics backend). Nothing here is read back by a
service. Services import this module; the client SDK never does (prometheus_client is a
``serve`` dependency).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

REGISTRY = CollectorRegistry()  # this process's metrics (not prometheus_client's global default)

# Latency buckets span a GPU's milliseconds and a small CPU's seconds alike.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
LENGTH_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
REQUEST_STATUSES = ("ok", "error", "rejected", "cancelled", "deadline_exceeded", "invalid")
FALLBACK_CATEGORIES = ("timeout", "unavailable", "stream_ended", "precondition", "invalid_argument", "error")


class AllReduceClock:
    """Seconds spent in the all-reduces since the last :meth:`take` (one process's row-parallel layers)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.calls += 1

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


ALL_REDUCES = AllReduceClock()  # the row-parallel layers' (``tensor_parallel``)


def batch_class(rows: int) -> str:
    """A bounded label for a forward's batch size (requests in it): powers of two, then "33+".

    >>> [batch_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 500)]
    ['1', '2', '3-4', '3-4', '5-8', '5-8', '9-16', '9-16', '17-32', '17-32', '33+', '33+']
    """
    return _BATCH_CLASSES[rows] if 0 <= rows < len(_BATCH_CLASSES) else "33+"


_BATCH_CLASSES = ("0", "1", "2", *["3-4"] * 2, *["5-8"] * 4, *["9-16"] * 8, *["17-32"] * 16)


def bounded_tag(tag: str, allowed: Collection[str]) -> str:
    """What a client's ``workload_tag`` becomes as a Prometheus label: itself if the operator
    allow-listed it (``--metrics-tags``), "" if empty, else "other" (bounded; no tenant name leaks).

    >>> [bounded_tag(t, {"code"}) for t in ("code", "", "tenant-acme-secret")]
    ['code', '', 'other']
    """
    return tag if not tag or tag in allowed else "other"


def fallback_category(reason: str) -> str:
    """A bounded label for a free-text fallback reason (engine / proposer session messages).

    >>> fallback_category("proposer 'draft' answered nothing for 2.0 s")
    'timeout'
    >>> fallback_category("proposer 'rag' failed: UNAVAILABLE: failed to connect to all addresses")
    'unavailable'
    >>> fallback_category("proposer 'ngram' failed: proposer ended the stream")
    'stream_ended'
    """
    text = reason.lower()
    for pattern, category in (
        (r"answered nothing|deadline_exceeded|timed? ?out", "timeout"),
        (r"unavailable|failed to connect|connection refused", "unavailable"),
        (r"ended the stream|cancelled", "stream_ended"),
        (r"failed_precondition", "precondition"),
        (r"invalid_argument", "invalid_argument"),
    ):
        if re.search(pattern, text):
            return category
    return "error"


class VerifierMetrics:
    """Counters, histograms and gauges of a verifier; the engine and servicers call the methods.

    Every series carries ``model`` (the served model's name), the last label. The engine thread's
    calls (``tokens``, ``step``, ``first_token`` …) use children bound at start-up: one observe each.
    """

    def __init__(self, registry: CollectorRegistry = REGISTRY, model: str = "", proposers: Iterable[str] = ()) -> None:
        """``proposers``: the configured proposer names, whose counters are exported at 0 from the
        start (a fallback or an invalid tree is then a change of a known series, which ``rate`` sees)."""
        r, m = registry, ["model"]
        self.model = model
        self.requests = Counter("specmesh_requests", "Generate requests by outcome", ["status", *m], registry=r)
        for status in REQUEST_STATUSES:  # every outcome exported from the start, at 0
            self.requests.labels(status, model)
        self.prompt_tokens = Counter("specmesh_prompt_tokens", "Prompt tokens prefilled", m, registry=r)
        self.generated_tokens = Counter("specmesh_generated_tokens", "Tokens generated (streamed)", m, registry=r)
        self.ttft = Histogram(
            "specmesh_time_to_first_token_seconds", "Arrival to first token", m, buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "specmesh_inter_token_latency_seconds",
            "Gap between a request's consecutive streamed chunks (one per verification step that emitted: "
            "a step accepting several draft tokens is one gap)",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "specmesh_e2e_request_latency_seconds",
            "Arrival to last token of a finished request",
            m,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "specmesh_request_queue_time_seconds",
            "Arrival to the start of the request's prefill (time waiting for a slot and KV memory)",
            m,
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.prompt_length = Histogram(
            "specmesh_request_prompt_tokens",
            "Prompt length of finished requests",
            m,
            buckets=LENGTH_BUCKETS,
            registry=r,
        )
        self.generation_length = Histogram(
            "specmesh_request_generation_tokens",
            "Generated tokens of finished requests",
            m,
            buckets=LENGTH_BUCKETS,
            registry=r,
        )
        self.spec_steps = Counter(
            "specmesh_speculation_steps", "Verification steps that carried a draft", ["proposer", *m], registry=r
        )
        self.drafted = Counter("specmesh_drafted_tokens", "Draft tokens verified", ["proposer", *m], registry=r)
        self.accepted = Counter("specmesh_accepted_tokens", "Draft tokens accepted", ["proposer", *m], registry=r)
        self.accepted_length = Histogram(
            "specmesh_accepted_length",
            "Draft tokens accepted per verification step",
            ["proposer", *m],
            buckets=ACCEPTED_BUCKETS,
            registry=r,
        )
        self.position_tried = Counter(
            "specmesh_position_tried",
            "Steps that decided the draft token at this depth (1-based)",
            ["proposer", "position", *m],
            registry=r,
        )
        self.position_accepted = Counter(
            "specmesh_position_accepted",
            "Steps that accepted the draft token at this depth (1-based)",
            ["proposer", "position", *m],
            registry=r,
        )
        self.step_seconds = Histogram(
            "specmesh_step_seconds",
            "Engine forward time by phase and batch size (requests in the forward, bucketed: batch_class)",
            ["phase", "batch", *m],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.all_reduce_seconds = Histogram(
            "specmesh_tensor_parallel_all_reduce_seconds",
            "Time a forward of a tensor-parallel target spent in its all-reduces (rank 0), by phase",
            ["phase", *m],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.step_tokens = Counter(
            "specmesh_step_tokens", "New tokens fed to forwards, by phase", ["phase", *m], registry=r
        )
        self.decode_paths = Counter(
            "specmesh_decode_steps",
            "Decode steps by path: graph (a captured CUDA graph replayed), static (the static step run eagerly), "
            "eager (a step no bucket holds, or static steps off)",
            ["path", *m],
            registry=r,
        )
        self.decisions = Counter(
            "specmesh_router_decisions",
            "Router decisions by proposer and whether it speculates now",
            ["proposer", "speculate", *m],
            registry=r,
        )
        self.invalid_trees = Counter(
            "specmesh_invalid_trees", "Malformed draft trees rejected", ["proposer", *m], registry=r
        )
        self.fallbacks = Counter(
            "specmesh_proposer_fallbacks",
            "Requests that lost their proposer and went on without speculation",
            ["proposer", "reason", *m],
            registry=r,
        )
        self.learn_calls = Counter(
            "specmesh_learn_calls",
            "Finished outputs sent to proposer tiers that did not follow the request (Learn), by outcome",
            ["proposer", "outcome", *m],
            registry=r,
        )
        self.hidden_copies = Counter(
            "specmesh_hidden_state_copies",
            "Host copies of hidden states for proposers that take them (one per step for the whole batch)",
            m,
            registry=r,
        ).labels(model)
        self.hidden_rows = Counter(
            "specmesh_hidden_state_rows", "Hidden-state rows sent to proposers (one per appended token)", m, registry=r
        ).labels(model)
        self.running = Gauge("specmesh_running_requests", "Requests in the running batch", m, registry=r)
        self.waiting = Gauge("specmesh_waiting_requests", "Requests admitted, not yet running", m, registry=r)
        self.kv_bytes = Gauge("specmesh_kv_cache_bytes", "KV cache memory allocated", m, registry=r)
        self.kv_budget = Gauge(
            "specmesh_kv_cache_budget_bytes", "KV cache memory budget (--kv-cache-memory)", m, registry=r
        )
        self.preemptions = Counter(
            "specmesh_preemptions",
            "Running requests sent back to wait (KV budget); recomputed on return",
            m,
            registry=r,
        ).labels(model)  # the engine's ``metrics.preemptions.inc()``
        # The prefix cache, in vLLM's terms: prompt tokens looked up and found (``kv_blocks``).
        self.prefix_queries = Counter(
            "specmesh_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", m, registry=r
        ).labels(model)
        self.prefix_hits = Counter(
            "specmesh_prefix_cache_hits", "Prompt tokens whose KV the prefix cache held", m, registry=r
        ).labels(model)
        self.kv_evictions = Counter(
            "specmesh_kv_cache_evictions", "Cached KV blocks dropped to reuse them", m, registry=r
        ).labels(model)
        # Structured outputs (``verifier_svc.grammar``).
        self.grammar_compile = Histogram(
            "specmesh_grammar_compile_seconds",
            "Grammar compile time per structured-output spec (cache misses), by kind",
            ["kind", *m],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.grammar_mask = Histogram(
            "specmesh_grammar_mask_seconds",
            "Time per engine step building grammar masks (every constrained request's root and tree nodes)",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self.grammar_pruned = Counter(
            "specmesh_grammar_pruned_nodes",
            "Draft tree nodes the request's grammar forbade, pruned before the verification forward",
            m,
            registry=r,
        ).labels(model)
        self.kv_usage = Gauge("specmesh_kv_cache_usage", "Share of the KV blocks in use by requests", m, registry=r)
        # Bound once: the engine thread's calls skip the label lookup.
        self._prompt_tokens, self._generated = self.prompt_tokens.labels(model), self.generated_tokens.labels(model)
        self._ttft, self._itl, self._e2e = self.ttft.labels(model), self.itl.labels(model), self.e2e.labels(model)
        self._queue = self.queue_time.labels(model)
        self._prompt_len, self._gen_len = self.prompt_length.labels(model), self.generation_length.labels(model)
        self._steps: dict[tuple[str, int], tuple[Histogram, Counter]] = {}
        for proposer in (*proposers, "none"):
            for speculate in ("true", "false"):
                self.decisions.labels(proposer, speculate, model)
        for proposer in proposers:
            for counter in (self.spec_steps, self.drafted, self.accepted, self.invalid_trees):
                counter.labels(proposer, model)
            for reason in FALLBACK_CATEGORIES:
                self.fallbacks.labels(proposer, reason, model)

    def learned(self, proposer: str, outcome: str) -> None:
        """One Learn call's outcome: ok, unimplemented (the tier learns nothing), error or dropped."""
        self.learn_calls.labels(proposer, outcome, self.model).inc()

    def track_queue(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Read (running, waiting) at scrape time, e.g. ``engine.counts``."""
        self.running.labels(self.model).set_function(lambda: counts()[0])
        self.waiting.labels(self.model).set_function(lambda: counts()[1])

    def track_kv_cache(
        self, allocated: Callable[[], int], budget_bytes: int | None, usage: Callable[[], float] | None = None
    ) -> None:
        """Read the KV cache's allocated bytes (and the share of blocks in use) at scrape time; the
        budget is fixed at start-up."""
        self.kv_bytes.labels(self.model).set_function(allocated)
        if usage is not None:
            self.kv_usage.labels(self.model).set_function(usage)
        if budget_bytes is not None:
            self.kv_budget.labels(self.model).set(budget_bytes)

    def request_finished(
        self,
        status: str,
        prompt_tokens: int = 0,
        ttft_s: float | None = None,
        generation_tokens: int | None = None,
        e2e_s: float | None = None,
    ) -> None:
        """Once per request: ``status`` one of REQUEST_STATUSES; generated tokens go through ``tokens``.
        A finished request also gives its lengths and end-to-end latency (``ttft_s``: for callers
        that do not report the first token as it happens, ``first_token``)."""
        self.requests.labels(status if status in REQUEST_STATUSES else "error", self.model).inc()
        if prompt_tokens:
            self._prompt_tokens.inc(prompt_tokens)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        if generation_tokens is not None:
            self._prompt_len.observe(prompt_tokens)
            self._gen_len.observe(generation_tokens)
        if e2e_s is not None:
            self._e2e.observe(e2e_s)

    def queued(self, seconds: float) -> None:
        """A request starts its prefill ``seconds`` after it arrived."""
        self._queue.observe(seconds)

    def first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def tokens(self, n: int, gap_s: float | None = None) -> None:
        """A chunk of ``n`` tokens streamed to one request, ``gap_s`` after its previous chunk (None: its first)."""
        self._generated.inc(n)
        if gap_s is not None:
            self._itl.observe(gap_s)

    def step(self, phase: str, seconds: float, tokens: int, rows: int = 1, path: str | None = None) -> None:
        """One forward: ``phase`` "prefill" | "decode"; ``tokens``: new tokens fed (padding included);
        ``rows``: requests in it (the ``batch`` label, bucketed by ``batch_class``); ``path`` (decode):
        graph | static | eager (``static_step``)."""
        if path is not None:
            self.decode_paths.labels(path, self.model).inc()
        children = self._steps.get((phase, rows))
        if children is None:
            children = self._steps[(phase, rows)] = (
                self.step_seconds.labels(phase, batch_class(rows), self.model),
                self.step_tokens.labels(phase, self.model),
            )
        children[0].observe(seconds)
        children[1].inc(tokens)
        reduced, calls = ALL_REDUCES.take()
        if calls:
            self.all_reduce_seconds.labels(phase, self.model).observe(reduced)

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
        m = self.model
        self.spec_steps.labels(proposer, m).inc(steps)
        self.drafted.labels(proposer, m).inc(drafted)
        self.accepted.labels(proposer, m).inc(accepted)
        hits, trials = list(hits), list(trials)
        for d, n in enumerate(trials):
            if n:
                self.position_tried.labels(proposer, str(d + 1), m).inc(n)
        reached = steps  # steps that accepted at least d tokens
        lengths = self.accepted_length.labels(proposer, m)
        for d, h in enumerate([*hits, 0.0]):
            if h:
                self.position_accepted.labels(proposer, str(d + 1), m).inc(h)
            for _ in range(round(reached - h)):  # steps that accepted exactly d tokens
                lengths.observe(d)
            reached = h

    def grammar_compiled(self, kind: str, seconds: float) -> None:
        self.grammar_compile.labels(kind, self.model).observe(seconds)

    def grammar_step(self, seconds: float, pruned: int) -> None:
        """One step's grammar masks (and pruning) for its constrained requests."""
        self.grammar_mask.observe(seconds)
        if pruned:
            self.grammar_pruned.inc(pruned)

    def decision(self, proposer: str, speculate: bool) -> None:
        self.decisions.labels(proposer, "true" if speculate else "false", self.model).inc()

    def invalid_tree(self, proposer: str, n: int = 1) -> None:
        if n:
            self.invalid_trees.labels(proposer, self.model).inc(n)

    def fallback(self, proposer: str, reason: str) -> None:
        self.fallbacks.labels(proposer, fallback_category(reason), self.model).inc()


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

    Workload tags are client text, possibly a tenant's name: a tag is a label value only if it is
    in ``tags`` (``--metrics-tags``); every other non-empty tag is pooled under "other" (statistics
    summed), so the series are bounded and /metrics names no tenant the operator did not list.
    Beyond ``max_series`` keys only the busiest are exported (the pooled per-proposer keys, tag "",
    always are).
    """

    def __init__(self, backend, model: str = "", max_series: int = 200, tags: Collection[str] = ()) -> None:
        self.backend, self.model, self.max_series = backend, model, max_series
        self.tags = frozenset(tags)

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
            "coverage": GaugeMetricFamily(
                "specmesh_router_coverage", "Decayed share of steps the proposer had a tree for", labels=labels
            ),
        }
        pooled: dict[tuple[str, str, str], Any] = {}  # AcceptanceStats by label values
        for key, stats in self.backend.snapshot().items():
            if self.model and key.model != self.model:
                continue
            label = (key.model, key.proposer, bounded_tag(key.workload_tag, self.tags))
            pooled[label] = stats if label not in pooled else pooled[label] + stats
        rows = sorted(pooled.items(), key=lambda ks: (ks[0][2] != "", -ks[1].steps))
        for values, stats in rows[: self.max_series]:
            for name, family in families.items():
                family.add_metric(list(values), getattr(stats, name))
        yield from families.values()
        status = self.backend.status()
        up = GaugeMetricFamily(
            "specmesh_router_stats_connected",
            "1 when the statistics backend is reachable",
            labels=["backend", "model"],
        )
        up.add_metric([status.backend, self.model], 1.0 if status.connected else 0.0)
        yield up


@dataclass
class MetricsServer:
    port: int
    _server: object
    _thread: object

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def metrics_host(address: str, override: str = "") -> str:
    """Where /metrics listens: ``override`` (``--metrics-address``) if set, else the host of the
    service's own ``--address``, so a service bound to loopback does not export on every interface.

    >>> metrics_host("127.0.0.1:50051"), metrics_host("0.0.0.0:50051"), metrics_host("[::1]:50051")
    ('127.0.0.1', '0.0.0.0', '::1')
    >>> metrics_host("127.0.0.1:50051", "0.0.0.0"), metrics_host(":50051")
    ('0.0.0.0', '0.0.0.0')
    """
    if override:
        return override.strip("[]")
    host = address.rpartition(":")[0].strip("[]")
    return host or "0.0.0.0"


def start_metrics_server(
    port: int, addr: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY
) -> MetricsServer | None:
    """Serve ``registry`` on http://addr:port/metrics in a daemon thread; port 0 = metrics off (None).
    ``addr``: the interface (``metrics_host``), an IPv4 or IPv6 address or a host name."""
    if port <= 0:
        return None
    server, thread = start_http_server(port, addr=addr, registry=registry)
    return MetricsServer(server.server_port, server, thread)
