"""``specmesh bench --target http://…/v1``: SSE parsing, text losslessness, the runner's interleaving and
the Gateway-vs-gRPC table on hand-made data; the openai client against a stub server on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from openai.types import Completion

from specmesh.params import SamplingParams
from specmesh_bench.cli import check_http_target, parse_args
from specmesh_bench.http_target import HttpTarget, SseTally
from specmesh_bench.report import gateway_vs_grpc, losslessness_failures, markdown, primary, summarize
from specmesh_bench.runner import BenchRunner, RunConfig, _mark_lossless, _record, spread_counts
from specmesh_bench.workload import BenchPrompt

PROMPT = BenchPrompt("code", 0, "r0", "src", "text", (1, 2, 3))


def event(text: str = "", finish: str | None = None, logprob_tokens: list[str] | None = None, **extra) -> Completion:
    """A streamed event as the openai client builds it (no validation, extra fields kept)."""
    lp = {"tokens": logprob_tokens, "token_logprobs": [0.0] * len(logprob_tokens)} if logprob_tokens else None
    choices = [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}] if text or finish else []
    return Completion.construct(id="c", object="text_completion", created=0, model="m", choices=choices, **extra)


def usage_event(completion_tokens: int, spec: dict | None = None) -> Completion:
    usage = {"prompt_tokens": 3, "completion_tokens": completion_tokens, "total_tokens": 3 + completion_tokens}
    return event(usage=usage, **({"metrics": {"speculative_decoding": spec}} if spec else {}))


# --- the events of one request → its record


def test_a_gap_is_spread_over_the_tokens_of_the_usage_count():
    tally = SseTally(t0=10.0)
    for t, text in [(10.2, "a"), (10.3, "bcd"), (10.9, "e")]:
        tally.add(t, event(text))
    tally.add(10.9, event(finish="stop"))
    tally.add(10.9, usage_event(7))
    rec = tally.record(wall=1.0)
    # 7 tokens over 3 events: 2, 2, 3; gaps after the first event: 100 ms over 2 tokens, 600 ms over 3
    assert rec["ttft_ms"] == pytest.approx(200.0)
    assert rec["itl_ms"] == pytest.approx([50.0, 50.0, 200.0, 200.0, 200.0])
    assert sum(rec["itl_ms"]) == pytest.approx(700.0), "the gaps add up to the time after the first event"
    assert (rec["text"], rec["completion_tokens"], rec["finish_reason"]) == ("abcde", 7, "stop")
    assert rec["transport"] == "http" and "token_ids" not in rec


def test_events_with_logprobs_count_their_own_tokens():
    tally = SseTally(t0=0.0)
    tally.add(0.1, event("ab", logprob_tokens=["a", "b"]))
    tally.add(0.4, event("cde", logprob_tokens=["c", "d", "e"]))
    tally.add(0.5, event("f"))
    tally.add(0.5, usage_event(7))
    assert tally.record(1.0)["itl_ms"] == pytest.approx([100.0] * 3 + [50.0] * 2)


def test_without_usage_each_event_counts_as_one_token():
    tally = SseTally(t0=0.0)
    for t in (0.1, 0.3, 0.4):
        tally.add(t, event("x"))
    rec = tally.record(0.4)
    assert rec["completion_tokens"] == 3 and rec["itl_ms"] == pytest.approx([200.0, 100.0])
    assert (rec["steps"], rec["drafted"], rec["proposer"], rec["fallback_reason"]) == (0, 0, "none", "")


def test_speculation_metrics_come_from_the_usage_event():
    spec = {
        "num_spec_steps": 3, "num_draft_tokens": 12, "num_accepted_draft_tokens": 9, "mean_acceptance_length": 4.0,
        "draft_acceptance_rate": 0.75, "acceptance_histogram": [0, 1, 0, 1, 1], "num_steps": 5,
        "proposers": {"ngram": {"num_spec_steps": 3}}, "fallback_reason": "low acceptance",
    }  # fmt: skip
    tally = SseTally(t0=0.0)
    tally.add(0.1, event("x" * 11))
    tally.add(0.2, usage_event(11, spec))
    rec = tally.record(0.2)
    assert (rec["steps"], rec["drafted"], rec["accepted"]) == (5, 12, 9)
    assert rec["mean_accepted_length"] == pytest.approx(10 / 5), "tokens after the first per step, as over gRPC"
    assert rec["accepted_length_counts"] == [0, 1, 0, 1, 1]
    assert (rec["proposer"], rec["fallback_reason"]) == ("ngram", "low acceptance")


def test_spread_counts_always_add_up_to_the_total():
    for total in range(7, 40):  # at least a token for each event
        for known in ([None] * 5, [3, None, None, None, 1], [None, 2, None, None, None]):
            counts = spread_counts(known, total)
            assert sum(counts) == total and min(counts) >= 1
            spread = [c for c, k in zip(counts, known, strict=True) if k is None]
            assert max(spread) - min(spread) <= 1, "evenly"


def test_tokens_per_second_use_the_servers_count_when_there_are_no_ids():
    rec = _record(PROMPT, "plain", "greedy", 1, 0, text="abc", completion_tokens=12, wall_s=2.0)
    assert (rec["completion_tokens"], rec["tokens_per_s"]) == (12, 6.0)
    grpc = _record(PROMPT, "plain", "greedy", 1, 0, token_ids=[1, 2, 3, 4], wall_s=2.0)
    assert (grpc["completion_tokens"], grpc["tokens_per_s"]) == (4, 2.0)


# --- losslessness by text


def out(mode: str, transport: str | None, text: str, ids: list[int] | None = None, server: str = "specmesh") -> dict:
    r = {"mode": mode, "category": "code", "prompt_index": 0, "concurrency": 1, "wave": 0, "sampling": "greedy"}
    r.update(text=text, **({"transport": transport} if transport else {}))
    if transport == "http":
        r["server"] = server
    if ids is not None:
        r["token_ids"] = ids
    return r


def test_http_outputs_are_checked_by_text_and_the_gateways_plain_against_grpcs():
    records = [
        out("plain", "http", "def f():"),
        out("plain", "grpc", "def f():", [1, 2, 3]),
        out("ngram", "http", "def g():"),
        out("ngram", "grpc", "def f():", [1, 2, 3]),
        out("hf-greedy", None, "def f():", [1, 2, 3]),
    ]
    _mark_lossless(records, None)
    assert [r.get("lossless") for r in records] == [True, None, False, True, True]
    assert (records[2]["mismatch_at"], records[2]["mismatch_in"]) == (4, "text")
    assert "mismatch_in" not in records[3]
    assert losslessness_failures(records) == [
        "ngram (http) on code[0] (concurrency 1, wave 0): first differing character at 4"
    ]


def test_a_gateway_whose_text_differs_from_the_verifiers_fails_even_in_plain():
    records = [out("plain", "http", "def f():\n"), out("plain", "grpc", "def f():", [1, 2, 3])]
    _mark_lossless(records, None)
    assert records[0]["lossless"] is False and records[0]["mismatch_at"] == 8


def test_the_self_test_corrupts_text_too():
    records = [out("plain", "http", "abc"), out("ngram", "http", "abc")]
    _mark_lossless(records, "ngram")
    assert records[1]["lossless"] is False and records[1]["mismatch_at"] == 2


def test_reference_decoding_is_not_compared_with_another_servers_text():
    records = [out("plain", "http", "abc", server="vllm"), out("hf-greedy", None, "abd", [1, 2, 3])]
    _mark_lossless(records, None)
    assert "lossless" not in records[1], "another engine's numerics say nothing about speculation"
    records = [out("plain", "http", "abc"), out("hf-greedy", None, "abd", [1, 2, 3])]
    _mark_lossless(records, None)
    assert records[1]["lossless"] is False


# --- the runner: both transports, interleaved


class FakeTarget:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def request(self, prompt, mode, sampling, corpus, tag=False, scope="") -> dict:
        self.log.append((self.name, mode, prompt.index, sampling.seed))
        rec = {"transport": self.name, "wall_s": 1.0, "ttft_ms": 10.0, "itl_ms": [5.0], "text": "same"}
        rec.update({"server": "specmesh", "completion_tokens": 4} if self.name == "http" else {"token_ids": [1, 2]})
        rec.update(mean_accepted_length=1.0, drafted=0, accepted=0)
        return rec


def test_every_mode_runs_on_both_transports_alternating_which_goes_first_with_the_same_seeds():
    log: list = []
    prompts = [BenchPrompt("code", i, f"r{i}", "", "", (1, 2)) for i in range(2)]
    config = RunConfig(modes=("plain", "ngram"), samplings=("sampled",), max_tokens=4)
    runner = BenchRunner(config, [FakeTarget("http", log), FakeTarget("grpc", log)], None, None)
    records = list(runner.run(prompts))
    assert runner.planned_requests(prompts) == len(records) == 2 * 2 * 2
    assert [(t, m, i) for t, m, i, _ in log] == [
        ("http", "plain", 0), ("grpc", "plain", 0), ("http", "ngram", 0), ("grpc", "ngram", 0),
        ("grpc", "plain", 1), ("http", "plain", 1), ("grpc", "ngram", 1), ("http", "ngram", 1),
    ]  # fmt: skip
    seeds = {(m, i): set() for _, m, i, _ in log}
    for _, m, i, s in log:
        seeds[(m, i)].add(s)
    assert all(len(s) == 1 for s in seeds.values()), "both transports get the same seed"
    assert {r["transport"] for r in records} == {"http", "grpc"}
    http = [r for r in records if r["transport"] == "http"]
    assert all(r["tokens_per_s"] == 4.0 for r in http)


# --- the report


def rec(mode: str, transport: str, idx: int, tps: float, itl: list[float], c: int = 1, wave_tps: float = 0.0, **kw):
    return {
        "mode": mode, "category": "code", "prompt_index": idx, "sampling": "greedy", "concurrency": c,
        "wave": idx, "tokens_per_s": tps, "wave_tokens_per_s": wave_tps, "transport": transport,
        "ttft_ms": 100.0 if transport == "grpc" else 110.0, "itl_ms": itl, "mean_accepted_length": 1.0,
        "drafted": 0, "accepted": 0, **kw,
    }  # fmt: skip


def synthetic() -> list[dict]:
    return [
        rec("plain", "grpc", 0, 10.0, [20.0, 20.0]),
        rec("plain", "http", 0, 9.0, [22.0, 22.0]),
        rec("plain", "grpc", 1, 20.0, [20.0, 20.0]),
        rec("plain", "http", 1, 19.0, [21.0, 21.0]),
        rec("ngram", "grpc", 0, 30.0, [5.0, 5.0, 5.0], itl_spread_ms=[10.0, 10.0, 10.0]),
        rec("ngram", "http", 0, 24.0, [12.0, 12.0, 12.0]),
        rec("ngram", "grpc", 1, 40.0, [5.0, 5.0], itl_spread_ms=[10.0, 10.0]),
        rec("ngram", "http", 1, 40.0, [11.0, 11.0]),
        *[rec("ngram", t, 0, 1.0, [30.0], c=2, wave_tps=w, slot=j) for t, w in (("grpc", 50.0), ("http", 45.0))
          for j in range(2)],
    ]  # fmt: skip


def test_gateway_vs_grpc_pairs_the_transports_per_mode_and_concurrency():
    rows = {(r.concurrency, r.mode): r for r in gateway_vs_grpc(synthetic())}
    plain, ngram, wave = rows[(1, "plain")], rows[(1, "ngram")], rows[(2, "ngram")]
    assert (plain.grpc_tokens_per_s, plain.http_tokens_per_s) == (15.0, 14.0)
    assert plain.ratio == pytest.approx((0.9 + 0.95) / 2), "paired per prompt, median"
    assert (plain.grpc_itl_p50_ms, plain.http_itl_p50_ms, plain.itl_diff_ms) == (20.0, 21.0, 1.0)
    assert ngram.ratio == pytest.approx((0.8 + 1.0) / 2)
    assert ngram.grpc_itl_p50_ms == 10.0, "gRPC's ITL estimated as over HTTP, where recorded"
    assert ngram.itl_diff_ms == pytest.approx(12.0 - 10.0)
    assert (wave.grpc_tokens_per_s, wave.http_tokens_per_s, wave.ratio) == (50.0, 45.0, 0.9)
    assert (wave.requests, plain.grpc_ttft_ms, plain.http_ttft_ms) == (2, 100.0, 110.0)


def test_the_summary_describes_the_target_and_adds_the_comparison():
    records = synthetic()
    main = primary(records)
    assert {r["transport"] for r in main} == {"http"}
    rows = {(r.concurrency, r.category, r.mode): r for r in summarize(main)}
    assert rows[(1, "code", "plain")].tokens_per_s == pytest.approx(14.0), "the gRPC side is not mixed in"
    meta = {"target": "http://h:8000/v1", "http_server": "specmesh", "model": "m", "cpu": "x"}
    text = markdown(summarize(main), meta, {}, [], gateway_vs_grpc(records))
    assert "server: m at http://h:8000/v1 (owned_by specmesh)" in text
    assert "## Gateway vs gRPC" in text
    assert "| greedy | 1 | plain | 15.0 | 14.0 | 0.925 | 20.0 | 21.0 | +1.0 | 100 | 110 |" in text


def test_a_grpc_only_run_has_no_comparison():
    records = [r for r in synthetic() if r["transport"] == "grpc"]
    assert primary(records) == records and gateway_vs_grpc(records) == []
    assert "Gateway vs gRPC" not in markdown(summarize(records), {"cpu": "x"}, {}, [], gateway_vs_grpc(records))


# --- the command line


def test_also_grpc_needs_an_http_target():
    with pytest.raises(SystemExit):
        parse_args(["--target", "127.0.0.1:50051", "--also-grpc", "127.0.0.1:50051"])
    a = parse_args(["--target", "http://127.0.0.1:8000/v1", "--also-grpc", "127.0.0.1:50051"])
    assert a.also_grpc == "127.0.0.1:50051"


def test_a_foreign_server_serves_only_plain():
    vllm = HttpTarget(None, "Qwen/Qwen2.5-0.5B", "vllm")
    assert check_http_target(vllm, ["plain", "hf-greedy", "hf-pld"], "") is None
    assert "ngram, auto need a SpecMesh server" in check_http_target(vllm, ["plain", "ngram", "auto"], "")
    assert "--also-grpc" in check_http_target(vllm, ["plain"], "127.0.0.1:50051")
    assert check_http_target(HttpTarget(None, "m", "specmesh"), ["plain", "ngram"], "x") is None


# --- through the openai client, against a stub server on loopback


@pytest.fixture
def stub_server():
    """/v1/models and a streamed /v1/completions; ``bodies`` keeps what each request sent."""
    state = {"owned_by": "specmesh", "bodies": []}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            card = {"id": "tiny", "object": "model", "created": 0, "owned_by": state["owned_by"], "max_model_len": 64}
            self._send(200, json.dumps({"object": "list", "data": [card]}).encode(), "application/json")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["bodies"].append(body)
            head = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny"}
            events = [{"index": 0, "text": t, "logprobs": None, "finish_reason": None} for t in ("Hel", "lo")]
            events.append({"index": 0, "text": "", "logprobs": None, "finish_reason": "length"})
            lines = [{**head, "choices": [e], "usage": None} for e in events]
            spec = {"num_steps": 2, "num_draft_tokens": 3, "num_accepted_draft_tokens": 2, "proposers": {"ngram": {}}}
            usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
            lines.append({**head, "choices": [], "usage": usage, "metrics": {"speculative_decoding": spec}})
            sse = "".join(f"data: {json.dumps(x)}\n\n" for x in lines) + "data: [DONE]\n\n"
            self._send(200, sse.encode(), "text/event-stream")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield state
    server.shutdown()
    server.server_close()


def test_a_specmesh_gateway_gets_each_modes_speculation_as_extra_body(stub_server):
    target = HttpTarget.connect(stub_server["url"])
    assert (target.model, target.specmesh, target.max_model_len) == ("tiny", True, 64)
    rec = target.request(PROMPT, "auto", SamplingParams(temperature=0.0, max_tokens=4), "docs", tag=True)
    body = stub_server["bodies"][-1]
    assert body["prompt"] == [1, 2, 3] and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("tiny", 4, 0.0) and "seed" not in body
    assert body["spec_decode"] == {
        "proposer": "auto", "num_speculative_tokens": 0, "max_tree_nodes": 0, "workload_tag": "code", "corpus": "docs",
        "cache_scope": "", "cache_salt": "",
    }  # fmt: skip
    assert (rec["text"], rec["completion_tokens"], rec["finish_reason"], rec["steps"]) == ("Hello", 4, "length", 2)
    assert rec["server"] == "specmesh" and len(rec["itl_ms"]) == 2
    target.request(PROMPT, "suffix", SamplingParams(temperature=0.0, max_tokens=4), "", scope="bench-1-suffix")
    assert stub_server["bodies"][-1]["spec_decode"]["cache_scope"] == "bench-1-suffix"
    target.request(PROMPT, "plain", SamplingParams(temperature=0.7, seed=5, max_tokens=4), "")
    assert stub_server["bodies"][-1]["spec_decode"]["proposer"] == "none"
    assert stub_server["bodies"][-1]["seed"] == 5
    assert "repetition_penalty" not in stub_server["bodies"][-1]
    target.request(PROMPT, "ngram", SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.2), "")
    assert stub_server["bodies"][-1]["repetition_penalty"] == pytest.approx(1.2)


def test_the_repetition_penalty_flag_reaches_every_requests_sampling():
    a = parse_args(["--modes", "plain,ngram", "--repetition-penalty", "1.2"])
    assert a.repetition_penalty == 1.2 and parse_args(["--modes", "plain"]).repetition_penalty is None
    runner = BenchRunner.__new__(BenchRunner)
    runner.config = RunConfig(modes=("plain",), max_tokens=9, repetition_penalty=1.2)
    for sampling in ("greedy", "sampled"):
        params = runner._sampling(sampling, seed=3)
        assert (params.repetition_penalty, params.max_tokens) == (1.2, 9)


def test_another_server_gets_no_extra_body_and_only_plain(stub_server):
    stub_server["owned_by"] = "vllm"
    target = HttpTarget.connect(stub_server["url"], served_model="tiny")
    assert not target.specmesh
    target.request(PROMPT, "plain", SamplingParams(temperature=0.0, max_tokens=4), "")
    assert "spec_decode" not in stub_server["bodies"][-1]
    with pytest.raises(ValueError, match="needs a SpecMesh server"):
        target.request(PROMPT, "ngram", SamplingParams(temperature=0.0, max_tokens=4), "")
