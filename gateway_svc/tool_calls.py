"""A choice's text as OpenAI's tool calls: the deltas a stream sends and the message a whole answer holds.

``ToolReader`` is fed a choice's text as it streams and answers OpenAI's chat deltas: ``{"content"}``
and ``{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments"}}]}`` (a
call's later argument text: ``{"tool_calls": [{"index", "function": {"arguments"}}]}``). A whole
answer is the same reader fed once, its deltas joined (``message``), so streamed and whole answers
agree. Three ways to read, by ``tool_choice``:

- ``auto``: a parser of the model's format (``tool_parsers``) splits content from calls. Whitespace
  around a call is not content (a message of calls only has content null).
- a named function: the whole output is that call's arguments (the verifier held it to the
  function's parameters schema), streamed as it comes.
- ``required``: the output is a JSON array of ``{"name", "parameters"}`` objects (held to its schema,
  ``tools.required_schema``); each object is a call once it is complete. Output that is not such an
  array (a grammar-free run) comes back as content.

``parallel`` false keeps the first call only. Pure: no I/O.
"""

from __future__ import annotations

import json
import secrets

from gateway_svc.tool_parsers import PARSERS, Call


def call_id() -> str:
    """A new tool call id, in OpenAI's form.

    >>> len(call_id()), call_id().startswith("call_")
    (29, True)
    """
    return "call_" + secrets.token_hex(12)


class ToolReader:
    """One choice's text → OpenAI deltas, for ``mode`` "auto" (with ``parser``), "function" (the call
    named ``function``) or "required".

    >>> r = ToolReader("auto", parser="hermes")
    >>> r.feed("Let me check. <tool_call>")
    [{'content': 'Let me check.'}]
    >>> [d["tool_calls"][0]["function"] for d in r.feed('{"name": "f", "arguments": {}}</tool_call>\\n')]
    [{'name': 'f', 'arguments': '{}'}]
    >>> r.finish(), r.finish_reason("stop")
    ([], 'tool_calls')
    """

    def __init__(self, mode: str, parser: str = "hermes", function: str = "", parallel: bool = True) -> None:
        self.mode, self.function, self.parallel = mode, function, parallel
        self._parser = PARSERS[parser]() if mode == "auto" else None
        self._calls = 0
        self._buf, self._pos = "", 0  # required: the array's text and where its next item starts
        self._ws, self._after_call, self._content = "", False, False  # auto: whitespace around calls

    def feed(self, text: str) -> list[dict]:
        if self.mode == "function":
            return self._arguments(text)
        if self.mode == "required":
            self._buf += text
            return self._items()
        return self._events(self._parser.feed(text))

    def finish(self) -> list[dict]:
        """What was held back, at the end of the output."""
        if self.mode == "function":
            return [] if self._calls else self._arguments("", force=True)
        if self.mode == "required":
            out = self._items()
            if not self._calls and self._buf:  # not an array of calls: content
                out.append({"content": self._buf})
            return out
        out = self._events(self._parser.finish())
        if self._ws and (self._content or not self._calls):
            out.append({"content": self._ws})
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` for an output that ended (not cut at the length limit) having made calls."""
        return "tool_calls" if self._calls and reason == "stop" else reason

    def _call(self, call: Call) -> list[dict]:
        if self._calls and not self.parallel:
            return []
        self._calls += 1
        function = {"name": call.name, "arguments": call.arguments}
        return [{"tool_calls": [{"index": self._calls - 1, "id": call_id(), "type": "function", "function": function}]}]

    def _arguments(self, text: str, force: bool = False) -> list[dict]:
        if self._calls:
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []
        return self._call(Call(self.function, text)) if text or force else []

    def _events(self, events: list) -> list[dict]:
        out: list[dict] = []
        for e in events:
            if isinstance(e, Call):
                self._ws, self._after_call = "", True
                out.extend(self._call(e))
                continue
            text = self._ws + (e.lstrip() if self._after_call else e)
            body = text.rstrip()
            self._ws = text[len(body) :]
            if body:
                self._after_call, self._content = False, True
                out.append({"content": body})
        return out

    def _items(self) -> list[dict]:
        """The calls of the array's items completed since the last look (``_pos``: where the next
        item starts once the array has opened; -1: the text is not such an array)."""
        out: list[dict] = []
        text, decoder = self._buf, json.JSONDecoder()
        if self._pos == 0:
            if not (head := text.lstrip()):
                return out
            self._pos = len(text) - len(head) + 1 if head[0] == "[" else -1
        while self._pos >= 0:
            while self._pos < len(text) and (text[self._pos].isspace() or text[self._pos] == ","):
                self._pos += 1
            if self._pos >= len(text) or text[self._pos] == "]":
                break
            try:
                obj, end = decoder.raw_decode(text, self._pos)
            except ValueError:
                break  # not complete yet (or never: then it is content, or dropped after calls)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                self._pos = -1
                break
            self._pos = end
            arguments = obj.get("parameters", obj.get("arguments", {}))
            out.extend(self._call(Call(obj["name"], json.dumps(arguments, ensure_ascii=False))))
        return out


def message(deltas: list[dict]) -> dict:
    """The assistant message that a choice's deltas add up to: its content (null when it made calls
    and wrote nothing else) and its calls.

    >>> message([{"content": "a"}, {"content": "b"}])
    {'role': 'assistant', 'content': 'ab'}
    >>> call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{"}}
    >>> m = message([{"tool_calls": [call]}, {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}])
    >>> m["content"], m["tool_calls"]
    (None, [{'id': 'call_1', 'type': 'function', 'function': {'name': 'f', 'arguments': '{}'}}])
    """
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict] = []
    for d in deltas:
        for c in d.get("tool_calls", ()):
            if c["index"] == len(calls):
                calls.append({"id": c["id"], "type": "function", "function": dict(c["function"])})
            else:
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    if not calls:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content or None, "tool_calls": calls}
