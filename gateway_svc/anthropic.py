"""Anthropic's Messages API as a view of the chat pipeline: a ``POST /v1/messages`` body becomes the
chat completion it means (``to_chat``), and the chat answer becomes a Message (``message_of``) or, streamed,
Anthropic's event sequence (``MessageEvents``); errors take Anthropic's shape (``error_body``).

What maps where:
- ``system`` → a system message; user ``text`` blocks → the user's content; ``tool_result`` blocks → tool
  messages (``tool_use_id`` → ``tool_call_id``; ``is_error`` results say so in their text); assistant
  ``text`` + ``tool_use`` blocks → an assistant message with ``tool_calls`` (``input`` as JSON arguments).
- ``tools`` (``name``, ``description``, ``input_schema``) → function tools; ``tool_choice`` auto / any /
  tool / none → auto / required / that function / none; ``disable_parallel_tool_use`` → at most one call.
- ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (the 2.x client sends these only as extra body
  fields), ``stop_sequences``, ``stream``, ``metadata.user_id`` (→ ``user``), ``output_config.format``
  json_schema (→ structured outputs through the grammar), ``cache_control`` (every prefix is cached
  anyway), and our ``spec_decode`` as on the other endpoints.
- Refused with a 400 naming the field, never dropped: image and document blocks, server tools, ``thinking``,
  ``output_config.effort``, ``service_tier``, ``container`` and any other field this gateway cannot honour.
- The answer: ``stop_reason`` end_turn / max_tokens / stop_sequence (with ``stop_sequence``) / tool_use;
  ``usage.input_tokens`` excludes the prompt tokens read from the prefix cache
  (``cache_read_input_tokens``), as Anthropic counts them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway_svc.errors import ApiError, RequestError

# Anthropic's error types by HTTP status (its ``{"type": "error", "error": {...}}`` shape).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# The same for an error that arrives inside a stream (it carries OpenAI's type, not a status).
_TYPES_FROM_OPENAI = {
    "invalid_request_error": "invalid_request_error",
    "not_found_error": "not_found_error",
    "rate_limit_error": "rate_limit_error",
    "service_unavailable_error": "overloaded_error",
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Block(BaseModel):
    model_config = ConfigDict(extra="allow")  # each type's own fields (text, id, input, tool_use_id …)
    type: str


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None  # a caching hint: the prefix cache needs none


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict):
    user_id: str | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None  # structured outputs: the answer's text follows the schema


class MessagesRequest(_Strict):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # a caching hint: every prefix is cached without one
    thinking: dict[str, Any] | None = None
    spec_decode: dict[str, Any] | None = None  # ours, as on the OpenAI endpoints (extra_body)


def _text_of(blocks: str | list[Block] | list[Any] | None, param: str) -> str:
    """The text of ``content`` given as a string or as text blocks.

    >>> _text_of([Block(type="text", text="a"), Block(type="text", text="b")], "system")
    'ab'
    """
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    out = []
    for j, b in enumerate(blocks):
        block = b if isinstance(b, Block) else Block.model_validate(b)
        if block.type != "text":
            raise RequestError(f"{param}.{j}: a block of type {block.type!r} is not supported here (text only)", param)
        out.append(str(getattr(block, "text", "")))
    return "".join(out)


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The request's conversation as chat messages.

    >>> r = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "system": "Be brief.", "messages": [
    ...     {"role": "user", "content": "Weather in Paris?"},
    ...     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {"c": "Paris"}}]},
    ...     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "21 C"}]}]})
    >>> [m["role"] for m in chat_messages(r)], chat_messages(r)[2]["tool_calls"][0]["function"]["arguments"]
    (['system', 'user', 'assistant', 'tool'], '{"c": "Paris"}')
    """
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(blocks):
            param = f"messages.{i}.content.{j}"
            extra = b.model_extra or {}
            if b.type == "text":
                text.append(str(extra.get("text", "")))
            elif b.type == "tool_use" and m.role == "assistant":
                arguments = json.dumps(extra.get("input", {}), ensure_ascii=False)
                calls.append(
                    {
                        "id": extra.get("id"),
                        "type": "function",
                        "function": {"name": extra.get("name"), "arguments": arguments},
                    }
                )
            elif b.type == "tool_result" and m.role == "user":
                if text:  # the user's words before this result keep their place
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = _text_of(extra.get("content"), f"{param}.content")
                if extra.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": extra.get("tool_use_id"), "content": result})
            else:
                why = "text, tool_use (assistant) and tool_result (user) blocks only"
                raise RequestError(f"{param}: a {m.role} block of type {b.type!r} is not supported ({why})", param)
        if m.role == "assistant":
            out.append({"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})})
        elif text:
            out.append({"role": "user", "content": "".join(text)})
    return out


def to_chat(req: MessagesRequest) -> dict[str, Any]:
    """The chat completion body ``req`` means (``ChatCompletionRequest`` validates it).

    >>> body = to_chat(MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "top_k": 5,
    ...     "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["\\n\\n"],
    ...     "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    ...     "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}))
    >>> body["tool_choice"], body["parallel_tool_calls"], body["stop"], body["top_k"], body["tools"][0]["type"]
    ('required', False, ['\\n\\n'], 5, 'function')
    """
    if req.thinking is not None:
        raise RequestError("thinking is not supported: the model serves no reasoning blocks", "thinking")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_tokens": req.max_tokens,
        "stream": req.stream,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for name in ("temperature", "top_p", "top_k", "spec_decode"):
        if (value := getattr(req, name)) is not None:
            body[name] = value
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.metadata is not None and req.metadata.user_id:
        body["user"] = req.metadata.user_id
    if req.output_config is not None and req.output_config.format is not None:
        schema = req.output_config.format.schema_
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    if (choice := req.tool_choice) is not None:
        if choice.type == "tool":
            if not choice.name:
                raise RequestError("tool_choice.name is required when tool_choice.type is 'tool'", "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return body


def usage_of(usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage from the chat usage: input tokens not read from the cache, cache reads apart.

    >>> usage_of({"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}})
    {'input_tokens': 6, 'output_tokens': 3, 'cache_read_input_tokens': 4, 'cache_creation_input_tokens': 0}
    """
    usage = usage or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": int(usage.get("prompt_tokens", 0)) - cached,
        "output_tokens": int(usage.get("completion_tokens", 0)),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def stop_of(finish_reason: str | None, stop_string: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat choice's finish.

    >>> stop_of("stop", None), stop_of("stop", "##"), stop_of("length", None), stop_of("tool_calls", None)
    (('end_turn', None), ('stop_sequence', '##'), ('max_tokens', None), ('tool_use', None))
    """
    if finish_reason == "stop" and stop_string:
        return "stop_sequence", stop_string
    return _STOP_REASONS.get(finish_reason or "", "end_turn"), None


def message_of(chat: dict[str, Any], model: str) -> dict[str, Any]:
    """A whole chat completion (one choice) as a Message."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = [{"type": "text", "text": msg["content"]}] if msg.get("content") else []
    for call in msg.get("tool_calls") or ():
        f = call["function"]
        content.append(
            {"type": "tool_use", "id": call["id"], "name": f["name"], "input": json.loads(f["arguments"] or "{}")}
        )
    reason, sequence = stop_of(choice.get("finish_reason"), choice.get("stop_reason"))
    return {
        "id": "msg_" + chat["id"].removeprefix("chatcmpl-"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_of(chat.get("usage")),
        "metrics": chat.get("metrics", {}),
    }


def error_body(err: ApiError) -> dict[str, Any]:
    """``err`` in Anthropic's error shape.

    >>> error_body(ApiError(429, "busy"))
    {'type': 'error', 'error': {'type': 'rate_limit_error', 'message': 'busy'}}
    """
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def event(kind: str, data: dict[str, Any]) -> bytes:
    """One server-sent event of the Messages stream.

    >>> event("message_stop", {})
    b'event: message_stop\\ndata: {"type":"message_stop"}\\n\\n'
    """
    payload = json.dumps({"type": kind, **data}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n".encode()


class MessageEvents:
    """The chat stream's chunks (parsed ``data:`` payloads, in order) → the Messages stream's events:
    ``message_start``; per content block ``content_block_start``, its ``text_delta`` / ``input_json_delta``
    deltas, ``content_block_stop``; ``message_delta`` (stop reason, usage); ``message_stop``; an ``error``
    event where the chat stream carried one."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.block = -1  # index of the open content block (-1: none yet)
        self.open: str | None = None  # its type
        self.stop: tuple[str, str | None] = ("end_turn", None)
        self.usage: dict[str, Any] | None = None
        self.started = False

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if "error" in chunk:
            err = chunk["error"]
            kind = _TYPES_FROM_OPENAI.get(err.get("type", ""), "api_error")
            return [event("error", {"error": {"type": kind, "message": err.get("message", "")}})]
        if not self.started:
            self.started = True
            message = {
                "id": "msg_" + str(chunk.get("id", "")).removeprefix("chatcmpl-"),
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage_of(None),
            }
            out.append(event("message_start", {"message": message}))
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if text := delta.get("content"):
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(
                    event("content_block_delta", {"index": self.block, "delta": {"type": "text_delta", "text": text}})
                )
            for call in delta.get("tool_calls") or ():
                f = call.get("function") or {}
                if call.get("id"):  # a new call
                    out += self._start({"type": "tool_use", "id": call["id"], "name": f.get("name", ""), "input": {}})
                if args := f.get("arguments"):
                    out.append(
                        event(
                            "content_block_delta",
                            {"index": self.block, "delta": {"type": "input_json_delta", "partial_json": args}},
                        )
                    )
            if choice.get("finish_reason"):
                self.stop = stop_of(choice["finish_reason"], choice.get("stop_reason"))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.block, "delta": delta})

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.block += 1
        self.open = block["type"]
        return [*out, event("content_block_start", {"index": self.block, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.block})]

    def finish(self) -> list[bytes]:
        reason, sequence = self.stop
        usage = usage_of(self.usage)
        return [
            *self._close(),
            event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}),
            event("message_stop", {}),
        ]
