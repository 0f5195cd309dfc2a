"""``specmesh bench --structured {json,tools}`` without a deployment: the workload's prompts and
schemas, the flag, what each request carries (gRPC SamplingParams, HTTP bodies through the openai
client against a stub server on loopback), each output's validation, and the report's table."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specmesh.params import SamplingParams
from specmesh_bench.cli import parse_args
from specmesh_bench.http_target import HttpTarget
from specmesh_bench.report import OVERALL, markdown, summarize
from specmesh_bench.runner import BenchRunner, RunConfig, _mark_lossless
from specmesh_bench.structured import (
    ANSWER_SCHEMA,
    FORCED,
    TOOLS,
    TOPICS,
    json_task,
    schema_error,
    structure,
    tools_task,
)
from specmesh_bench.workload import DEFAULT_WORKLOAD, BenchPrompt, load_prompts, read_rows


def fake_encode(text: str) -> list[int]:
    return [len(text)]


# --- the workload


def test_every_dev_prompt_asks_for_the_schema_its_request_carries():
    prompts = load_prompts(DEFAULT_WORKLOAD, None, 2, fake_encode)
    assert {p.category for p in prompts} == set(TOPICS), "the topic enum is the dev workload's categories"
    for kind in ("json", "tools"):
        out = structure(prompts, kind, fake_encode)
        for before, after in zip(prompts, out, strict=True):
            task = after.structured
            assert after.text.startswith(before.text) and len(after.text) > len(before.text)
            assert after.token_ids == (len(after.text),), "re-encoded with the instruction"
            assert after.turns[0] == after.text and after.row_id == before.row_id
            if kind == "json":
                assert json.loads(task.schema) == ANSWER_SCHEMA
            else:
                assert task.tool == FORCED.get(after.category, "reply") and task.tool in after.text
                assert json.loads(task.tools) == list(TOOLS)
                called = next(t for t in TOOLS if t["function"]["name"] == task.tool)
                assert json.loads(task.schema) == called["function"]["parameters"]
                assert all(t["function"]["name"] in after.text for t in TOOLS), "the prompt lists every tool"


def test_the_schemas_are_small_closed_objects():
    for task in [json_task("qa"), *(tools_task(c) for c in TOPICS)]:
        schema = json.loads(task.schema)
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert set(schema["required"]) == set(schema["properties"]) and len(schema["properties"]) <= 3


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"answer":"Yes.","topic":"qa","confidence":0.9}', None),
        ('{"answer": "Yes.", "topic": "qa", "confidence": 1}', None),
        ('{"answer":"Yes.","topic":"poetry","confidence":0.9}', "'poetry' is not one of"),
        ('{"answer":"Yes.","topic":"qa","confidence":0.9,"extra":1}', "Additional properties"),
        ('{"answer":"Yes.","topic":"qa","confidence":"high"}', "'high' is not of type 'number'"),
        ('{"answer":"Yes.","topic":"qa"', "not JSON"),
        ("Sure! Here is the JSON", "not JSON"),
        ("", "not JSON"),
    ],
)
def test_an_output_is_parsed_and_validated_against_its_schema(text, error):
    got = schema_error(text, json_task("qa"))
    assert got is None if error is None else error in got


def test_the_workload_rows_are_not_changed_on_disk():
    before = read_rows(DEFAULT_WORKLOAD)
    structure(load_prompts(DEFAULT_WORKLOAD, ["qa"], 1, fake_encode), "json", fake_encode)
    assert read_rows(DEFAULT_WORKLOAD) == before


# --- the flag


def test_structured_runs_first_turns_only():
    assert parse_args(["--modes", "plain"]).turns == 2 and parse_args(["--modes", "plain"]).structured is None
    a = parse_args(["--modes", "plain,ngram", "--structured", "tools"])
    assert (a.structured, a.turns) == ("tools", 1)
    assert parse_args(["--modes", "plain", "--structured", "json", "--turns", "1"]).turns == 1
    with pytest.raises(SystemExit):
        parse_args(["--modes", "plain", "--structured", "json", "--turns", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--modes", "plain", "--structured", "yaml"])


# --- the runner: what every request carries, what every record says


class FakeTarget:
    """Answers every request with ``answers[row id]`` and keeps the SamplingParams it was given."""

    name = "grpc"

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers, self.sent = answers, []

    def request(self, prompt, mode, sampling, corpus, tag=False, scope="") -> dict:
        self.sent.append((prompt.row_id, mode, sampling))
        finish = "length" if prompt.row_id == "cut" else "eos"
        return {"transport": "grpc", "token_ids": [1, 2, 3], "text": self.answers[prompt.row_id], "wall_s": 1.0,
                "ttft_ms": 10.0, "itl_ms": [5.0, 5.0], "mean_accepted_length": 1.5, "drafted": 4, "accepted": 2,
                "grammar_pruned": 3 if mode != "plain" else 0, "finish_reason": finish}  # fmt: skip


def structured_prompts(kind: str) -> list[BenchPrompt]:
    base = [BenchPrompt("qa", i, rid, "", "Are there books on Python?", (1,), turns=("x",))
            for i, rid in enumerate(("ok", "bad", "cut"))]  # fmt: skip
    return structure(base, kind, fake_encode)


def test_every_request_carries_its_prompts_schema_and_every_output_is_validated():
    prompts = structured_prompts("json")
    target = FakeTarget({"ok": '{"answer":"Yes","topic":"qa","confidence":0.8}', "bad": '{"answer":"Yes"}',
                         "cut": '{"answer":"Yes, there are many'})  # fmt: skip
    config = RunConfig(modes=("plain", "suffix"), samplings=("greedy", "sampled"), max_tokens=16)
    runner = BenchRunner(config, [target], None, None, warmup=prompts[:1], run_token="t")
    records = list(runner.run(prompts))
    assert len(target.sent) == len(records) + 2, "and the warm-up through each suffix scope"
    for _, _, sampling in target.sent:
        assert sampling.structured_output is not None
        assert json.loads(sampling.structured_output.json_schema) == ANSWER_SCHEMA
        assert sampling.max_tokens == 16
    assert {(r["row_id"], r["schema_valid"]) for r in records} == {("ok", True), ("bad", False), ("cut", False)}
    assert all(r["structured"] == "json" for r in records)
    bad = next(r for r in records if r["row_id"] == "bad")
    assert "'topic' is a required property" in bad["schema_error"]
    assert "schema_error" not in next(r for r in records if r["row_id"] == "ok")

    rows = {(r.sampling, r.category, r.mode): r for r in summarize(records)}
    suffix = rows[("greedy", OVERALL, "suffix")]
    assert (suffix.schema_checked, suffix.schema_valid, suffix.schema_invalid_at_length) == (3, 1, 1)
    assert suffix.grammar_pruned == 9 and rows[("greedy", OVERALL, "plain")].grammar_pruned == 0
    text = markdown(summarize(records), {"cpu": "x", "structured": "json"}, {}, [])
    assert "Structured-output workload `json`" in text
    assert text.count("Structured output (json)") == 2, "a table per run (greedy, sampled)"
    assert "| suffix | 3 | 33% (1) | 1 | 9 | 3.0 |" in text


def test_a_tool_calls_arguments_are_validated_against_the_forced_functions_parameters():
    prompts = structured_prompts("tools")
    assert {p.structured.tool for p in prompts} == {"search_docs"}
    target = FakeTarget({"ok": '{"query":"python books","max_results":3}', "bad": '{"query":"python books"}',
                         "cut": '{"query":"python'})  # fmt: skip
    records = list(BenchRunner(RunConfig(modes=("plain",)), [target], None, None).run(prompts))
    params = json.loads(target.sent[0][2].structured_output.json_schema)
    assert set(params["properties"]) == {"query", "max_results"}
    assert [r["schema_valid"] for r in records] == [True, False, False]


def test_free_text_prompts_carry_no_grammar_and_get_no_check():
    target = FakeTarget({"r": "hello"})
    prompt = BenchPrompt("qa", 0, "r", "", "Hi", (1,))
    records = list(BenchRunner(RunConfig(modes=("plain",)), [target], None, None).run([prompt]))
    assert target.sent[0][2].structured_output is None
    assert "schema_valid" not in records[0] and "Structured output" not in markdown(summarize(records), {}, {}, [])


# --- over HTTP, through the openai client, against a stub server on loopback


@pytest.fixture
def stub_server():
    """/v1/models, a streamed /v1/completions and a streamed /v1/chat/completions that calls a tool
    in three argument pieces; ``bodies`` keeps (path, body) of each request."""
    state = {"bodies": []}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            card = {"id": "tiny", "object": "model", "created": 0, "owned_by": "specmesh", "max_model_len": 512}
            self._send(json.dumps({"object": "list", "data": [card]}).encode(), "application/json")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["bodies"].append((self.path, body))
            spec = {"num_steps": 2, "num_draft_tokens": 6, "num_accepted_draft_tokens": 3, "proposers": {},
                    "num_grammar_pruned_nodes": 2}  # fmt: skip
            usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
            if self.path.endswith("/chat/completions"):
                head = {"id": "chat-1", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}
                call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "search_docs",
                                                                                     "arguments": ""}}  # fmt: skip
                deltas = [{"role": "assistant", "tool_calls": [call]}]
                deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": a}}]}
                           for a in ('{"query":', '"python books",', '"max_results":3}')]  # fmt: skip
                lines = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
                lines.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
            else:
                head = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny"}
                texts = ('{"answer":"Yes",', '"topic":"qa",', '"confidence":0.9}')
                lines = [{**head, "choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in texts]
                lines.append({**head, "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
            lines.append({**head, "choices": [], "usage": usage, "metrics": {"speculative_decoding": spec}})
            sse = "".join(f"data: {json.dumps(x)}\n\n" for x in lines) + "data: [DONE]\n\n"
            self._send(sse.encode(), "text/event-stream")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield state
    server.shutdown()
    server.server_close()


GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def test_a_json_prompt_goes_to_completions_with_its_response_format(stub_server):
    [prompt] = structure([BenchPrompt("qa", 0, "q", "", "Why?", (1,), turns=("Why?",))], "json", fake_encode)
    rec = HttpTarget.connect(stub_server["url"]).request(prompt, "ngram", GREEDY, "")
    path, body = stub_server["bodies"][-1]
    assert path.endswith("/completions") and not path.endswith("/chat/completions")
    assert body["prompt"] == list(prompt.token_ids), "the same token ids as over gRPC"
    assert body["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
    }  # fmt: skip
    assert body["spec_decode"]["proposer"] == "ngram"
    assert rec["text"] == '{"answer":"Yes","topic":"qa","confidence":0.9}' and rec["grammar_pruned"] == 2
    assert "tool_name" not in rec


def test_a_tool_prompt_goes_to_chat_completions_with_tools_and_a_forced_choice(stub_server):
    [prompt] = structure([BenchPrompt("rag", 0, "q", "", "Find it.", (1,), turns=("Find it.",))], "tools", fake_encode)
    rec = HttpTarget.connect(stub_server["url"]).request(prompt, "suffix", GREEDY, "", scope="s1")
    path, body = stub_server["bodies"][-1]
    assert path.endswith("/chat/completions")
    assert body["messages"] == [{"role": "user", "content": prompt.text}]
    assert body["tools"] == list(TOOLS)
    assert body["tool_choice"] == {"type": "function", "function": {"name": "search_docs"}}
    assert (body["max_tokens"], body["temperature"], body["stream"]) == (32, 0.0, True)
    assert body["spec_decode"]["cache_scope"] == "s1" and "response_format" not in body
    assert rec["tool_name"] == "search_docs" and rec["text"] == '{"query":"python books","max_results":3}'
    assert (rec["completion_tokens"], rec["finish_reason"], rec["drafted"]) == (5, "tool_calls", 6)
    assert len(rec["itl_ms"]) == 4, "5 tokens over the 3 argument events (and the first)"
    assert rec["chat"] is True


def test_a_chat_requests_plain_output_is_not_compared_with_the_verifiers_prompt():
    """Over chat completions the gateway renders the prompt with its tools: its plain output is not
    the gRPC prompt's; speculative modes are still checked against the gateway's own plain."""

    def out(mode: str, transport: str, text: str, **kw) -> dict:
        return {"mode": mode, "transport": transport, "text": text, "server": "specmesh", "sampling": "greedy", **kw}

    records = [out("plain", "grpc", "a"), out("plain", "http", "b", chat=True), out("ngram", "http", "c", chat=True),
               out("ngram", "grpc", "a")]  # fmt: skip
    _mark_lossless(records, None)
    assert [r.get("lossless") for r in records] == [None, None, False, True]
