"""The mapping of structured-output request fields onto the one StructuredOutput (gateway_svc/structured.py):
OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields; what is refused, naming
the field; and a verifier refusal of a grammar answered naming the field the request sent it in."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from gateway_svc.errors import RequestError, param_of
from gateway_svc.structured import from_fields, schema_text
from specmesh.params import StructuredOutput

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}
COMPACT = '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}},"required":["b"]}'


def _rf(schema=SCHEMA, **extra) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, **extra}}}


def _refused(fields: dict) -> RequestError:
    with pytest.raises(RequestError) as info:
        from_fields(fields)
    assert info.value.status == 400
    return info.value


def test_no_field_or_response_format_text_asks_for_no_grammar():
    assert from_fields({}) is None
    assert from_fields({"response_format": {"type": "text"}, "structured_outputs": None}) is None
    assert from_fields({"guided_decoding_backend": "xgrammar"}) is None  # a backend alone changes nothing


@pytest.mark.parametrize("strict", [True, False, None])
def test_response_format_json_schema_is_compact_schema_text_in_the_order_given_strict_or_not(strict):
    g = from_fields(_rf(strict=strict, description="a thing"))
    assert g.output == StructuredOutput(json_schema=COMPACT, any_whitespace=False)
    assert g.param == "response_format"


def test_response_format_json_object():
    g = from_fields({"response_format": {"type": "json_object"}})
    assert g.output == StructuredOutput(json_object=True) and g.param == "response_format"


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "structural_tag", "structures": []}, "response_format.type"),
        ("json", "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
         "response_format.json_schema.strict"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}},
         "response_format.json_schema.extra"),
        ({"type": "json_object", "schema": {}}, "response_format.schema"),
    ],
)  # fmt: skip
def test_a_malformed_response_format_is_400_naming_the_field(value, param):
    assert _refused({"response_format": value}).param == param


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ({"json": SCHEMA}, StructuredOutput(json_schema=COMPACT, any_whitespace=True)),
        ({"json": json.dumps(SCHEMA)}, StructuredOutput(json_schema=COMPACT, any_whitespace=True)),
        ({"json": SCHEMA, "disable_any_whitespace": True}, StructuredOutput(json_schema=COMPACT)),
        ({"json_object": True}, StructuredOutput(json_object=True, any_whitespace=True)),
        ({"regex": "[0-9]{3}", "json_object": False}, StructuredOutput(regex="[0-9]{3}")),
        ({"choice": ["yes", "no"]}, StructuredOutput(choice=("yes", "no"))),
        ({"grammar": 'root ::= "a" | "b"'}, StructuredOutput(grammar='root ::= "a" | "b"')),
        ({"json": True, "backend": "xgrammar", "disable_fallback": True, "disable_additional_properties": False},
         StructuredOutput(json_schema="true", any_whitespace=True)),
        ({"choice": ["x"], "backend": "auto", "whitespace_pattern": None}, StructuredOutput(choice=("x",))),
    ],
)  # fmt: skip
def test_vllms_structured_outputs_map_onto_one_structured_output(value, want):
    g = from_fields({"structured_outputs": value})
    assert g.output == want
    kind = next(k for k in ("json", "json_object", "regex", "choice", "grammar") if value.get(k))
    assert g.param == f"structured_outputs.{kind}"


def test_a_pydantic_models_schema_is_sent_as_its_json_text():
    class Person(BaseModel):
        name: str
        age: int

    schema = Person.model_json_schema()
    g = from_fields({"structured_outputs": {"json": schema}})
    assert json.loads(g.output.json_schema) == schema
    assert g.output.json_schema == schema_text("x", json.dumps(schema))


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ({}, "structured_outputs"),
        ({"json_object": False}, "structured_outputs"),
        ({"json": {}, "regex": "a"}, "structured_outputs"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": "[1, 2]"}, "structured_outputs.json"),
        ({"json": 3}, "structured_outputs.json"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"grammar": 5}, "structured_outputs.grammar"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
        ({"regex": "a", "backend": "outlines"}, "structured_outputs.backend"),
        ({"regex": "a", "backend": "guidance"}, "structured_outputs.backend"),
        ({"json": {}, "whitespace_pattern": " *"}, "structured_outputs.whitespace_pattern"),
        ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
        ({"regex": "a", "disable_any_whitespace": "no"}, "structured_outputs.disable_any_whitespace"),
        ({"regex": "a", "frobnicate": 1}, "structured_outputs.frobnicate"),
        ("a+", "structured_outputs"),
    ],
)
def test_a_structured_outputs_value_we_cannot_honour_is_400_naming_the_field(value, param):
    assert _refused({"structured_outputs": value}).param == param


def test_an_empty_choice_list_is_400_naming_it():
    assert _refused({"guided_choice": []}).param == "guided_choice"


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"guided_json": SCHEMA}, StructuredOutput(json_schema=COMPACT, any_whitespace=True)),
        ({"guided_json": json.dumps(SCHEMA), "guided_decoding_backend": "xgrammar:disable-any-whitespace"},
         StructuredOutput(json_schema=COMPACT)),
        ({"guided_regex": r"\d+", "guided_decoding_backend": "auto"}, StructuredOutput(regex=r"\d+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutput(choice=("a", "b"))),
        ({"guided_grammar": 'root ::= "x"', "guided_decoding_backend": "xgrammar:no-fallback"},
         StructuredOutput(grammar='root ::= "x"')),
    ],
)  # fmt: skip
def test_vllms_older_guided_fields_map_the_same_way(fields, want):
    g = from_fields(fields)
    assert g.output == want and g.param == next(k for k in fields if k != "guided_decoding_backend")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_json": {}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({**_rf(), "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a"}, "guided_grammar": 'root ::= "a"'}, "guided_grammar"),
        ({"guided_regex": "a", "guided_decoding_backend": "lm-format-enforcer"}, "guided_decoding_backend"),
        ({"guided_regex": "a", "guided_decoding_backend": "xgrammar:sloppy"}, "guided_decoding_backend"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ],
)
def test_two_grammars_or_another_backend_are_400_naming_the_field(fields, param):
    assert _refused(fields).param == param


@pytest.mark.parametrize(
    ("details", "sent_in"),
    [
        ("sampling.structured_output.json_schema: cannot compile: Unsupported type", "structured_outputs.json"),
        ("sampling.structured_output.regex: cannot compile: Unclosed '['", "guided_regex"),
        ("sampling.structured_output: set one of json_schema, …", "response_format"),
    ],
)
def test_a_verifier_refusal_of_the_grammar_names_the_field_the_request_sent_it_in(details, sent_in):
    assert param_of(details, "max_tokens", "logprobs", "prompt_logprobs", sent_in) == sent_in
