"""Tool calling: a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked and
turned into what the verifier is sent and how its output is read (``ToolPlan``), as vLLM does:

- ``none``: the tools are rendered into the prompt (vLLM's default), calls are never read out of the
  output: it is content.
- ``auto`` (the default with tools): the model decides; calls are read out of its text by the
  ``--tool-call-parser`` of its family (``tool_parsers``).
- ``required``: forced through structured output, the output held to a JSON array (at least one
  item; at most one when ``parallel_tool_calls`` is false) of ``{"name": one tool's name,
  "parameters": that tool's parameters schema}`` objects (vLLM's ``_get_json_schema_from_tools``),
  one call per item.
- a named function (``{"type": "function", "function": {"name": …}}``): forced, the output held to
  that function's parameters schema, and all of it is the call's arguments.

The tools always reach the verifier, which renders them through the model's chat template (or the
Hermes format where the template has no tool support: ``verifier_svc/chat_tools.py``). Also here: an
assistant message's ``tool_calls`` and a tool message's fields, checked (``message_fields``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway_svc.errors import RequestError
from gateway_svc.tool_calls import ToolReader
from gateway_svc.tool_parsers import DEFAULT_PARSER
from specmesh.params import SamplingParams, StructuredOutput

CHOICES = ("none", "auto", "required")
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools: ``choice`` "none", "auto", "required" or "function" (the
    function ``function``), at most one call unless ``parallel``, ``parser`` for auto."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    function: str = ""
    parallel: bool = True
    parser: str = DEFAULT_PARSER

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def structured_output(self) -> StructuredOutput | None:
        """The grammar a forced choice holds the output to (compact JSON, as ``json.dumps`` writes it).

        >>> t = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        >>> ToolPlan((t,), "function", "f").structured_output().json_schema
        '{"type":"object"}'
        >>> ToolPlan((t,), "auto").structured_output() is None
        True
        """
        if self.choice == "function":
            fn = next(t["function"] for t in self.tools if t["function"]["name"] == self.function)
            return StructuredOutput(json_schema=_compact(fn.get("parameters") or _NO_PARAMETERS))
        if self.choice == "required":
            return StructuredOutput(json_schema=_compact(required_schema(self.tools, self.parallel)))
        return None

    def sampling_for(self, base: Callable[[int], SamplingParams]) -> Callable[[int], SamplingParams]:
        """Choice parameters with the forced grammar set."""
        output = self.structured_output()
        if output is None:
            return base
        return lambda choice: dataclasses.replace(base(choice), structured_output=output)

    def reader(self) -> ToolReader | None:
        """A reader of one choice's output (None: ``none``, the output is content)."""
        if self.choice == "none":
            return None
        return ToolReader(self.choice, self.parser, self.function, self.parallel)


def required_schema(tools: tuple[dict[str, Any], ...], parallel: bool = True) -> dict[str, Any]:
    """``tool_choice`` required: an array of calls, each ``{"name", "parameters"}`` of one tool; the
    tools' ``$defs`` gathered at the top, where their ``#/$defs/…`` references resolve.

    >>> t = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    >>> s = required_schema((t,), parallel=False)
    >>> s["minItems"], s["maxItems"], s["items"]["anyOf"][0]["properties"]["name"]
    (1, 1, {'type': 'string', 'enum': ['f']})
    """
    defs: dict[str, Any] = {}
    options = []
    for i, t in enumerate(tools):
        params = dict(t["function"].get("parameters") or _NO_PARAMETERS)
        for name, schema in params.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                param = f"tools.{i}.function.parameters.$defs.{name}"
                raise RequestError(f"{param}: two tools define $defs {name!r} differently", param)
        options.append(
            {
                "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _compact(schema: Any) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def plan(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    parser: str = DEFAULT_PARSER,
    grammar: StructuredOutput | None = None,
) -> ToolPlan | None:
    """The request's ``ToolPlan`` (None: no tools), or a 400 naming the field at fault. ``grammar``:
    the structured output the request asks for otherwise (a forced choice cannot have another).

    >>> t = {"type": "function", "function": {"name": "f"}}
    >>> plan([t], None, None).choice, plan([t], {"type": "function", "function": {"name": "f"}}, False).function
    ('auto', 'f')
    >>> plan([], "none", None) is None
    True
    >>> plan(None, "required", None)
    Traceback (most recent call last):
    gateway_svc.errors.RequestError: tool_choice 'required' needs tools: it is only allowed when tools are specified
    """
    checked = check_tools(tools)
    choice, function = _choice(tool_choice, checked)
    if not checked:
        if choice != "none":
            msg = f"tool_choice {tool_choice!r} needs tools: it is only allowed when tools are specified"
            raise RequestError(msg, "tool_choice")
        return None
    if grammar is not None and choice in ("required", "function"):
        msg = "tool_choice forces the output to tool calls; it cannot be combined with another structured output"
        raise RequestError(f"{msg} (response_format, structured_outputs, guided_*)", "tool_choice")
    return ToolPlan(checked, choice, function, parallel_tool_calls is not False, parser)


def check_tools(tools: list[Any] | None) -> tuple[dict[str, Any], ...]:
    """OpenAI function tools, each ``{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}`` with a name of its own (other tool types are refused).

    >>> check_tools([{"type": "function", "function": {"name": "f", "parameters": []}}])
    Traceback (most recent call last):
    gateway_svc.errors.RequestError: tools.0.function.parameters must be a JSON schema object
    """
    names: set[str] = set()
    for i, t in enumerate(tools or ()):
        where = f"tools.{i}"
        if not isinstance(t, dict):
            raise RequestError(f"{where} must be an object", where)
        if t.get("type") != "function":
            raise RequestError(f"{where}.type must be 'function' (other tool types are not supported)", f"{where}.type")
        _known(where, t, ("type", "function"))
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{where}.function must be an object", f"{where}.function")
        _known(f"{where}.function", fn, ("name", "description", "parameters", "strict"))
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.function.name is required (a non-empty string)", f"{where}.function.name")
        if name in names:
            raise RequestError(f"{where}.function.name {name!r} names two tools", f"{where}.function.name")
        names.add(name)
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                                ("strict", bool, "a boolean")):  # fmt: skip
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise RequestError(f"{where}.function.{key} must be {what}", f"{where}.function.{key}")
    return tuple(tools or ())


def _choice(value: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str]:
    """``tool_choice`` as (choice, function name); unset: auto with tools, none without."""
    if value is None:
        return ("auto" if tools else "none"), ""
    if isinstance(value, str):
        if value not in CHOICES:
            raise RequestError(
                f"tool_choice must be none, auto, required or a named function, got {value!r}", "tool_choice"
            )
        return value, ""
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        msg = 'tool_choice must be none, auto, required or {"type": "function", "function": {"name": …}}'
        raise RequestError(msg, "tool_choice")
    _known("tool_choice", value, ("type", "function"))
    _known("tool_choice.function", value["function"], ("name",))
    name = value["function"].get("name")
    if name not in {t["function"]["name"] for t in tools}:
        raise RequestError(f"tool_choice.function.name {name!r} is not one of the tools", "tool_choice.function.name")
    return "function", name


def message_fields(role: str, index: int, tool_calls: Any, tool_call_id: Any, name: Any) -> dict[str, Any]:
    """A message's tool fields, checked, as the SDK takes them: an assistant's ``tool_calls``
    (OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``), a tool message's
    ``tool_call_id`` (required) and ``name``. Other roles carry none of them (refused by the caller).

    >>> call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    >>> message_fields("assistant", 1, [call], None, None)["tool_calls"][0]["function"]
    {'name': 'f', 'arguments': '{}'}
    >>> message_fields("tool", 2, None, None, None)
    Traceback (most recent call last):
    gateway_svc.errors.RequestError: messages.2.tool_call_id is required: the id of the call this tool message answers
    """
    where = f"messages.{index}"
    out: dict[str, Any] = {}
    if role == "assistant" and tool_calls:
        calls = []
        for j, c in enumerate(tool_calls):
            at = f"{where}.tool_calls.{j}"
            if not isinstance(c, dict) or c.get("type", "function") != "function":
                raise RequestError(f"{at} must be a function call ({{'type': 'function', 'function': …}})", at)
            _known(at, c, ("id", "type", "function"))
            fn = c.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise RequestError(f"{at}.function.name is required (a non-empty string)", f"{at}.function.name")
            _known(f"{at}.function", fn, ("name", "arguments"))
            arguments = "" if fn.get("arguments") is None else fn["arguments"]
            if not isinstance(arguments, str):
                raise RequestError(f"{at}.function.arguments must be a string (JSON text)", f"{at}.function.arguments")
            if not isinstance(c.get("id") or "", str):
                raise RequestError(f"{at}.id must be a string", f"{at}.id")
            calls.append(
                {"id": c.get("id") or "", "type": "function", "function": {"name": fn["name"], "arguments": arguments}}
            )
        out["tool_calls"] = calls
    if role == "tool":
        if not isinstance(tool_call_id, str) or not tool_call_id:
            param = f"{where}.tool_call_id"
            raise RequestError(f"{param} is required: the id of the call this tool message answers", param)
        out["tool_call_id"] = tool_call_id
        if name:
            out["name"] = name
    return out


def _known(param: str, value: dict, names: tuple[str, ...]) -> None:
    if unknown := sorted(set(value) - set(names)):
        raise RequestError(f"Unrecognized request argument supplied: {param}.{unknown[0]}", f"{param}.{unknown[0]}")
