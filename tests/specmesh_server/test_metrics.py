"""The Prometheus exporter: events in, counters out over a real HTTP GET on loopback."""

from __future__ import annotations

import re
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest

from specmesh.deploy import free_port
from specmesh_router.stats import AcceptanceStats, InProcessStats, StatsConfig, StatsKey
from specmesh_server.metrics import ProposerMetrics, RouterStatsCollector, VerifierMetrics, start_metrics_server
from verifier_svc.speculation import silent_reason


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
    verifier = VerifierMetrics(registry, model="m")
    proposer = ProposerMetrics("ngram", registry)
    stats = InProcessStats(StatsConfig(), clock=lambda: 1000.0)  # frozen: exact values
    registry.register(RouterStatsCollector(stats, model="m", tags={"code"}))

    steps = [AcceptanceStats.of_step(8, a, rejected=a < 8) for a in (0, 2, 2, 8)]
    total = steps[0] + steps[1] + steps[2] + steps[3]
    verifier.speculation("ngram", total.steps, total.drafted, total.accepted, total.hits, total.trials)
    stats.record(StatsKey("m", "ngram", "code"), total)
    verifier.request_finished("ok", prompt_tokens=40, ttft_s=0.2)
    verifier.request_finished("rejected")
    verifier.tokens(17)
    verifier.step("decode", 0.07, tokens=9, rows=3)
    verifier.step("decode", 0.01, tokens=8, rows=1, path="graph")
    verifier.step("decode", 0.01, tokens=8, rows=1, path="graph")
    verifier.step("decode", 0.02, tokens=70, rows=1, path="eager")
    verifier.queued(0.01)
    verifier.first_token(0.2)
    verifier.tokens(2, gap_s=0.05)
    verifier.request_finished("ok", prompt_tokens=40, generation_tokens=19, e2e_s=1.5)
    verifier.decision("ngram", True)
    verifier.decision("ngram", False)
    verifier.invalid_tree("draft", 2)
    verifier.fallback("draft", silent_reason("draft", 2.0))  # the speculation control's own words
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

    assert sample(text, "specmesh_drafted_tokens_total", proposer="ngram", model="m") == 32
    assert sample(text, "specmesh_accepted_tokens_total", proposer="ngram", model="m") == 12
    assert sample(text, "specmesh_speculation_steps_total", proposer="ngram", model="m") == 4
    assert sample(text, "specmesh_position_accepted_total", proposer="ngram", position="1", model="m") == 3
    assert sample(text, "specmesh_position_accepted_total", proposer="ngram", position="3", model="m") == 1
    assert sample(text, "specmesh_position_tried_total", proposer="ngram", position="3", model="m") == 3
    # accepted lengths 0, 2, 2, 8 per step
    assert sample(text, "specmesh_accepted_length_bucket", proposer="ngram", le="0.0", model="m") == 1
    assert sample(text, "specmesh_accepted_length_bucket", proposer="ngram", le="2.0", model="m") == 3
    assert sample(text, "specmesh_accepted_length_sum", proposer="ngram", model="m") == 12
    assert sample(text, "specmesh_requests_total", status="ok", model="m") == 2
    assert sample(text, "specmesh_requests_total", status="rejected", model="m") == 1
    assert sample(text, "specmesh_generated_tokens_total", model="m") == 19
    assert sample(text, "specmesh_prompt_tokens_total", model="m") == 80
    assert sample(text, "specmesh_step_seconds_count", phase="decode", batch="3-4", model="m") == 1
    assert sample(text, "specmesh_step_tokens_total", phase="decode", model="m") == 95
    assert sample(text, "specmesh_decode_steps_total", path="graph", model="m") == 2  # replayed CUDA graphs
    assert sample(text, "specmesh_decode_steps_total", path="eager", model="m") == 1
    # latency histograms: TTFT from both paths, one inter-chunk gap (the first chunk has none)
    assert sample(text, "specmesh_time_to_first_token_seconds_count", model="m") == 2
    assert sample(text, "specmesh_inter_token_latency_seconds_count", model="m") == 1
    assert sample(text, "specmesh_inter_token_latency_seconds_bucket", le="0.05", model="m") == 1
    assert sample(text, "specmesh_e2e_request_latency_seconds_sum", model="m") == 1.5
    assert sample(text, "specmesh_request_queue_time_seconds_count", model="m") == 1
    assert sample(text, "specmesh_request_prompt_tokens_sum", model="m") == 40
    assert sample(text, "specmesh_request_generation_tokens_bucket", le="16.0", model="m") == 0
    assert sample(text, "specmesh_request_generation_tokens_bucket", le="32.0", model="m") == 1
    assert sample(text, "specmesh_router_decisions_total", proposer="ngram", speculate="true", model="m") == 1
    assert sample(text, "specmesh_invalid_trees_total", proposer="draft", model="m") == 2
    assert sample(text, "specmesh_proposer_fallbacks_total", proposer="draft", reason="timeout", model="m") == 1
    assert sample(text, "specmesh_running_requests", model="m") == 3
    assert sample(text, "specmesh_waiting_requests", model="m") == 5
    assert sample(text, "specmesh_proposals_total", proposer="ngram") == 1
    assert sample(text, "specmesh_proposer_open_sessions", proposer="ngram") == 1
    assert sample(text, "specmesh_router_accepted_per_step", model="m", proposer="ngram", workload_tag="code") == 3
    assert sample(text, "specmesh_router_stats_connected", backend="in-process", model="m") == 1


def test_port_zero_turns_the_metrics_server_off():
    assert start_metrics_server(0) is None


def test_only_allow_listed_workload_tags_become_labels_the_rest_pool_as_other():
    registry = CollectorRegistry()
    stats = InProcessStats(StatsConfig(), clock=lambda: 1000.0)
    registry.register(RouterStatsCollector(stats, model="m", tags={"code"}))
    step = AcceptanceStats.of_step(4, 2, rejected=True)  # 2 of 4 accepted
    full = AcceptanceStats.of_step(4, 4, rejected=False)
    stats.record(StatsKey("m", "ngram", "code"), step)
    stats.record(StatsKey("m", "ngram", ""), step + full)
    stats.record(StatsKey("m", "ngram", "tenant-acme-secret"), step)
    stats.record(StatsKey("m", "ngram", "tenant-globex"), full)
    text = generate_latest(registry).decode()
    assert "tenant" not in text
    assert sample(text, "specmesh_router_steps", model="m", proposer="ngram", workload_tag="code") == 1
    assert sample(text, "specmesh_router_steps", model="m", proposer="ngram", workload_tag="") == 2
    # the two unlisted tags: one series, their statistics summed
    assert sample(text, "specmesh_router_steps", model="m", proposer="ngram", workload_tag="other") == 2
    assert sample(text, "specmesh_router_accepted_per_step", model="m", proposer="ngram", workload_tag="other") == 3
    tags = {line.split('workload_tag="')[1].split('"')[0] for line in text.splitlines() if "workload_tag=" in line}
    assert tags == {"", "code", "other"}
