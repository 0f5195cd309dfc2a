"""Tool calling through the real gateway in front of a real verifier, driven by the official ``openai``
client: a named function and ``required`` forced through the grammar (streamed and whole, greedy and
sampled with speculation on), every call's arguments valid against its function's schema; ``auto``
reading a ``<tool_call>`` block out of the model's text (the text held to one by a regex, so the run is
deterministic) with no tag fragment streamed as content; ``auto`` without a call answering what ``none``
answers; a call and its result sent back for the model's next turn, counted by /tokenize as Generate
counts it; and what cannot be honoured, a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
NGRAM = {"spec_decode": {"proposer": "ngram"}}
# What the model is held to in the auto tests: some content, then one Hermes call (a regex, not tool_choice).
HERMES_CALL = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{1,10}", "unit": "celsius"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def gateway(ngram_gateway):
    return ngram_gateway


def _ask(oai, model, stream: bool, **kw) -> list[dict]:
    """Each choice as {"content", "tool_calls", "finish_reason"} (a stream's deltas added up, checked
    for OpenAI's shape on the way: a call's id, type and name in its first delta only)."""
    kw = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 80, "extra_body": NGRAM} | kw
    if not stream:
        resp = oai.chat.completions.create(**kw)
        return [
            {
                "content": c.message.content,
                "tool_calls": [t.model_dump() for t in c.message.tool_calls or []],
                "finish_reason": c.finish_reason,
            }
            for c in resp.choices
        ]
    out: dict[int, dict] = {}
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": None, "tool_calls": [], "finish_reason": None})
            if c.delta.content:
                o["content"] = (o["content"] or "") + c.delta.content
            for t in c.delta.tool_calls or []:
                if t.index == len(o["tool_calls"]):
                    assert t.id.startswith("call_") and t.type == "function" and t.function.name
                    o["tool_calls"].append(t.model_dump(exclude={"index"}))
                else:
                    assert t.id is None and t.function.name is None
                    o["tool_calls"][t.index]["function"]["arguments"] += t.function.arguments
            o["finish_reason"] = c.finish_reason or o["finish_reason"]
    return [out[i] for i in sorted(out)]


def _valid(call: dict) -> dict:
    """The call's arguments, checked against its function's parameters schema."""
    assert call["id"].startswith("call_") and call["type"] == "function"
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, SCHEMAS[call["function"]["name"]])
    return args


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_function_is_forced_and_its_arguments_validate(oai, model, stream):
    (greedy,) = _ask(oai, model, stream, tool_choice=NAMED, temperature=0)
    assert greedy["content"] is None and greedy["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in greedy["tool_calls"]] == ["get_weather"]
    assert _valid(greedy["tool_calls"][0])["city"]
    sampled = _ask(oai, model, stream, tool_choice=NAMED, temperature=0.8, seed=3, n=3)
    assert all(len(c["tool_calls"]) == 1 and c["content"] is None for c in sampled)
    for c in sampled:
        _valid(c["tool_calls"][0])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required_gives_calls_of_the_tools_each_valid(oai, model, stream):
    (greedy,) = _ask(oai, model, stream, tool_choice="required", temperature=0, max_tokens=120)
    assert greedy["content"] is None and greedy["finish_reason"] == "tool_calls", greedy
    assert all(_valid(call) is not None for call in greedy["tool_calls"])
    # one call each (parallel_tool_calls false: an array of one), sampled
    sampled = _ask(oai, model, stream, tool_choice="required", parallel_tool_calls=False, temperature=0.8, seed=11, n=3)
    for c in sampled:
        assert c["content"] is None and c["finish_reason"] == "tool_calls" and len(c["tool_calls"]) == 1, c
        _valid(c["tool_calls"][0])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_reads_a_hermes_call_out_of_the_text_and_streams_no_tag_as_content(oai, model, stream):
    held = {**NGRAM, "structured_outputs": {"regex": HERMES_CALL}}
    (c,) = _ask(oai, model, stream, temperature=0, extra_body=held)
    assert c["content"] == "Let me check." and c["finish_reason"] == "tool_calls"
    assert [t["function"]["name"] for t in c["tool_calls"]] == ["get_weather"]
    assert _valid(c["tool_calls"][0])["unit"] == "celsius"
    (raw,) = _ask(oai, model, stream, temperature=0, extra_body=held, tool_choice="none")  # the text itself
    assert raw["content"].startswith("Let me check.\n<tool_call>\n") and not raw["tool_calls"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_without_a_call_answers_the_text_none_answers(oai, model, stream):
    ask = [{"role": "user", "content": "Say hello in French, in one word."}]
    (auto,) = _ask(oai, model, stream, messages=ask, temperature=0, max_tokens=24)
    (none,) = _ask(oai, model, stream, messages=ask, temperature=0, max_tokens=24, tool_choice="none")
    assert auto == none and not auto["tool_calls"] and auto["content"]


def test_the_call_and_its_result_go_back_and_the_next_turn_comes(oai, model, gateway):
    first = oai.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=60
    )
    call = first.choices[0].message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}
    turn = [*ASK, first.choices[0].message.model_dump(exclude_none=True), result]
    second = oai.chat.completions.create(model=model, messages=turn, tools=TOOLS, temperature=0, max_tokens=40)
    answer = second.choices[0]
    assert answer.message.content or answer.message.tool_calls
    with httpx.Client(timeout=60) as http:  # /tokenize renders the tools and the calls as Generate does
        count = http.post(
            gateway.url.removesuffix("/v1") + "/tokenize", json={"model": model, "messages": turn, "tools": TOOLS}
        )
    assert count.status_code == 200, count.text
    assert count.json()["count"] == second.usage.prompt_tokens
    plain = oai.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=1)
    assert second.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the tools' listing is in the prompt


def _error(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0.type"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [*ASK, {"role": "tool", "content": "21 C"}]}, "messages.1.tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"type": "function"}]}]},
         "messages.0.tool_calls"),
        ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "tools"),  # the verifier cannot compile its schema
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_the_field(gateway, model, extra, param):
    body = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 8} | extra
    with httpx.Client(timeout=60) as http:
        err = _error(http.post(gateway.url + "/chat/completions", json=body))
    assert err["param"] == param and err["type"] == "invalid_request_error", err
