"""OpenAI's Responses API (``POST /v1/responses``) through the real gateway in front of a real verifier,
driven by the official ``openai`` client (``responses.create`` and ``responses.stream``): answers
token-identical to ``/v1/chat/completions`` on the same conversation (greedy, speculation on), with the
same token counts; a forced function call valid against its schema, whole and streamed, and its
``function_call_output`` sent back for the next turn; ``previous_response_id`` continuing a stored
conversation; ``text.format`` json_schema; refusals naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": SCHEMA,
}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
ASK = "What is the weather in Paris?"
NGRAM = {"spec_decode": {"proposer": "ngram"}}


@pytest.fixture(scope="module")
def gateway(ngram_gateway):
    return ngram_gateway


def _chat(oai, model, messages, **kw):
    return oai.chat.completions.create(model=model, messages=messages, temperature=0, extra_body=NGRAM, **kw)


def test_a_response_is_the_chat_completions_answer_whole_and_streamed(oai, model):
    instructions, text = "You are a poet.", "Write two sentences about the sea."
    chat = _chat(oai, model, [{"role": "system", "content": instructions}, {"role": "user", "content": text}],
                 max_tokens=48)  # fmt: skip
    ask = {"model": model, "instructions": instructions, "input": text, "max_output_tokens": 48, "temperature": 0}
    whole = oai.responses.create(**ask, extra_body=NGRAM)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    kinds = []
    with oai.responses.stream(**ask, extra_body=NGRAM) as stream:
        for ev in stream:
            kinds.append(ev.type)
        streamed = stream.get_final_response()
    assert streamed.output_text == whole.output_text and streamed.usage.output_tokens == whole.usage.output_tokens
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_forced_function_call_is_valid_and_its_output_makes_the_next_turn(oai, model, stream):
    ask = {"model": model, "input": ASK, "tools": [WEATHER], "max_output_tokens": 80, "temperature": 0}
    ask["tool_choice"] = {"type": "function", "name": "get_weather"}
    if stream:
        with oai.responses.stream(**ask, extra_body=NGRAM) as s:
            kinds = [ev.type for ev in s]
            first = s.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
    else:
        first = oai.responses.create(**ask, extra_body=NGRAM)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    args = json.loads(call.arguments)
    jsonschema.validate(args, SCHEMA)
    output = json.dumps({"temperature": 21})
    turn = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": output}]  # fmt: skip
    second = oai.responses.create(model=model, input=turn, tools=[WEATHER], max_output_tokens=30, temperature=0)
    assert second.output
    tool_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    chat_turn = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "", "tool_calls": [tool_call]},
                 {"role": "tool", "tool_call_id": call.call_id, "content": output}]  # fmt: skip
    chat = _chat(oai, model, chat_turn, tools=[CHAT_WEATHER], max_tokens=30)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    if chat.choices[0].message.content:
        assert second.output_text == chat.choices[0].message.content


def test_previous_response_id_continues_the_stored_conversation(oai, model):
    first = oai.responses.create(model=model, input="My name is Ada. Say hello.", max_output_tokens=16, temperature=0)
    second = oai.responses.create(
        model=model, previous_response_id=first.id, input="What is my name?", max_output_tokens=16, temperature=0
    )
    chat = _chat(oai, model, [{"role": "user", "content": "My name is Ada. Say hello."},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "What is my name?"}], max_tokens=16)  # fmt: skip
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(model=model, previous_response_id="resp_nope", input="hi", max_output_tokens=4)
    assert exc.value.body["param"] == "previous_response_id"
    unstored = oai.responses.create(model=model, input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=model, previous_response_id=unstored.id, input="hi", max_output_tokens=4)


def test_text_format_json_schema_holds_the_output_to_the_schema(oai, model):
    r = oai.responses.create(
        model=model,
        input=ASK,
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}},
        extra_body=NGRAM,
    )
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(oai, model, extra, param):
    body = {"model": model, "input": ASK, "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as exc:
        oai.post("/responses", body=body, cast_to=dict)
    assert exc.value.body["param"] == param, exc.value.body
