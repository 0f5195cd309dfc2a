"""OpenAI's Responses API as a view of the chat pipeline: a ``POST /v1/responses`` body becomes the chat
completion it means (``to_chat``), the chat answer a Response (``response_of``) or, streamed, the Responses
event sequence (``ResponseEvents``); ``ResponseStore`` keeps stored responses for ``previous_response_id``.

What maps where:
- ``instructions`` → a system message; ``input`` as a string → one user message; as items: messages
  (``user`` / ``system`` / ``developer`` → system / ``assistant``; content a string or ``input_text`` /
  ``output_text`` parts), ``function_call`` items → the assistant's tool calls, ``function_call_output`` →
  tool messages.
- ``tools`` (function tools) and ``tool_choice``, ``parallel_tool_calls``; ``text.format`` json_schema /
  json_object → structured outputs; ``max_output_tokens``, ``temperature``, ``top_p``, ``user``,
  ``safety_identifier``, ``prompt_cache_key``, ``metadata``, our ``spec_decode``.
- ``store`` (OpenAI's default: true) keeps the conversation and its answer, per API key, for a later
  ``previous_response_id`` (``--response-store`` responses, least recently used dropped first; 0: none).
- Refused with a 400 naming the field, never dropped: non-function tools, image / file / reasoning input
  items, ``reasoning`` with an effort or summary, ``include``, ``background``, ``conversation``,
  ``truncation: auto``, and any field this gateway does not know.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway_svc.errors import RequestError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # json_schema's name, schema, strict, description
    type: Literal["text", "json_schema", "json_object"]


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    conversation: Any = None
    service_tier: str | None = None
    spec_decode: dict[str, Any] | None = None  # ours, as on the other endpoints (extra_body)


def _refuse_unhonoured(req: ResponsesRequest) -> None:
    """A 400 for each field the gateway cannot honour (set to something but its no-op value)."""
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise RequestError("reasoning is not supported: the model serves no reasoning items", "reasoning")
    if req.truncation == "auto":
        raise RequestError("truncation 'auto' is not supported: a prompt over the context is a 400", "truncation")
    if req.include:
        raise RequestError(f"include is not supported ({req.include[0]!r})", "include")
    if req.background:
        raise RequestError("background responses are not supported", "background")
    if req.conversation is not None:
        raise RequestError("conversation is not supported: use previous_response_id", "conversation")
    if req.service_tier not in (None, "auto", "default"):
        raise RequestError(f"service_tier {req.service_tier!r} is not supported", "service_tier")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise RequestError("text.verbosity is not supported", "text.verbosity")


def _content_text(content: Any, param: str) -> str:
    """A message item's content as text: a string, or input_text / output_text parts.

    >>> _content_text([{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}], "input.0")
    'ab'
    """
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content or ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise RequestError(f"{param}.content.{j}: a part of type {kind!r} is not supported (text only)", param)
        out.append(str(part.get("text", "")))
    return "".join(out)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``input`` as chat messages (calls made by the assistant join its message, in order).

    >>> input_messages([{"role": "user", "content": "Weather?"},
    ...     {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
    ...     {"type": "function_call_output", "call_id": "c1", "output": "21 C"}])  # doctest: +NORMALIZE_WHITESPACE
    [{'role': 'user', 'content': 'Weather?'},
     {'role': 'assistant', 'content': '', 'tool_calls': [{'id': 'c1', 'type': 'function',
       'function': {'name': 'w', 'arguments': '{}'}}]},
     {'role': 'tool', 'tool_call_id': 'c1', 'content': '21 C'}]
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        param = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{param}.role: {role!r} is not a message role here", f"{param}.role")
            text = _content_text(item.get("content"), param)
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments", "")}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, param)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        else:
            why = "messages, function_call and function_call_output items only"
            raise RequestError(f"{param}: an input item of type {kind!r} is not supported ({why})", param)
    return out


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise RequestError(
                f"tools.{i}.type: {t.get('type')!r} tools are not supported (function only)", f"tools.{i}.type"
            )
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """``{"type": "function", "name": n}`` → the chat form; the strings as they are.

    >>> _tool_choice({"type": "function", "name": "f"}), _tool_choice("required")
    ({'type': 'function', 'function': {'name': 'f'}}, 'required')
    """
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not choice.get("name"):
        raise RequestError(
            f"tool_choice: {choice!r} is not supported (auto, none, required or a function)", "tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion body ``req`` means, after ``history`` (a previous response's conversation).

    >>> body = to_chat(ResponsesRequest(model="m", input="hi", instructions="Be brief.", max_output_tokens=9,
    ...     text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}), [])
    >>> [m["role"] for m in body["messages"]], body["max_tokens"], body["response_format"]["json_schema"]["name"]
    (['system', 'user'], 9, 'x')
    """
    _refuse_unhonoured(req)
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    # A stored conversation keeps its own instructions out: each response's instructions are its own.
    messages += [m for m in history if m["role"] != "system"] if req.instructions else history
    messages += input_messages(req.input)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "metadata", "user", "safety_identifier",
                 "prompt_cache_key", "spec_decode"):  # fmt: skip
        if (value := getattr(req, name)) is not None:
            body[name] = value
    if req.tools:
        body["tools"] = _tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        extra = fmt.model_extra or {}
        spec = {k: extra[k] for k in ("name", "schema", "strict", "description") if k in extra}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    return body


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any]:
    """The Responses usage from the chat usage.

    >>> u = usage_of({"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}})
    >>> u["input_tokens"], u["input_tokens_details"], u["total_tokens"]
    (10, {'cached_tokens': 4}, 13)
    """
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def text_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part] if text or status == "completed" else [],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_body(
    rid: str, req: ResponsesRequest, output: list[dict[str, Any]], status: str, usage: Any, finish: str | None
) -> dict[str, Any]:
    """A Response object (``status`` in_progress / completed / incomplete)."""
    fmt = req.text.format.model_dump() if req.text is not None and req.text.format is not None else {"type": "text"}
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store is not False,
        "temperature": req.temperature,
        "text": {"format": fmt},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def response_of(chat: dict[str, Any], rid: str, req: ResponsesRequest) -> dict[str, Any]:
    """A whole chat completion (one choice) as a Response."""
    choice = chat["choices"][0]
    msg = choice["message"]
    suffix = rid.removeprefix("resp_")
    output = [text_item(f"msg_{suffix}", msg["content"])] if msg.get("content") else []
    for k, call in enumerate(msg.get("tool_calls") or ()):
        output.append(
            call_item(f"fc_{suffix}_{k}", call["id"], call["function"]["name"], call["function"]["arguments"])
        )
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    body = response_body(rid, req, output, status, usage_of(chat.get("usage")), choice.get("finish_reason"))
    return {**body, "metrics": chat.get("metrics", {})}


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a later turn sees (what ``store`` keeps)."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"role": "assistant", "content": "".join(p.get("text", "") for p in item["content"])})
        else:
            items.append(
                {
                    "type": "function_call",
                    "call_id": item["call_id"],
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
    return input_messages([i if "type" in i else {"type": "message", **i} for i in items])


class ResponseStore:
    """Stored responses' conversations, per API key (tenant), the least recently used dropped past ``size``.

    >>> s = ResponseStore(1); s.put(None, "resp_a", [{"role": "user", "content": "hi"}]); s.put(None, "resp_b", [])
    >>> s.get(None, "resp_a") is None, s.get(None, "resp_b"), s.get("other-key", "resp_b") is None
    (True, [], True)
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[tuple[str | None, str], list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, tenant: str | None, rid: str, conversation: list[dict[str, Any]]) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[(tenant, rid)] = conversation
            self._items.move_to_end((tenant, rid))
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, tenant: str | None, rid: str) -> list[dict[str, Any]] | None:
        with self._lock:
            found = self._items.get((tenant, rid))
            if found is not None:
                self._items.move_to_end((tenant, rid))
            return found


def event(kind: str, data: dict[str, Any], sequence: int) -> bytes:
    """One server-sent event of the Responses stream.

    >>> event("response.completed", {"n": 1}, 3)
    b'event: response.completed\\ndata: {"type":"response.completed","n":1,"sequence_number":3}\\n\\n'
    """
    payload = json.dumps({"type": kind, **data, "sequence_number": sequence}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n".encode()


class ResponseEvents:
    """The chat stream's chunks → the Responses event sequence: ``response.created``,
    ``response.in_progress``; per output item ``response.output_item.added``, for a message
    ``response.content_part.added``, ``response.output_text.delta``…, ``.done``s, for a call
    ``response.function_call_arguments.delta``… and ``.done``; ``response.output_item.done``; then
    ``response.completed`` (or ``response.incomplete``, or ``response.failed`` on an error)."""

    def __init__(self, rid: str, req: ResponsesRequest) -> None:
        self.rid, self.req = rid, req
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.metrics: dict[str, Any] = {}
        self.started = False

    def _ev(self, kind: str, data: dict[str, Any]) -> bytes:
        self.seq += 1
        return event(kind, data, self.seq - 1)

    def _response(self, status: str) -> dict[str, Any]:
        usage = usage_of(self.usage) if status != "in_progress" else None
        return response_body(self.rid, self.req, list(self.output), status, usage, self.finish)

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if not self.started:
            self.started = True
            out += [self._ev("response.created", {"response": self._response("in_progress")}),
                    self._ev("response.in_progress", {"response": self._response("in_progress")})]  # fmt: skip
        if "error" in chunk:
            err = chunk["error"]
            failed = {
                **self._response("failed"),
                "error": {"code": err.get("code") or "server_error", "message": err.get("message", "")},
            }
            return [*out, self._ev("response.failed", {"response": failed})]
        if chunk.get("usage"):
            self.usage, self.metrics = chunk["usage"], chunk.get("metrics", {})
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if text := delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._close()
                    item_id = f"msg_{self.rid.removeprefix('resp_')}_{len(self.output)}"
                    self.open = text_item(item_id, "", "in_progress")
                    self.open["_text"] = ""
                    out.append(
                        self._ev(
                            "response.output_item.added", {"output_index": len(self.output), "item": _public(self.open)}
                        )
                    )
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    out.append(
                        self._ev("response.content_part.added", {**self._where(), "content_index": 0, "part": part})
                    )
                self.open["_text"] += text
                out.append(
                    self._ev(
                        "response.output_text.delta",
                        {**self._where(), "content_index": 0, "delta": text, "logprobs": []},
                    )
                )
            for call in delta.get("tool_calls") or ():
                f = call.get("function") or {}
                if call.get("id"):
                    out += self._close()
                    item_id = f"fc_{self.rid.removeprefix('resp_')}_{len(self.output)}"
                    self.open = call_item(item_id, call["id"], f.get("name", ""), "", "in_progress")
                    out.append(
                        self._ev(
                            "response.output_item.added", {"output_index": len(self.output), "item": _public(self.open)}
                        )
                    )
                if args := f.get("arguments"):
                    assert self.open is not None
                    self.open["arguments"] += args
                    out.append(self._ev("response.function_call_arguments.delta", {**self._where(), "delta": args}))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.output)}
        out = []
        if item["type"] == "message":
            text = item.pop("_text")
            done = text_item(item["id"], text)
            part = done["content"][0]
            out.append(
                self._ev("response.output_text.done", {**where, "content_index": 0, "text": text, "logprobs": []})
            )
            out.append(self._ev("response.content_part.done", {**where, "content_index": 0, "part": part}))
        else:
            done = {**item, "status": "completed"}
            out.append(
                self._ev(
                    "response.function_call_arguments.done",
                    {**where, "name": item["name"], "arguments": item["arguments"]},
                )
            )
        out.append(self._ev("response.output_item.done", {"output_index": len(self.output), "item": done}))
        self.output.append(done)
        return out

    def done(self) -> list[bytes]:
        out = self._close()
        status = "incomplete" if self.finish == "length" else "completed"
        final = {**self._response(status), "metrics": self.metrics}
        return [*out, self._ev(f"response.{status}", {"response": final})]


def _public(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if not k.startswith("_")}
