"""Several replicas on one machine, as Kubernetes runs them: 2 verifiers and 2 n-gram proposers as
separate processes on loopback, one throwaway Redis shared by both verifiers' routers.

The verifiers reach the proposer tier through one gRPC target listing both replicas with the
round_robin policy (what a headless Service's DNS gives them in a cluster).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from support import assert_greedy_equal, start_redis, start_verifier, stop_verifier, workload_prompts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary"),
]
PREFIX = "specmesh-replicas-test"


@dataclass
class Proc:
    address: str
    proc: subprocess.Popen
    metrics_port: int = 0


def start_ngram(tmp_path, address: str = "", metrics: int = 0) -> Proc:
    """An n-gram replica on fresh ports, or on ``address`` / ``metrics`` (a replica coming back)."""
    from specmesh.deploy import free_port, wait_healthy

    address, metrics = address or f"127.0.0.1:{free_port()}", metrics or free_port()
    log = (tmp_path / f"ngram-{address.rsplit(':', 1)[1]}.log").open("wb")
    cmd = [sys.executable, "-m", "specmesh", "serve", "ngram", "--address", address, "--metrics-port", str(metrics)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_healthy(address, 60, proc)
    return Proc(address, proc, metrics)


def metric(port: int, name: str, **labels: str) -> float:
    """A sample's value from a service's /metrics (0 when absent)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels else "")) and (not labels or want in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, lm) -> Iterator[dict]:
    from specmesh.deploy import free_port

    tmp = tmp_path_factory.mktemp("replicas")
    redis_port = free_port()
    redis_proc = start_redis(redis_port)
    ngrams = [start_ngram(tmp), start_ngram(tmp)]
    target = "ipv4:" + ",".join(n.address for n in ngrams)
    verifiers, ports = [], []
    for _ in range(2):
        ports.append(free_port())
        verifiers.append(
            start_verifier(
                tmp,
                "--proposer", f"ngram={target}",
                "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
                "--stats-prefix", PREFIX,
                "--metrics-port", str(ports[-1]),
            )
        )  # fmt: skip
    state = {
        "redis": redis_proc, "redis_port": redis_port, "ngrams": ngrams, "verifiers": verifiers, "metrics": ports,
        "tmp": tmp,
    }  # fmt: skip
    yield state
    for v in verifiers:
        stop_verifier(v)
    for n in ngrams:
        if n.proc.poll() is None:
            n.proc.kill()
    state["redis"].kill()  # the one running now (a test restarts it)


def _complete(address: str, ids: list[int], max_tokens: int = 32):
    from specmesh import Client, SamplingParams, SpecDecodeParams

    with Client(address) as client:
        return client.complete(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), SpecDecodeParams("ngram"))


def test_32_requests_spread_over_two_verifiers_are_greedy_identical_and_both_proposer_replicas_serve(
    cluster, lm, chat_ids, hf_greedy
):
    prompts = [chat_ids(p) for p in workload_prompts(per_category=2, max_chars=400)]
    work = [(cluster["verifiers"][i % 2].address, prompts[i % len(prompts)]) for i in range(32)]
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda w: _complete(*w), work))
    for (_, ids), out in zip(work, outs, strict=True):
        assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, 32))
    sessions = [metric(n.metrics_port, "specmesh_proposer_sessions_total") for n in cluster["ngrams"]]
    assert all(s > 0 for s in sessions), f"streams per n-gram replica: {sessions}"
    assert sum(outs[i].summary.speculation.drafted_tokens for i in range(32)) > 0


def test_each_verifier_sees_the_statistics_the_other_recorded_in_redis(cluster, chat_ids):
    from specmesh import Client, SamplingParams, SpecDecodeParams

    a, b = cluster["verifiers"]
    ids = chat_ids(workload_prompts(per_category=1, max_chars=400, categories=("translation",))[0])
    with Client(a.address) as client:
        for _ in range(2):
            spec = SpecDecodeParams("ngram", workload_tag="only-a")
            client.complete(ids, SamplingParams(temperature=0.0, max_tokens=24), spec)
    deadline = time.monotonic() + 10
    with Client(b.address) as client:
        while True:
            rows = [r for r in client.router_stats("ngram", "only-a").stats if r.workload_tag == "only-a"]
            if rows and rows[0].steps > 0:
                break
            assert time.monotonic() < deadline, "verifier b never saw verifier a's statistics"
            time.sleep(0.3)
        resp = client.router_stats("ngram", "only-a")
    assert resp.backend == "redis" and resp.connected
    assert rows[0].drafted_tokens > 0
    assert rows[0].served_steps > 0 and rows[0].served_tokens_per_step >= 1 and rows[0].served_tokens_per_s > 0


def test_killing_an_ngram_replica_mid_run_loses_no_request(cluster, lm, chat_ids, hf_greedy):
    prompts = [chat_ids(p) for p in workload_prompts(per_category=1, max_chars=400)]
    work = [(cluster["verifiers"][i % 2].address, prompts[i % len(prompts)]) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_complete, addr, ids, 48) for addr, ids in work]
        time.sleep(2.0)
        cluster["ngrams"][0].proc.send_signal(signal.SIGKILL)
        outs = [f.result(timeout=300) for f in futures]
    for (_, ids), out in zip(work, outs, strict=True):
        assert out.summary.finish_reason in ("length", "eos")
        assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, 48))
    # New requests still find the surviving replica.
    again = _complete(work[0][0], work[0][1], 16)
    assert again.token_ids == hf_greedy(work[0][1], 48)[: len(again.token_ids)]
    # The replica comes back where it was (as a restarted pod behind its Service), so the tests after
    # this one find two replicas again whatever their order.
    dead = cluster["ngrams"][0]
    dead.proc.wait()
    cluster["ngrams"][0] = start_ngram(cluster["tmp"], dead.address, dead.metrics_port)


def test_redis_killed_mid_run_requests_complete_and_statistics_resume_when_it_returns(cluster, chat_ids):
    import redis

    from specmesh import Client

    a = cluster["verifiers"][0]
    ids = chat_ids(workload_prompts(per_category=1, max_chars=400, categories=("qa",))[0])
    cluster["redis"].kill()
    cluster["redis"].wait()
    for _ in range(2):  # the router works from its local statistics
        out = _complete(a.address, ids, 16)
        assert out.summary.finish_reason in ("length", "eos") and out.token_ids
    with Client(a.address) as client:
        assert not client.router_stats().connected
    cluster["redis"] = start_redis(cluster["redis_port"])  # back, empty
    _complete(a.address, ids, 16)
    fresh = redis.Redis(port=cluster["redis_port"])
    deadline = time.monotonic() + 15
    while not list(fresh.scan_iter(f"{PREFIX}*")):
        assert time.monotonic() < deadline, "statistics never reached the restarted Redis"
        _complete(a.address, ids, 8)
        time.sleep(0.5)
    with Client(a.address) as client:
        assert client.router_stats().connected


def test_verifier_metrics_count_drafted_and_accepted_tokens_per_proposer(cluster, chat_ids):
    # Its own traffic (the test passes alone and in any order): a copy task n-gram lookup drafts on.
    port, address = cluster["metrics"][0], cluster["verifiers"][0].address
    drafted, ok = (
        metric(port, "specmesh_drafted_tokens_total", proposer="ngram"),
        metric(port, "specmesh_requests_total", status="ok"),
    )
    numbers = ", ".join(str(i) for i in range(40, 80))
    spec = _complete(address, chat_ids(f"Copy this list exactly: {numbers}"), max_tokens=48).summary.speculation
    assert spec.drafted_tokens > 0
    deadline = time.time() + 5  # the last step's counts are recorded just after its tokens are sent
    while metric(port, "specmesh_drafted_tokens_total", proposer="ngram") < drafted + spec.drafted_tokens:
        assert time.time() < deadline
        time.sleep(0.05)
    assert metric(port, "specmesh_drafted_tokens_total", proposer="ngram") == drafted + spec.drafted_tokens
    assert metric(port, "specmesh_requests_total", status="ok") == ok + 1
