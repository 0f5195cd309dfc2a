"""Structured outputs through the real gateway in front of a real verifier, driven by the official
``openai`` client: OpenAI's ``response_format`` (json_schema strict, streaming and not; json_object),
vLLM's ``structured_outputs`` and ``guided_*`` in ``extra_body`` on both endpoints, every output
valid; 50 sampled outputs at temperature 0.8 with speculation on, all valid; and the grammars the
verifier cannot compile, or the gateway refuses before, answered 400 naming the request field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from support import MAX_N

pytestmark = pytest.mark.slow

PLACE = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "country": {"type": "string", "maxLength": 16}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
EIFFEL = [{"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON with the city and the country."}]
# Small enough that a sampled answer always completes: an enum, a bounded integer, a short string.
VERDICT = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
        "reason": {"type": "string", "maxLength": 24},
    },
    "required": ["answer", "confidence", "reason"],
    "additionalProperties": False,
}
VERDICT_PROMPT = (
    'Is Paris the capital of France? Reply with JSON like {"answer": "yes", "confidence": 9, "reason": "it is"} '
    'or {"answer": "no", "confidence": 3, "reason": "it is not"}.'
)
SAMPLED, PER_REQUEST = 50, MAX_N  # outputs, and choices per request (the gateway runs with --max-n MAX_N)


class Place(BaseModel):
    city: str = Field(max_length=16)
    country: str = Field(max_length=16)


@pytest.fixture(scope="module")
def gateway(ngram_gateway):
    return ngram_gateway


def _json_schema(schema: dict, name: str = "place") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_response_format_json_schema_strict_streamed_or_not_is_valid_and_the_same(oai, model):
    args = {"model": model, "messages": EIFFEL, "temperature": 0, "max_tokens": 80}
    resp = oai.chat.completions.create(**args, response_format=_json_schema(PLACE))
    text = resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), PLACE)
    assert text == json.dumps(json.loads(text))  # compact: json.dumps's separators, no other whitespace
    stream = oai.chat.completions.create(**args, response_format=_json_schema(PLACE), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_the_openai_clients_parse_returns_the_pydantic_object(oai, model):
    resp = oai.chat.completions.parse(model=model, messages=EIFFEL, temperature=0, max_tokens=80, response_format=Place)
    place = resp.choices[0].message.parsed
    assert isinstance(place, Place) and place.city


def test_response_format_json_object_is_one_json_object(oai, model):
    messages = [{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}]
    resp = oai.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=120, response_format={"type": "json_object"}
    )
    assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("extra", "valid"),
    [
        ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: re.fullmatch("[0-9]{4}", t)),
        ({"structured_outputs": {"choice": ["Paris", "London", "Rome"]}}, lambda t: t in ("Paris", "London", "Rome")),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"grammar": 'root ::= "The capital is " city "."\ncity ::= "Paris" | "Rome"'}},
         lambda t: t in ("The capital is Paris.", "The capital is Rome.")),
        ({"structured_outputs": {"json": PLACE}}, lambda t: jsonschema.validate(json.loads(t), PLACE) is None),
        ({"guided_json": json.dumps(PLACE), "guided_decoding_backend": "xgrammar:disable-any-whitespace"},
         lambda t: jsonschema.validate(json.loads(t), PLACE) is None),
    ],
)  # fmt: skip
def test_vllms_structured_outputs_in_extra_body_constrain_the_chat(oai, model, extra, valid):
    messages = [{"role": "user", "content": "What is the capital of France, and in what year did WWII end?"}]
    resp = oai.chat.completions.create(
        model=model, messages=messages, temperature=0.8, seed=3, max_tokens=80, n=3, extra_body=extra
    )
    for choice in resp.choices:
        assert choice.finish_reason == "stop" and valid(choice.message.content), choice.message.content


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_response_format_and_guided_regex(oai, model, stream):
    prompt = "The year the Second World War ended was"
    out = oai.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, stream=stream, extra_body={"guided_regex": " [0-9]{4}"}
    )
    text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
    assert re.fullmatch(" [0-9]{4}", text), text
    out = oai.completions.create(
        model=model,
        prompt="A city, as JSON: ",
        max_tokens=80,
        temperature=0,
        extra_body={"response_format": _json_schema(PLACE)},
    )
    jsonschema.validate(json.loads(out.choices[0].text), PLACE)


def test_fifty_sampled_outputs_with_speculation_all_validate(oai, model):
    """Temperature 0.8, n-gram drafts on: every one of 50 outputs is valid JSON of the schema."""

    def ask(seed: int):
        return oai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": VERDICT_PROMPT}],
            temperature=0.8,
            seed=seed,
            n=PER_REQUEST,
            max_tokens=96,
            response_format=_json_schema(VERDICT, "verdict"),
            extra_body={"spec_decode": {"proposer": "ngram"}},
        )

    with ThreadPoolExecutor(SAMPLED // PER_REQUEST) as pool:
        responses = list(pool.map(ask, range(0, SAMPLED, PER_REQUEST)))
    choices = [c for r in responses for c in r.choices]
    assert len(choices) == SAMPLED
    cut = [c.message.content for c in choices if c.finish_reason == "length"]
    assert not cut, f"{len(cut)} outputs hit max_tokens (make the schema smaller): {cut[:3]}"
    invalid = []
    for c in choices:
        try:
            jsonschema.validate(json.loads(c.message.content), VERDICT)
        except (ValueError, jsonschema.ValidationError) as exc:
            invalid.append((c.message.content, str(exc).splitlines()[0]))
    assert not invalid, f"{len(invalid)} of {SAMPLED} outputs are not valid: {invalid[:3]}"
    assert len({c.message.content for c in choices}) > 1  # sampled, not one answer 50 times
    spec = [r.model_extra["metrics"]["speculative_decoding"] for r in responses]
    drafted, accepted = sum(m["num_draft_tokens"] for m in spec), sum(m["num_accepted_draft_tokens"] for m in spec)
    pruned = sum(m["num_grammar_pruned_nodes"] for m in spec)
    print(f"{SAMPLED} valid; drafted {drafted}, accepted {accepted}, pruned by the grammar {pruned}")
    assert drafted > 0  # speculation was on


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("endpoint", "extra", "param"),
    [
        ("chat", {"response_format": _json_schema({"type": "nonsense"})}, "response_format"),
        ("chat", {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}},
         "structured_outputs.json"),
        ("completions", {"guided_regex": "[0-9"}, "guided_regex"),
        ("chat", {"structured_outputs": {"grammar": 'root ::= "a" | undefined_rule'}}, "structured_outputs.grammar"),
        # refused by the gateway before the stream opens
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
         "response_format"),
        ("chat", {"guided_choice": []}, "guided_choice"),
        ("completions", {"guided_json": {}, "guided_regex": "a"}, "guided_regex"),
        ("chat", {"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend"),
        ("chat", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ],
)  # fmt: skip
def test_a_grammar_that_cannot_compile_or_be_honoured_is_400_naming_the_field(
    oai, model, endpoint, extra, param, stream
):
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            oai.chat.completions.create(model=model, messages=EIFFEL, max_tokens=8, stream=stream, extra_body=extra)
        else:
            oai.completions.create(model=model, prompt="Hi", max_tokens=8, stream=stream, extra_body=extra)
    assert info.value.status_code == 400 and info.value.param == param, info.value.body
    assert info.value.type == "invalid_request_error" and param in info.value.message
