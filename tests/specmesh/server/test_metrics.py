"""The Prometheus exporter: events in, counters out over a real HTTP GET on loopback."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client import CollectorRegistry

from specmesh.deploy import free_port
from specmesh.server.metrics import ProposerMetrics, RouterStatsCollector, VerifierMetrics, start_metrics_server
from specmesh_router.stats import AcceptanceStats, InProcessStats, StatsConfig, StatsKey


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one series in an exposition text (exact label set)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name:
            got = ",".join(sorted((m.group(2) or "").split(","))) if m.group(2) else ""
            if got == want:
                return float(m.group(3))
    raise AssertionError(f"no series {name}{{{want}}} in:\n{text}")


def test_metrics_endpoint_serves_the_counters_fed_by_events():
    registry = CollectorRegistry()
    verifier = VerifierMetrics(registry)
    proposer = ProposerMetrics("ngram", registry)
    stats = InProcessStats(StatsConfig(), clock=lambda: 1000.0)  # frozen: exact values
    registry.register(RouterStatsCollector(stats, model="m"))

    steps = [AcceptanceStats.of_step(8, a, rejected=a < 8) for a in (0, 2, 2, 8)]
    total = steps[0] + steps[1] + steps[2] + steps[3]
    verifier.speculation("ngram", total.steps, total.drafted, total.accepted, total.hits, total.trials)
    stats.record(StatsKey("m", "ngram", "code"), total)
    verifier.request_finished("ok", prompt_tokens=40, ttft_s=0.2)
    verifier.request_finished("rejected")
    verifier.tokens(17)
    verifier.step("decode", 0.07, tokens=9)
    verifier.decision("ngram", True)
    verifier.decision("ngram", False)
    verifier.invalid_tree("draft", 2)
    verifier.fallback("draft", "proposer 'draft' sent no tree for 2.0 s")
    verifier.track_queue(lambda: (3, 5))
    proposer.session_started()
    proposer.proposal(nodes=12, seconds=0.0004)

    port = free_port()
    server = start_metrics_server(port, addr="127.0.0.1", registry=registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
    finally:
        server.close()

    assert sample(text, "specmesh_drafted_tokens_total", proposer="ngram") == 32
    assert sample(text, "specmesh_accepted_tokens_total", proposer="ngram") == 12
    assert sample(text, "specmesh_speculation_steps_total", proposer="ngram") == 4
    assert sample(text, "specmesh_position_accepted_total", proposer="ngram", position="1") == 3
    assert sample(text, "specmesh_position_accepted_total", proposer="ngram", position="3") == 1
    assert sample(text, "specmesh_position_tried_total", proposer="ngram", position="3") == 3
    # accepted lengths 0, 2, 2, 8 per step
    assert sample(text, "specmesh_accepted_length_bucket", proposer="ngram", le="0.0") == 1
    assert sample(text, "specmesh_accepted_length_bucket", proposer="ngram", le="2.0") == 3
    assert sample(text, "specmesh_accepted_length_sum", proposer="ngram") == 12
    assert sample(text, "specmesh_requests_total", status="ok") == 1
    assert sample(text, "specmesh_requests_total", status="rejected") == 1
    assert sample(text, "specmesh_generated_tokens_total") == 17
    assert sample(text, "specmesh_prompt_tokens_total") == 40
    assert sample(text, "specmesh_step_seconds_count", phase="decode") == 1
    assert sample(text, "specmesh_router_decisions_total", proposer="ngram", speculate="true") == 1
    assert sample(text, "specmesh_invalid_trees_total", proposer="draft") == 2
    assert sample(text, "specmesh_proposer_fallbacks_total", proposer="draft", reason="timeout") == 1
    assert sample(text, "specmesh_running_requests") == 3 and sample(text, "specmesh_waiting_requests") == 5
    assert sample(text, "specmesh_proposals_total", proposer="ngram") == 1
    assert sample(text, "specmesh_proposer_open_sessions", proposer="ngram") == 1
    assert sample(text, "specmesh_router_accepted_per_step", model="m", proposer="ngram", workload_tag="code") == 3
    assert sample(text, "specmesh_router_stats_connected", backend="in-process") == 1


def test_port_zero_turns_the_metrics_server_off():
    assert start_metrics_server(0) is None
