"""Tool calls read out of text, on tiny strings: each parser whole and streamed in every split (the same
events), no tag fragment ever answered as content, and the reader's OpenAI deltas for auto, a named
function and required, summed into the message a whole answer holds. Then the request side: tools and
tool_choice checked, the forced choices' schemas (vLLM's), and a message's tool fields."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway_svc.errors import RequestError
from gateway_svc.tool_calls import ToolReader, message
from gateway_svc.tool_parsers import PARSERS, Call, parse
from gateway_svc.tools import check_tools, message_fields, plan, required_schema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARIS = Call("get_weather", '{"city": "Paris"}')


def _streamed(name: str, text: str, cut: int) -> list:
    """``text`` fed in pieces of ``cut`` characters, adjacent content joined."""
    p = PARSERS[name]()
    events = [e for i in range(0, len(text), cut) for e in p.feed(text[i : i + cut])] + p.finish()
    return _joined(events)


def _joined(events: list) -> list:
    out: list = []
    for e in events:
        if isinstance(e, str) and out and isinstance(out[-1], str):
            out[-1] += e
        else:
            out.append(e)
    return out


@pytest.mark.parametrize(
    ("name", "text", "want"),
    [
        ("hermes", f"Let me look.\n{CALL}", ["Let me look.\n", PARIS]),
        ("hermes", f"{CALL}\n{CALL}", [PARIS, "\n", PARIS]),
        ("hermes", "Not needed: 1 < 2 and <tool is not a tag.", ["Not needed: 1 < 2 and <tool is not a tag."]),
        ("hermes", '<tool_call>{"name": "get_time"}', [Call("get_time", "{}")]),  # ended inside the block
        ("hermes", '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>',
         [Call("a", "{}"), Call("b", '{"x": 1}')]),  # SmolLM2's own: a list in one block
        ("hermes", "<tool_call>{'name': 'f'}</tool_call> ok", ["<tool_call>{'name': 'f'}</tool_call> ok"]),
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>', ['<tool_call>{"arguments": {}}</tool_call>']),
        ("llama3_json", ' <|python_tag|>{"name": "get_time", "parameters": {}}', [Call("get_time", "{}")]),
        ("llama3_json", '{"name": "a", "arguments": {"x": "é"}}; {"name": "b", "parameters": {}}',
         [Call("a", '{"x": "é"}'), Call("b", "{}")]),
        ("llama3_json", "Hello {name}", ["Hello {name}"]),
        ("llama3_json", '{"no": "name"}', ['{"no": "name"}']),
        ("pythonic", '[get_weather(city="Paris", unit="c")]', [Call("get_weather", '{"city": "Paris", "unit": "c"}')]),
        ("pythonic", "[f(x)]", ["[f(x)]"]),  # positional: not a call of ours
        ("pythonic", "Sure: [a, b]", ["Sure: [a, b]"]),
    ],
)  # fmt: skip
def test_each_parser_reads_the_same_events_whole_and_streamed_in_every_split(name, text, want):
    assert _joined(parse(name, text)) == want
    for cut in range(1, len(text) + 1):
        assert _streamed(name, text, cut) == want, cut


def test_hermes_never_answers_a_fragment_of_a_tag_as_content():
    p = PARSERS["hermes"]()
    content = "".join(e for ch in f"ok {CALL} done" for e in p.feed(ch) if isinstance(e, str))
    assert content == "ok  done" and "<" not in content
    assert p.feed("<tool_") == [] and p.finish() == ["<tool_"]  # held, then given back at the end


def _deltas(reader: ToolReader, text: str, cut: int) -> list[dict]:
    return [d for i in range(0, len(text), cut) for d in reader.feed(text[i : i + cut])] + reader.finish()


@pytest.mark.parametrize("cut", [1, 3, 1000])
def test_auto_content_and_calls_streamed_add_up_to_the_whole_message(cut):
    text = f"Checking.  \n{CALL}\n\n{CALL}\n"
    whole = message(_deltas(ToolReader("auto"), text, 1000))
    streamed = message(_deltas(ToolReader("auto"), text, cut))
    assert whole["content"] == "Checking." and len(whole["tool_calls"]) == 2
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in whole["tool_calls"]]
    assert streamed["content"] == whole["content"]
    ids = [c["id"] for c in whole["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    only = ToolReader("auto")
    assert message(_deltas(only, f"\n{CALL}\n", cut))["content"] is None and only.finish_reason("stop") == "tool_calls"
    assert only.finish_reason("length") == "length"


def test_without_a_call_auto_gives_the_text_back_exactly():
    text = "  Paris is sunny.\n\nNothing to call. <tool"
    reader = ToolReader("auto")
    assert message(_deltas(reader, text, 2)) == {"role": "assistant", "content": text}
    assert reader.finish_reason("stop") == "stop"


def test_parallel_false_keeps_the_first_call():
    deltas = _deltas(ToolReader("auto", parallel=False), CALL + CALL, 5)
    assert len(message(deltas)["tool_calls"]) == 1


def test_a_named_function_streams_its_arguments_as_they_come():
    reader = ToolReader("function", function="get_weather")
    first, second = reader.feed('{"city": '), reader.feed('"Paris"}')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert second == [{"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
    m = message([*first, *second, *reader.finish()])
    assert m["content"] is None and json.loads(m["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    empty = ToolReader("function", function="get_time")
    assert message(empty.finish())["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}


@pytest.mark.parametrize("cut", [1, 7, 1000])
def test_required_reads_one_call_per_array_item_as_each_completes(cut):
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    reader = ToolReader("required")
    seen = []
    for i in range(0, len(text), cut):
        seen.append(sum(len(d["tool_calls"]) for d in reader.feed(text[i : i + cut])))
    assert sum(seen) == 2 and (cut > 60 or seen.index(1) < len(seen) - 1)  # the first before the end
    reader = ToolReader("required")
    m = message(_deltas(reader, text, cut))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert m["content"] is None and reader.finish_reason("stop") == "tool_calls"
    free = ToolReader("required")  # not an array of calls (no grammar held it): content
    assert message(_deltas(free, "I would call get_weather.", cut)) == {
        "role": "assistant",
        "content": "I would call get_weather.",
    }


def test_the_forced_schemas_are_vllms_and_accept_exactly_the_calls():
    required = json.loads(plan([WEATHER, TIME], "required", None).structured_output().json_schema)
    assert required == required_schema((WEATHER, TIME))
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, required)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    one = json.loads(plan([WEATHER, TIME], "required", False).structured_output().json_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)
    named = plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert json.loads(named.structured_output().json_schema) == WEATHER["function"]["parameters"]
    assert json.loads(plan([TIME], {"type": "function", "function": {"name": "get_time"}}, None)
                      .structured_output().json_schema) == {"type": "object", "properties": {}}  # fmt: skip
    assert plan([WEATHER], "auto", None).structured_output() is None
    assert plan([WEATHER], "none", None).reader() is None


def test_defs_of_the_tools_are_gathered_where_their_references_resolve():
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}
    with_defs = {"type": "function", "function": {"name": "put", "parameters": params}}
    schema = required_schema((with_defs, TIME))
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "put", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "put", "parameters": {"p": "x"}}], schema)
    clash = {"type": "function", "function": {"name": "q", "parameters": {"$defs": {"P": {"type": "string"}}}}}
    with pytest.raises(RequestError) as err:
        required_schema((with_defs, clash))
    assert err.value.param == "tools.1.function.parameters.$defs.P"


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "web_search"}], None, "tools.0.type"),
        ([{"type": "function", "function": {"name": ""}}], None, "tools.0.function.name"),
        ([WEATHER, WEATHER], None, "tools.1.function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools.0.function.parameters"),
        ([{"type": "function", "function": {"name": "f", "x": 1}}], None, "tools.0.function.x"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        ([WEATHER], {"type": "allowed_tools", "allowed_tools": {}}, "tool_choice"),
        (None, "auto", "tool_choice"),
        ([], {"type": "function", "function": {"name": "get_weather"}}, "tool_choice.function.name"),
    ],
)
def test_bad_tools_and_tool_choices_are_400s_naming_the_field(tools, choice, param):
    with pytest.raises(RequestError) as err:
        plan(tools, choice, None)
    assert err.value.param == param


def test_a_forced_choice_takes_no_other_grammar_and_no_tools_is_no_plan():
    from specmesh.params import StructuredOutput

    with pytest.raises(RequestError) as err:
        plan([WEATHER], "required", None, grammar=StructuredOutput(json_object=True))
    assert err.value.param == "tool_choice"
    assert plan([WEATHER], "auto", None, grammar=StructuredOutput(regex="x")).choice == "auto"
    assert plan(None, None, False) is None and plan([], "none", None) is None and check_tools(None) == ()


def test_message_tool_fields():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert message_fields("assistant", 0, [call], None, None) == {"tool_calls": [call]}
    assert message_fields("tool", 1, None, "call_1", "f") == {"tool_call_id": "call_1", "name": "f"}
    for role, calls, param in (
        ("assistant", [{"type": "function", "function": {"arguments": "{}"}}], "messages.0.tool_calls.0.function.name"),
        ("assistant", [{"type": "function", "function": {"name": "f", "arguments": {}}}],
         "messages.0.tool_calls.0.function.arguments"),
        ("assistant", [{"type": "custom", "custom": {}}], "messages.0.tool_calls.0"),
        ("tool", None, "messages.0.tool_call_id"),
    ):  # fmt: skip
        with pytest.raises(RequestError) as err:
            message_fields(role, 0, calls, None, None)
        assert err.value.param == param
