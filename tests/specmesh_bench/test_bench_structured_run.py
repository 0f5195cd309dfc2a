"""``specmesh bench --structured`` end to end on a tiny run: a real verifier and gateway, the bench
through the gateway (openai client) and the verifier (gRPC SDK) at once, every output validated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import cpu_only_env, start_gateway, start_verifier, stop_process, stop_verifier

from specmesh_bench.structured import FORCED

ROOT = Path(__file__).resolve().parents[2]  # the repository

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def verifier(tmp_path_factory, lm):
    # always speculate: no start-up profile of the step cost, and every step's tree meets the grammar
    v = start_verifier(
        tmp_path_factory.mktemp("verifier"), "--proposer", "ngram=inprocess:ngram", "--spec-gating", "always"
    )
    yield v
    stop_verifier(v)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, verifier):
    g = start_gateway(tmp_path_factory.mktemp("gateway"), verifier.address)
    yield g
    stop_process(g.proc)


def bench(out: Path, gateway, verifier, kind: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    cmd = [
        sys.executable, "-m", "specmesh", "bench", "--target", gateway.url, "--also-grpc", verifier.address,
        "--structured", kind, "--modes", "plain,ngram", "--categories", "qa,rag", "--limit", "1",
        "--max-tokens", "64", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=cpu_only_env())
    records_file = out / "records.jsonl"
    assert records_file.exists(), proc.stderr[-3000:]
    return proc, [json.loads(x) for x in records_file.read_text().splitlines()]


@pytest.fixture(scope="module")
def json_run(tmp_path_factory, gateway, verifier):
    out = tmp_path_factory.mktemp("bench-json")
    return (*bench(out, gateway, verifier, "json"), out)


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory, gateway, verifier):
    out = tmp_path_factory.mktemp("bench-tools")
    return (*bench(out, gateway, verifier, "tools"), out)


def test_every_output_of_both_transports_is_checked_and_the_report_says_so(json_run):
    proc, records, out = json_run
    assert proc.returncode == 0, proc.stderr[-3000:]  # lossless: every greedy output equals plain's
    assert len(records) == 2 * 2 * 2, "2 prompts x (plain, ngram) x (gateway, gRPC)"
    assert {r["transport"] for r in records} == {"http", "grpc"}
    for r in records:
        assert r["structured"] == "json" and isinstance(r["schema_valid"], bool), r
        assert r["schema_valid"] or r["schema_error"]
        assert r["turn"] == 1
    assert all(isinstance(r["grammar_pruned"], int) for r in records if r["transport"] == "grpc")
    summary = (out / "summary.md").read_text()
    assert "Structured-output workload `json`" in summary and "Structured output (json)" in summary
    rows = json.loads((out / "summary.json").read_text())
    assert all(r["schema_checked"] == r["requests"] for r in rows)


def test_with_the_grammar_every_finished_json_output_validates(json_run):
    _, records, _ = json_run
    finished = [r for r in records if r["finish_reason"] != "length"]
    assert finished, "no output finished within 64 tokens"
    invalid = [(r["transport"], r["mode"], r["text"], r.get("schema_error")) for r in finished if not r["schema_valid"]]
    assert not invalid, invalid


def test_tool_calls_go_through_chat_with_tools_and_validate(tools_run):
    proc, records, _ = tools_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    http = [r for r in records if r["transport"] == "http"]
    assert len(http) == 2 * 2 and all(r["structured"] == "tools" for r in records)
    assert {r["tool_name"] for r in http} == {FORCED["qa"]}, "the forced function is called"
    finished = [r for r in records if r["finish_reason"] != "length"]
    assert finished and all(r["schema_valid"] for r in finished), [(r["text"], r.get("schema_error")) for r in records]
