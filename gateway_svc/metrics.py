"""Prometheus metrics of the gateway (``GET /metrics`` on its HTTP port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specmesh_server.metrics import ITL_BUCKETS, REGISTRY, TTFT_BUCKETS

# TTFT and inter-token buckets are the verifier's (ms on a GPU to s on a CPU): the tiers' percentiles compare.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        r = registry
        self.requests = Counter(
            "specmesh_gateway_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.in_flight = Gauge("specmesh_gateway_in_flight", "Generation requests in progress", registry=r)
        self.latency = Histogram(
            "specmesh_gateway_request_seconds",
            "Arrival to last byte of a generation request",
            ["endpoint", "stream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "specmesh_gateway_time_to_first_token_seconds",
            "Arrival to the first token, as the client sees it",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "specmesh_gateway_inter_token_seconds",
            "Time between tokens of a stream (a chunk of n tokens gives n gaps of its delay / n)",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("specmesh_gateway_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter(
            "specmesh_gateway_completion_tokens", "Completion tokens of finished requests", registry=r
        )
        self.drafted = Counter("specmesh_gateway_draft_tokens", "Drafted tokens of finished requests", registry=r)
        self.accepted = Counter(
            "specmesh_gateway_accepted_draft_tokens", "Accepted drafted tokens of finished requests", registry=r
        )
        self.disconnects = Counter(
            "specmesh_gateway_client_disconnects", "Streams the client left before the end", registry=r
        )

    def tokens_between(self, gap_s: float, n: int) -> None:
        for _ in range(n):
            self.itl.observe(gap_s / n)
