"""Tools, tool calls and tool results rendered for the chat template: the Hermes format for a template
without tools (pure, on tiny inputs, then through the real SmolLM2 tokenizer, Generate's and Tokenize's
rendering alike), the template's own tool support where it has one, and bad input refused by field."""

from __future__ import annotations

import copy
import json

import pytest

from specmesh.params import build_request as client_request
from specmesh.params import build_tokenize_request
from specmesh.v1 import generation_pb2 as g
from verifier_svc.chat_tools import ChatError, hermes_messages, message_dicts, template_inputs
from verifier_svc.requests import InvalidRequest, RequestLimits, build_request, chat_ids
from verifier_svc.tokenization import tokenize

LIMITS = RequestLimits(max_context=8192, vocab_size=49152, max_prompt_bytes=100_000)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "Looking.", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
    {"role": "tool", "content": "21 C", "tool_call_id": "call_1", "name": "get_weather"},
    {"role": "tool", "content": "25 C", "tool_call_id": "call_2"},
]
# What the Hermes rendering gives SmolLM2's ChatML template: Qwen2.5's layout of the same conversation.
HERMES_TEXT = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n<|im_start|>assistant\n"
    'Looking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)
# A template with tool support of its own (in the manner of Llama 3.1's and Qwen2.5's): it reads the
# tools, each call's parsed arguments and the tool messages' fields.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<{{ c.id }} {{ c.function.name }} city={{ c.function.arguments.city }}>"
    "{% endfor %}{% if m.role == 'tool' %}({{ m.tool_call_id }} {{ m.name or '-' }}){% endif %}|{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path())


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    """The same tokenizer with a chat template that renders tools itself."""
    t = copy.deepcopy(tokenizer)
    t.chat_template = TOOL_TEMPLATE
    return t


def _chat(messages=CONVERSATION, tools=(WEATHER,)) -> g.ChatMessages:
    return client_request(list(messages), None, None, True, tools=list(tools)).chat


def test_hermes_puts_the_tools_after_the_system_prompt_calls_in_content_and_results_in_one_user_turn():
    out = hermes_messages(message_dicts(_chat()), [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools\n") and json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"].count("<tool_call>\n{") == 2 and out[2]["content"].startswith("Looking.\n<tool_call>")
    assert out[3]["content"] == "<tool_response>\n21 C\n</tool_response>\n<tool_response>\n25 C\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)


def test_without_tools_a_chat_with_calls_still_renders_them_and_without_either_it_is_unchanged():
    messages, tools = template_inputs(_chat(CONVERSATION[1:], tools=()), "{{ messages }}")
    assert tools is None and messages[0] == {"role": "user", "content": "Weather in Paris and Rome?"}
    assert "<tool_call>" in messages[1]["content"] and messages[2]["role"] == "user"
    plain = _chat([{"role": "user", "content": "hi"}], tools=())
    assert template_inputs(plain, "{{ tools }}") == ([{"role": "user", "content": "hi"}], None)


@pytest.mark.parametrize(
    ("messages", "tools_json", "field"),
    [
        ([{"role": "user", "content": "x"}], "[{", "input.chat.tools_json"),
        ([{"role": "user", "content": "x"}], '{"a": 1}', "input.chat.tools_json"),
        ([{"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": {"name": "", "arguments": "{}"}}]}],
         "", "input.chat.messages.0.tool_calls.0.name"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "", "input.chat.messages.0.tool_calls"),
        ([{"role": "user", "content": "x", "name": "al"}], "", "input.chat.messages.0.name"),
        ([{"role": "assistant", "content": "x", "tool_call_id": "c"}], "", "input.chat.messages.0.tool_call_id"),
    ],
)  # fmt: skip
def test_bad_tools_and_calls_are_refused_naming_the_field(tokenizer, messages, tools_json, field):
    chat = _chat(messages, tools=())
    chat.tools_json = tools_json
    with pytest.raises(ChatError) as pure:
        template_inputs(chat, tokenizer.chat_template)
    with pytest.raises(InvalidRequest) as rpc:
        chat_ids(chat, tokenizer, LIMITS)
    assert pure.value.field == rpc.value.field == field


def test_smollm2s_plain_chatml_template_gets_the_hermes_format(tokenizer):
    ids = chat_ids(_chat(), tokenizer, LIMITS)
    assert tokenizer.decode(ids) == HERMES_TEXT
    assert ids == tokenizer.encode(HERMES_TEXT, add_special_tokens=False)


def test_generate_and_tokenize_render_a_chat_with_tools_alike(tokenizer):
    msg = client_request(CONVERSATION, None, None, True, tools=[WEATHER])
    generated = build_request(msg, tokenizer, LIMITS).prompt_ids
    counted = tokenize(build_tokenize_request(CONVERSATION, True, tools=[WEATHER]), tokenizer, LIMITS)
    assert generated == list(counted.tokens) == chat_ids(_chat(), tokenizer, LIMITS)


def test_a_template_with_tool_support_renders_them_itself_with_parsed_arguments(tool_tokenizer):
    text = tool_tokenizer.decode(chat_ids(_chat(), tool_tokenizer, LIMITS))
    assert text == (
        "TOOLS:get_weather;|[system]Be brief.|[user]Weather in Paris and Rome?|"
        "[assistant]Looking.<call_1 get_weather city=Paris><call_2 get_weather city=Paris>|"
        "[tool]21 C(call_1 get_weather)|[tool]25 C(call_2 -)|[assistant]"
    )


def test_a_tool_call_without_content_is_a_prompt(tokenizer):
    msg = client_request([{"role": "assistant", "content": None, "tool_calls": [CALL]}], None, None, True)
    assert "<tool_call>" in tokenizer.decode(build_request(msg, tokenizer, LIMITS).prompt_ids)


def test_arguments_that_are_not_json_stay_text_as_the_model_wrote_them(tokenizer):
    cut = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Par'}}  # cut at max_tokens
    chat = _chat([{"role": "user", "content": "?"}, {"role": "assistant", "content": None, "tool_calls": [cut]}])
    assert message_dicts(chat)[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'
    text = tokenizer.decode(chat_ids(chat, tokenizer, LIMITS))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}\n</tool_call>' in text
