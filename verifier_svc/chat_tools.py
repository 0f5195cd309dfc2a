"""A chat with tools, tool calls and tool results, as the model's chat template is given it.

``ChatMessages`` carries OpenAI's shapes: assistant messages with ``tool_calls``, ``tool`` messages
answering one (``tool_call_id``, ``name``), and the tools as a JSON array (``tools_json``). A template
that uses tools (it names the ``tools`` variable, as Qwen2.5's, Llama 3.1's, Hermes 2 Pro's do)
receives them as transformers' chat templates expect: OpenAI-shaped message dicts whose calls'
``arguments`` are parsed to objects, and ``tools=``. A template that does not (SmolLM2's is plain
ChatML) receives plain role/content messages in the **Hermes format** (Qwen2.5's rendering, the
Hermes models' format; SmolLM2-1.7B-Instruct's is a close variant): a system block listing the
tools in ``<tools></tools>`` and how to call one, each call written into the assistant's content as
``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``, consecutive tool results in one user
turn, each in ``<tool_response></tool_response>``. A chat without any of these renders as before.

Pure functions of the wire message; bad input raises ``ChatError`` naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from specmesh.v1 import generation_pb2

HERMES_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_INSTRUCTION = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


class ChatError(ValueError):
    """A chat the template cannot be given: ``field`` says which part of the request to fix."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def tools_of(tools_json: str) -> list[dict[str, Any]]:
    """The tools of ``ChatMessages.tools_json`` (empty: none).

    >>> tools_of('[{"type": "function", "function": {"name": "f"}}]')[0]["function"]["name"]
    'f'
    >>> tools_of("")
    []
    >>> tools_of('{"type": "function"}')
    Traceback (most recent call last):
    verifier_svc.chat_tools.ChatError: input.chat.tools_json: must be a JSON array of tool objects
    """
    if not tools_json:
        return []
    try:
        tools = json.loads(tools_json)
    except ValueError as exc:
        raise ChatError("input.chat.tools_json", f"not valid JSON: {exc}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ChatError("input.chat.tools_json", "must be a JSON array of tool objects")
    return tools


def message_dicts(chat: generation_pb2.ChatMessages) -> list[dict[str, Any]]:
    """The messages in OpenAI's shape, as transformers' chat templates read them: an assistant's
    ``tool_calls`` as ``{"id", "type": "function", "function": {"name", "arguments"}}`` with the
    arguments parsed from their JSON text, a tool message's ``tool_call_id`` and ``name``. Fields
    left empty are left out, so a plain chat is ``[{"role", "content"}]`` as before.

    >>> m = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="assistant",
    ...     tool_calls=[generation_pb2.ToolCall(id="c1", name="f", arguments='{"x": 1}')])])
    >>> message_dicts(m)[0]["tool_calls"]
    [{'id': 'c1', 'type': 'function', 'function': {'name': 'f', 'arguments': {'x': 1}}}]
    """
    out = []
    for i, m in enumerate(chat.messages):
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        where = f"input.chat.messages.{i}"
        if m.tool_calls:
            if m.role != "assistant":
                raise ChatError(f"{where}.tool_calls", f"only assistant messages carry tool calls, not {m.role!r}")
            d["tool_calls"] = [_call(f"{where}.tool_calls.{j}", c) for j, c in enumerate(m.tool_calls)]
        for name in ("tool_call_id", "name"):
            if getattr(m, name):
                if m.role != "tool":
                    raise ChatError(f"{where}.{name}", f"only tool messages carry {name}, not {m.role!r}")
                d[name] = getattr(m, name)
        out.append(d)
    return out


def _call(where: str, c: generation_pb2.ToolCall) -> dict[str, Any]:
    """One call; arguments that are not JSON (a call cut short at max_tokens, replayed) stay text,
    as OpenAI's API takes any string there."""
    if not c.name:
        raise ChatError(f"{where}.name", "a tool call names its function")
    try:
        arguments = json.loads(c.arguments) if c.arguments.strip() else {}
    except ValueError:
        arguments = c.arguments
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}}


def uses_tools(template: Any) -> bool:
    """Whether a chat template renders tools itself (it names the ``tools`` variable).

    >>> uses_tools("{% for m in messages %}{{ m.content }}{% endfor %}"), uses_tools("{% if tools %}…{% endif %}")
    (False, True)
    >>> uses_tools({"default": "{{ messages }}", "tool_use": "{{ tools }}"}), uses_tools(None)
    (True, False)
    """
    if isinstance(template, dict):
        return any(uses_tools(t) for t in template.values())
    return isinstance(template, str) and "tools" in template


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, str]]:
    """OpenAI-shaped messages (``message_dicts``) and tools as plain role/content messages in the
    Hermes format, for a template that knows nothing of tools.

    >>> tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    >>> call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    >>> out = hermes_messages([{"role": "user", "content": "1+?"},
    ...     {"role": "assistant", "content": "", "tool_calls": [call]},
    ...     {"role": "tool", "content": "2", "tool_call_id": "c1"}], [tool])
    >>> print(out[0]["content"])  # doctest: +NORMALIZE_WHITESPACE
    # Tools
    <BLANKLINE>
    You may call one or more functions to assist with the user query.
    <BLANKLINE>
    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    </tools>
    <BLANKLINE>
    For each function call, return a json object with function name and arguments within
    <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>
    >>> for m in out[1:]:
    ...     print(f"{m['role']}: {m['content']}")
    user: 1+?
    assistant: <tool_call>
    {"name": "add", "arguments": {"a": 1}}
    </tool_call>
    user: <tool_response>
    2
    </tool_response>
    """
    out: list[dict[str, str]] = []
    rest = messages
    if tools:
        listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        block = f"{HERMES_PREAMBLE}{listing}\n{HERMES_INSTRUCTION}"
        if messages and messages[0]["role"] == "system":
            block, rest = f"{messages[0]['content']}\n\n{block}", messages[1:]
        out.append({"role": "system", "content": block})
    previous = ""
    for m in rest:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous == "tool":  # consecutive results: one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        elif m.get("tool_calls"):
            calls = "\n".join(_hermes_call(c["function"]) for c in m["tool_calls"])
            out.append({"role": m["role"], "content": f"{m['content']}\n{calls}" if m["content"] else calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
        previous = m["role"]
    return out


def _hermes_call(function: dict[str, Any]) -> str:
    """A call as the model would have written it (arguments that are not JSON: as they were).

    >>> print(_hermes_call({"name": "f", "arguments": '{"x": '}))
    <tool_call>
    {"name": "f", "arguments": {"x": }
    </tool_call>
    """
    args = function["arguments"]
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    name = json.dumps(function["name"], ensure_ascii=False)
    return f'<tool_call>\n{{"name": {name}, "arguments": {args}}}\n</tool_call>'


def template_inputs(
    chat: generation_pb2.ChatMessages, template: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """What ``apply_chat_template`` is given for ``chat`` under chat template ``template``: the
    messages and the ``tools=`` argument (None: none). A chat with no tools, calls or results gives
    ``[{"role", "content"}]`` whatever the template.

    >>> chat = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="hi")],
    ...     tools_json='[{"type": "function", "function": {"name": "f"}}]')
    >>> template_inputs(chat, "{{ tools }}")
    ([{'role': 'user', 'content': 'hi'}], [{'type': 'function', 'function': {'name': 'f'}}])
    >>> [m["role"] for m in template_inputs(chat, "{{ messages }}")[0]], template_inputs(chat, "{{ messages }}")[1]
    (['system', 'user'], None)
    """
    tools = tools_of(chat.tools_json)
    messages = message_dicts(chat)
    if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, None
    if uses_tools(template):
        return messages, tools or None
    return hermes_messages(messages, tools), None
