"""The shipped Grafana dashboard and Prometheus alert rules (k8s/components/monitoring) are true.

Every PromQL expression in them parses (``promql_parser``, Prometheus' grammar) and names only
metrics, and matches or groups only by labels, that live services export: a real n-gram proposer,
suffix proposer, verifier and gateway run a few short greedy requests on loopback and their
``/metrics`` are scraped. The same services show that the latency histograms move, that a client's workload tag
reaches ``/metrics`` only when allow-listed (``--metrics-tags``), and that ``/metrics`` binds the
service's own host unless ``--metrics-address`` says otherwise.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from support import start_gateway, start_verifier, stop_process, stop_verifier

ROOT = Path(__file__).resolve().parents[2]
COMPONENT = ROOT / "k8s" / "components" / "monitoring"
DASHBOARD = COMPONENT / "dashboards" / "specmesh.json"
RULES = COMPONENT / "prometheusrule.yaml"
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$namespace": ".*", "$model": ".*"}
# Labels Prometheus adds to every scraped series (the ServiceMonitor's targets), besides the exporter's.
TARGET_LABELS = {"namespace", "pod", "service", "endpoint", "instance", "job", "container"}
LATENCY_HISTOGRAMS = (
    "specmesh_time_to_first_token_seconds",
    "specmesh_inter_token_latency_seconds",
    "specmesh_e2e_request_latency_seconds",
    "specmesh_request_queue_time_seconds",
    "specmesh_request_prompt_tokens",
    "specmesh_request_generation_tokens",
    "specmesh_step_seconds",
)
ALLOWED_TAG, SECRET_TAG = "team-a", "tenant-acme-secret"
COPY_PROMPT = "Copy this list exactly: " + ", ".join(str(i) for i in range(40, 70))


# ---- the queries ----------------------------------------------------------------------------------


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every variable's ``label_values`` selector."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
            assert m, f"variable {var['name']}: {var['definition']}"
            out.append((f"variable {var['name']}", m.group(1)))
    return out


def rule_queries() -> list[tuple[str, str]]:
    rule = yaml.safe_load(RULES.read_text())
    return [(f"alert {r['alert']}", r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"]]


def all_queries() -> list[tuple[str, str]]:
    return dashboard_queries() + rule_queries()


def substituted(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


@dataclass
class Use:
    """What one query asks of the exporters."""

    metrics: set[str]
    matched: dict[str, set[str]]  # metric → label names its selectors match on
    grouped: list[tuple[set[str], set[str]]]  # (by-labels of an aggregation, the metrics under it)


def uses(expr: str) -> Use:
    import promql_parser as pp

    use = Use(set(), {}, [])

    def selectors(node) -> set[str]:
        found: set[str] = set()

        def visit(n, *_):
            if isinstance(n, pp.VectorSelector) and n.name:
                found.add(n.name)

        pp.walk(node, visit)
        return found

    def visit(node, *_):
        if isinstance(node, pp.VectorSelector):
            assert node.name, f"a selector without a metric name: {expr}"
            use.metrics.add(node.name)
            names = {m.name for m in (node.matchers.matchers if node.matchers else [])}
            use.matched.setdefault(node.name, set()).update(names - {"__name__"})
        elif isinstance(node, pp.AggregateExpr) and node.modifier and node.modifier.type == pp.AggModifierType.By:
            use.grouped.append((set(node.modifier.labels), selectors(node.expr)))

    pp.walk(pp.parse(substituted(expr)), visit)
    return use


def test_the_dashboard_and_the_rules_cover_what_operators_watch():
    board = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in board["panels"])
    for words in ("throughput", "time to first token", "inter-token", "end-to-end", "acceptance rate",
                  "draft position", "fallbacks", "queue", "router decisions", "kv cache", "preemptions"):  # fmt: skip
        assert words in titles, f"no panel about {words}"
    names = {where.removeprefix("alert ") for where, _ in rule_queries()}
    assert {
        "SpecMeshAcceptanceCollapse",
        "SpecMeshProposerFallbackSpike",
        "SpecMeshQueueGrowing",
        "SpecMeshRedisDisconnected",
        "SpecMeshKVPreemptionStorm",
    } <= names
    exprs = " ".join(expr for _, expr in all_queries())
    for q in ("0.5", "0.95", "0.99"):
        for h in ("specmesh_time_to_first_token_seconds", "specmesh_inter_token_latency_seconds"):
            assert f"histogram_quantile({q}, sum by (le) (rate({h}_bucket" in exprs, (q, h)


def test_every_query_parses_as_promql():
    import promql_parser

    failures = []
    for where, expr in all_queries():
        try:
            promql_parser.parse(substituted(expr))
        except ValueError as exc:
            failures.append(f"{where}: {exc}\n  {expr}")
    assert not failures, "\n".join(failures)
    with pytest.raises(ValueError):  # the parser is strict: an unknown function or a typo fails
        promql_parser.parse("histogram_quantil(0.5, sum by (le) (rate(x_bucket[5m])))")


def test_every_rule_is_an_alert_with_a_duration_severity_and_summary():
    rule = yaml.safe_load(RULES.read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r.get("alert")
            assert re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
            assert r["labels"]["severity"] in {"warning", "critical"}, r["alert"]
            assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


# ---- live services --------------------------------------------------------------------------------


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def samples(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name (``x_total``, ``x_bucket`` …) → the label sets of its samples."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(dict(s.labels))
    return out


def histogram_count(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == f"{name}_count")


def can_bind(host: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


def non_loopback_ip() -> str | None:
    """An IPv4 address of this machine other than loopback, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the interface a route would use
            ip = s.getsockname()[0]
        except OSError:
            ip = ""
    if not ip or ip.startswith("127.") or ip == "0.0.0.0":
        try:
            ips = socket.gethostbyname_ex(socket.gethostname())[2]
        except OSError:
            ips = []
        ip = next((a for a in ips if not a.startswith("127.")), "")
    return ip or None


def refuses(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return False
    except OSError:
        return True


@dataclass
class Live:
    verifier_metrics: str  # http://host:port/metrics
    ngram_metrics: str
    suffix_metrics: str
    gateway_metrics: str
    metrics_port: int
    ngram_metrics_host: str
    ngram_metrics_port: int
    before: str  # the verifier's /metrics before the requests
    verifier: str = ""
    gateway: str = ""
    ngram: str = ""
    suffix: str = ""


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    import httpx

    from specmesh import Client, SamplingParams, SpecDecodeParams
    from specmesh.deploy import free_port, wait_healthy

    tmp = tmp_path_factory.mktemp("monitoring")
    # The n-gram service's /metrics on another loopback address than its gRPC port (--metrics-address).
    ngram_host = "127.0.0.2" if sys.platform.startswith("linux") and can_bind("127.0.0.2") else "127.0.0.1"
    ngram_address, ngram_port = f"127.0.0.1:{free_port()}", free_port()
    cmd = [sys.executable, "-m", "specmesh", "serve", "ngram", "--address", ngram_address,
           "--metrics-port", str(ngram_port), "--metrics-address", ngram_host]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with (tmp / "ngram.log").open("wb") as log:
        ngram = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    # The suffix proposer (its own metrics: cache size, trees by source); no model, no Redis.
    suffix_address, suffix_port = f"127.0.0.1:{free_port()}", free_port()
    cmd = [sys.executable, "-m", "specmesh", "serve", "suffix", "--address", suffix_address,
           "--metrics-port", str(suffix_port)]  # fmt: skip
    with (tmp / "suffix.log").open("wb") as log:
        suffix = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    verifier = gateway = None
    try:
        wait_healthy(ngram_address, 60, ngram)
        wait_healthy(suffix_address, 120, suffix)  # numba compiles its kernels on a first start
        port = free_port()
        verifier = start_verifier(
            tmp,
            "--proposer", "ngram=inprocess:ngram",
            "--proposer", f"remote={ngram_address}",
            "--proposer", f"suffix={suffix_address}",
            "--spec-gating", "always",  # verify every tree (and skip the start-up step profiling)
            "--metrics-port", str(port),
            "--metrics-tags", f"{ALLOWED_TAG},team-b",
        )  # fmt: skip
        gateway = start_gateway(tmp, verifier.address)
        url = f"http://127.0.0.1:{port}/metrics"
        before = scrape(url)
        greedy = SamplingParams(temperature=0.0, max_tokens=16)
        with Client(verifier.address) as client:
            for proposer, tag in (("ngram", ALLOWED_TAG), ("remote", SECRET_TAG), ("suffix", ALLOWED_TAG)):
                client.complete(COPY_PROMPT, greedy, SpecDecodeParams(proposer=proposer, workload_tag=tag), chat=True)
        body = {
            "model": httpx.get(f"{gateway.url}/models", timeout=30).json()["data"][0]["id"],
            "messages": [{"role": "user", "content": COPY_PROMPT}],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "spec_decode": {"proposer": "ngram", "workload_tag": SECRET_TAG},
        }
        with httpx.stream("POST", f"{gateway.url}/chat/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            assert "data: [DONE]" in list(resp.iter_lines())
        # The last step's counts are recorded just after its tokens are sent: wait for all four.
        deadline = time.time() + 10
        while histogram_count(scrape(url), "specmesh_e2e_request_latency_seconds") < 4:
            assert time.time() < deadline, "the verifier did not count its 4 requests"
            time.sleep(0.05)
        live = Live(
            verifier_metrics=url,
            ngram_metrics=f"http://{ngram_host}:{ngram_port}/metrics",
            suffix_metrics=f"http://127.0.0.1:{suffix_port}/metrics",
            gateway_metrics=gateway.url.removesuffix("/v1") + "/metrics",
            metrics_port=port,
            ngram_metrics_host=ngram_host,
            ngram_metrics_port=ngram_port,
            before=before,
        )
        live.verifier, live.gateway, live.ngram, live.suffix = (
            scrape(live.verifier_metrics),
            scrape(live.gateway_metrics),
            scrape(live.ngram_metrics),
            scrape(live.suffix_metrics),
        )
        yield live
    finally:
        if gateway is not None:
            stop_process(gateway.proc)
        if verifier is not None:
            stop_verifier(verifier)
        stop_process(ngram)
        stop_process(suffix)


@pytest.mark.slow
def test_every_metric_and_label_a_query_uses_is_exported_by_the_live_services(live):
    exported: dict[str, list[dict[str, str]]] = {}
    for text in (live.verifier, live.gateway, live.ngram, live.suffix):
        for name, label_sets in samples(text).items():
            exported.setdefault(name, []).extend(label_sets)
    labels = {name: set().union(*(set(s) for s in sets)) for name, sets in exported.items()}
    failures = []
    for where, expr in all_queries():
        use = uses(expr)
        for metric in sorted(use.metrics - set(exported)):
            failures.append(f"{where}: {metric} is not exported")
        for metric, names in use.matched.items():
            if metric in labels and (unknown := names - labels[metric] - TARGET_LABELS):
                failures.append(f"{where}: {metric} has no label {', '.join(sorted(unknown))}")
        for by, metrics in use.grouped:
            known = set().union(*(labels.get(m, set()) for m in metrics)) | TARGET_LABELS
            if unknown := by - known:
                failures.append(f"{where}: grouped by {', '.join(sorted(unknown))}, which {sorted(metrics)} lack")
    assert not failures, "\n".join(failures)
    # The verifier's own series all carry the served model's name.
    for name, sets in samples(live.verifier).items():
        if name.startswith("specmesh_"):
            assert all(s.get("model") for s in sets), f"{name} without a model label"


@pytest.mark.slow
def test_latency_histograms_move_when_requests_run(live):
    for name in LATENCY_HISTOGRAMS:
        grew = histogram_count(live.verifier, name) - histogram_count(live.before, name)
        assert grew >= (3 if name != "specmesh_inter_token_latency_seconds" else 1), (name, grew)
    # Several chunks per request: the inter-token histogram has more observations than requests.
    assert histogram_count(live.verifier, "specmesh_inter_token_latency_seconds") > 3
    decode = [s for s in samples(live.verifier)["specmesh_step_seconds_count"] if s["phase"] == "decode"]
    assert decode and all(s["batch"] in {"1", "2", "3-4", "5-8", "9-16", "17-32", "33+"} for s in decode)
    for name in ("specmesh_gateway_time_to_first_token_seconds", "specmesh_gateway_request_seconds"):
        assert histogram_count(live.gateway, name) >= 1, name
    assert histogram_count(live.ngram, "specmesh_proposal_seconds") >= 1
    assert histogram_count(live.suffix, "specmesh_proposal_seconds") >= 1


@pytest.mark.slow
def test_a_workload_tag_reaches_metrics_only_when_allow_listed(live):
    tags = {s.get("workload_tag") for sets in samples(live.verifier).values() for s in sets} - {None}
    assert ALLOWED_TAG in tags and "other" in tags  # the secret tag's statistics, pooled
    assert tags <= {"", ALLOWED_TAG, "team-b", "other"}
    for text in (live.verifier, live.gateway, live.ngram, live.suffix):
        assert SECRET_TAG not in text and "acme" not in text


@pytest.mark.slow
def test_metrics_bind_the_service_host_unless_metrics_address_says_otherwise(live):
    assert "specmesh_requests_total" in scrape(f"http://127.0.0.1:{live.metrics_port}/metrics")
    skipped = []
    ip = non_loopback_ip()
    if ip is not None and can_bind(ip):  # the verifier listens on 127.0.0.1: not on the machine's network
        assert refuses(ip, live.metrics_port), f"the verifier's /metrics answers on {ip}"
    else:
        skipped.append("this machine has no non-loopback address to check the verifier's bind against")
    if live.ngram_metrics_host != "127.0.0.1":
        # The n-gram proposer listens on 127.0.0.1 with --metrics-address 127.0.0.2: /metrics there only.
        assert refuses("127.0.0.1", live.ngram_metrics_port)
        assert "specmesh_proposals_total" in live.ngram
    else:
        skipped.append("cannot bind 127.0.0.2 here: --metrics-address is not checked")
    if skipped:
        pytest.skip("; ".join(skipped))
