"""guidellm (``guidellm run``) against the gateway, as a user would benchmark it: a real verifier and
gateway on loopback, synthetic prompts made with the local model folder's tokenizer, a short
concurrent profile, offline. No request may fail, and guidellm's time to first token and
inter-token latency must agree with the gateway's own ``/metrics`` histograms over the same requests.

Run as a record (prints both sides): ``python -m pytest tests/specmesh_bench/test_guidellm.py -s -m slow``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
from support import start_gateway, start_verifier, stop_process, stop_verifier

pytestmark = pytest.mark.slow

TTFT = "specmesh_gateway_time_to_first_token_seconds"
ITL = "specmesh_gateway_inter_token_seconds"
REQUESTS, STREAMS, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 2, 64, 32


def histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets [(le, count)], sum, count) of an unlabelled histogram in Prometheus text.

    >>> text = 'h_bucket{le="0.1"} 1.0\\nh_bucket{le="0.5"} 3.0\\nh_bucket{le="+Inf"} 4.0\\nh_sum 1.9\\nh_count 4.0'
    >>> histogram(text, "h")
    ([(0.1, 1.0), (0.5, 3.0), (inf, 4.0)], 1.9, 4.0)
    """
    buckets = [(float(le), float(n)) for le, n in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)]
    total = float(re.search(rf"^{name}_sum (\S+)$", text, re.M).group(1))
    count = float(re.search(rf"^{name}_count (\S+)$", text, re.M).group(1))
    return sorted(buckets), total, count


def delta(after: tuple, before: tuple) -> tuple:
    """The observations between two snapshots of one histogram.

    >>> delta(([(0.1, 3.0), (float("inf"), 5.0)], 2.0, 5.0), ([(0.1, 1.0), (float("inf"), 1.0)], 0.5, 1.0))
    ([(0.1, 2.0), (inf, 4.0)], 1.5, 4.0)
    """
    return (
        [(le, n - m) for (le, n), (_, m) in zip(after[0], before[0], strict=True)],
        after[1] - before[1],
        after[2] - before[2],
    )


def quantile(buckets: list[tuple[float, float]], q: float) -> tuple[float, float, float]:
    """Prometheus' histogram_quantile (linear within the bucket) and that bucket's bounds.

    >>> quantile([(0.1, 2.0), (0.5, 6.0), (float("inf"), 6.0)], 0.5)
    (0.2, 0.1, 0.5)
    """
    total = buckets[-1][1]
    rank, lower, below = q * total, 0.0, 0.0
    for le, n in buckets:
        if n >= rank and n > below:
            upper = le if le != float("inf") else lower
            return lower + (upper - lower) * (rank - below) / (n - below), lower, upper
        lower, below = le, n
    raise ValueError("empty histogram")


def gateway_metrics(url: str) -> str:
    return urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, lm):
    v = start_verifier(tmp_path_factory.mktemp("verifier"))
    g = start_gateway(tmp_path_factory.mktemp("gateway"), v.address)
    yield g
    stop_process(g.proc)
    stop_verifier(v)


@pytest.fixture(scope="module")
def run(tmp_path_factory, gateway, lm):
    """guidellm's report and the gateway's histograms (TTFT, ITL) over its requests."""
    from specmesh_server.model_loading import resolve_model_path

    tmp = tmp_path_factory.mktemp("guidellm")
    model = json.load(urllib.request.urlopen(gateway.url + "/models", timeout=10))["data"][0]["id"]
    report = tmp / "report.json"
    scenario = {
        "spec": {
            # guidellm's own request body: stream_options include_usage and continuous_usage_stats (vLLM's
            # usage on every chunk), which it reads the token counts from
            "backend": {"kind": "openai_http", "target": gateway.url.removesuffix("/v1"), "model": model,
                        "request_format": "/v1/completions", "timeout": 120},
            "profile": {"kind": "concurrent", "streams": [STREAMS]},
            "constraints": [{"kind": "max_requests", "count": REQUESTS}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(resolve_model_path(None))},
            "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }  # fmt: skip
    (tmp / "scenario.json").write_text(json.dumps(scenario))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": "1", "GUIDELLM__DEFAULT_RESULTS_DIR": str(tmp)}  # fmt: skip
    before = gateway_metrics(gateway.url)
    cmd = [sys.executable, "-m", "guidellm", "run", "--scenario", str(tmp / "scenario.json"), "--disable-progress"]
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=300, env=env)
    after = gateway_metrics(gateway.url)
    assert proc.returncode == 0 and report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    side = {name: delta(histogram(after, name), histogram(before, name)) for name in (TTFT, ITL)}
    return json.loads(report.read_text()), side, proc.stdout


def _benchmark(report: dict) -> dict:
    [bench] = report["benchmarks"]
    return bench


def test_every_request_completes_without_an_error(run):
    report, side, _ = run
    totals = _benchmark(report)["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (REQUESTS, 0, 0), totals
    assert side[TTFT][2] == REQUESTS, "the gateway saw exactly guidellm's requests"
    tokens = _benchmark(report)["metrics"]["output_token_count"]["successful"]
    assert tokens["min"] == tokens["max"] == OUTPUT_TOKENS, "ignore_eos: every request its full output"


def _latency(report: dict, name: str) -> dict:
    return _benchmark(report)["metrics"][name]["successful"]


def test_guidellms_ttft_and_itl_agree_with_the_gateways_histograms(run):
    """Means agree closely: the gateway's _sum/_count against guidellm's mean over requests (the same
    requests, each of the same number of tokens, so the same weighting), within 15 % plus 50 ms (TTFT:
    guidellm times from its own send, the gateway from the request's arrival) or 5 ms (ITL). Medians
    are held looser: the histogram places its median no finer than a bucket, and the two are not the
    same statistic for ITL (guidellm's is the median over requests of each request's mean gap, the
    gateway's the median of every gap), so guidellm's median must fall in the bucket holding the
    gateway's histogram median, widened by 20 % on each side (plus the same slack)."""
    report, side, stdout = run
    figures = []
    for name, metric, slack_ms in ((TTFT, "time_to_first_token_ms", 50.0), (ITL, "inter_token_latency_ms", 5.0)):
        buckets, total, count = side[name]
        mean_ms, (p50, lower, upper) = 1e3 * total / count, quantile(buckets, 0.5)
        ours = _latency(report, metric)
        figures.append((metric, ours["mean"], mean_ms, ours["median"], 1e3 * p50, 1e3 * lower, 1e3 * upper))
        assert abs(ours["mean"] - mean_ms) <= 0.15 * mean_ms + slack_ms, figures[-1]
        assert 0.8 * 1e3 * lower - slack_ms <= ours["median"] <= 1.2 * 1e3 * upper + slack_ms, figures[-1]
    print("\n| metric | guidellm mean | gateway mean | guidellm median | gateway p50 (its bucket) |")
    print("|---|---|---|---|---|")
    for metric, gm, sm, gmed, sp50, lo, hi in figures:
        print(f"| {metric} | {gm:.1f} | {sm:.1f} | {gmed:.1f} | {sp50:.1f} ({lo:g}–{hi:g}) |")
    for name in (TTFT, ITL):  # the gateway's histograms over guidellm's requests: (le, cumulative count)
        buckets, total, count = side[name]
        print(f"{name}: count {count:g}, sum {total:.3f} s, buckets " + ", ".join(f"{le:g}:{n:g}" for le, n in buckets))
    print(stdout)
