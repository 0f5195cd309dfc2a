"""Anthropic's Messages API (``POST /v1/messages``) through the real gateway in front of a real verifier,
driven by the official ``anthropic`` client: whole and streamed answers token-identical to
``/v1/chat/completions`` on the same conversation (greedy, speculation on), with the same token counts;
``stop_sequences``; a tool forced by ``tool_choice``, its ``tool_use`` input valid against the schema
(whole and streamed through ``input_json_delta``), its ``tool_result`` sent back for the next turn,
rendered as the chat endpoint renders the same turn; refusals in Anthropic's error shape; and the API
key read from ``x-api-key``."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from support import start_gateway, stop_process

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The client (2.x) sends no sampling fields of its own; the API still takes them, so greedy goes in extra_body.
GREEDY = {"temperature": 0}
NGRAM = {"spec_decode": {"proposer": "ngram"}, **GREEDY}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]},
}


@pytest.fixture(scope="module")
def gateway(ngram_gateway):
    return ngram_gateway


@pytest.fixture(scope="module")
def claude(gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=600)


def _text(msg) -> str:
    return "".join(b.text for b in msg.content if b.type == "text")


def test_a_message_is_the_chat_completions_answer_whole_and_streamed(claude, oai, model):
    prompt = [{"role": "user", "content": "Write two sentences about the sea."}]
    system = "You are a poet."
    chat = oai.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, *prompt],
        max_tokens=48,
        temperature=0,
        extra_body=NGRAM,
    )
    whole = claude.messages.create(model=model, system=system, messages=prompt, max_tokens=48, extra_body=NGRAM)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert _text(whole) == chat.choices[0].message.content
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    usage = whole.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    kinds = []
    with claude.messages.stream(model=model, system=system, messages=prompt, max_tokens=48, extra_body=NGRAM) as stream:
        for ev in stream:
            kinds.append(ev.type)
        streamed = stream.get_final_message()
    assert _text(streamed) == _text(whole) and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == usage.output_tokens
    assert kinds[0] == "message_start" and "content_block_start" in kinds and "content_block_stop" in kinds
    assert kinds[-2:] == ["message_delta", "message_stop"]


def test_a_stop_sequence_ends_the_message_and_is_named(claude, model):
    free = claude.messages.create(model=model, messages=ASK, max_tokens=40, extra_body=GREEDY)
    words = _text(free).split()
    assert len(words) > 3, _text(free)
    stop = words[2]
    cut = claude.messages.create(model=model, messages=ASK, max_tokens=40, stop_sequences=[stop], extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(free).startswith(_text(cut)) and stop not in _text(cut)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_forced_tool_is_a_valid_tool_use_and_its_result_makes_the_next_turn(claude, oai, model, gateway, stream):
    ask = {"model": model, "messages": ASK, "tools": [WEATHER], "max_tokens": 80}
    ask["tool_choice"] = {"type": "tool", "name": "get_weather"}
    if stream:
        with claude.messages.stream(**ask, extra_body=NGRAM) as s:
            first = s.get_final_message()
    else:
        first = claude.messages.create(**ask, extra_body=NGRAM)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    result = {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"temperature": 21})}
    turn = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [result]}]  # fmt: skip
    second = claude.messages.create(model=model, messages=turn, tools=[WEATHER], max_tokens=30, extra_body=GREEDY)
    assert second.content and second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the same turn through the chat endpoint: the same prompt, the same answer
    call = {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
    chat_turn = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": use.id, "content": result["content"]}]  # fmt: skip
    chat = oai.chat.completions.create(
        model=model, messages=chat_turn, tools=[CHAT_WEATHER], max_tokens=30, temperature=0
    )
    usage = second.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    if second.stop_reason != "tool_use":
        assert _text(second) == chat.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_in_anthropics_shape(gateway, model, body, param):
    req = {"model": model, "max_tokens": 8, "messages": ASK, **body}
    with httpx.Client(timeout=60) as http:
        resp = http.post(gateway.url + "/messages", json=req)
    assert resp.status_code == 400, resp.text
    err = resp.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert param in err["error"]["message"], err


def test_the_client_raises_its_own_errors(claude, model):
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model=model, messages=ASK, max_tokens=8, extra_body={"thinking": {"type": "enabled"}})
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", messages=ASK, max_tokens=8)


def test_the_api_key_comes_in_x_api_key(tmp_path, ngram_verifier, model):
    (tmp_path / "keys").write_text("sk-good\n")
    g = start_gateway(tmp_path, ngram_verifier.address, "--api-key-file", str(tmp_path / "keys"))
    try:
        base = g.url.removesuffix("/v1")
        good = anthropic.Anthropic(base_url=base, api_key="sk-good", max_retries=0)
        assert _text(good.messages.create(model=model, messages=ASK, max_tokens=4, extra_body=GREEDY))
        bad = anthropic.Anthropic(base_url=base, api_key="sk-bad", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as exc:
            bad.messages.create(model=model, messages=ASK, max_tokens=4)
        assert exc.value.body["error"]["type"] == "authentication_error"
    finally:
        stop_process(g.proc)


def test_output_config_json_schema_holds_the_text_to_the_schema(claude, model):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    msg = claude.messages.create(
        model=model,
        messages=ASK,
        max_tokens=60,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=NGRAM,
    )
    jsonschema.validate(json.loads(_text(msg)), schema)
