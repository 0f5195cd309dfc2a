"""Tool calls read out of a model's text (``tool_choice`` auto), one parser per model family's format.

A parser is fed the text as it streams and answers, in order, the text that is content and each tool
call once it is complete (``Call``); ``finish`` resolves what it held back. Text that may still turn
out to be a call (the start of a ``<tool_call>`` tag, a JSON object not yet closed) is held, so no
fragment of a call's markup is ever answered as content; text that turns out not to be one is
answered as content after all, so an output without calls comes back exactly as the model wrote it.
A whole response is the same parser fed once (``parse``): streamed and whole answers agree.

- ``hermes`` (the default): ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`` blocks, text
  outside them is content; a last block the output ended inside (no closing tag) is read too, as
  vLLM's. A block holding a JSON list of calls (SmolLM2-1.7B-Instruct's variant) gives each. What
  the verifier's Hermes rendering asks for (``verifier_svc/chat_tools.py``), and what Qwen2.5 and
  Hermes 2/3 write.
- ``llama3_json``: an output that is JSON objects ``{"name": …, "parameters": {…}}`` (or
  ``"arguments"``), separated by ``;``, optionally after ``<|python_tag|>``: Llama 3.1 / 3.2's JSON
  tool calls. An output that starts with anything else is content.
- ``pythonic``: an output that is a Python list of calls, ``[get_weather(city="Paris"), …]``
  (keyword arguments, literal values): Llama 3.2 / 4's and ToolACE's. Anything else is content.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Call:
    """A complete tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


Event = str | Call  # content text, or a call


class ToolCallParser(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def _arguments(value: Any) -> str | None:
    """Arguments as JSON text: a decoded value as ``json.dumps`` writes it; JSON text as it is
    (None: text that is not JSON)."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return None
        return value
    return json.dumps(value, ensure_ascii=False)


def _call(obj: Any, *keys: str) -> Call | None:
    """A call from a decoded ``{"name": …, <key>: {…}}`` object (the first of ``keys`` present)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    arguments = _arguments(args)
    return None if arguments is None else Call(obj["name"], arguments)


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag``.

    >>> _held("hi <tool", "<tool_call>"), _held("hi", "<tool_call>"), _held("<", "<tool_call>")
    (5, 0, 1)
    """
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks among content.

    >>> p = HermesParser()
    >>> p.feed('Sure.<tool_'), p.feed('call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>'), p.finish()
    (['Sure.'], [Call(name='f', arguments='{"x": 1}')], [])
    >>> parse("hermes", "a <tool_call>not json</tool_call> b <tool")
    ['a ', '<tool_call>not json</tool_call>', ' b ', '<tool']
    """

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._in_call:
                end = self._buf.find(self.END)
                if end < 0:
                    return out
                out.extend(self._block(self._buf[:end], closed=True))
                self._buf, self._in_call = self._buf[end + len(self.END) :], False
                continue
            start = self._buf.find(self.START)
            if start >= 0:
                if start:
                    out.append(self._buf[:start])
                self._buf, self._in_call = self._buf[start + len(self.START) :], True
                continue
            keep = _held(self._buf, self.START)
            if len(self._buf) > keep:
                out.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
            return out

    def finish(self) -> list[Event]:
        rest, in_call = self._buf, self._in_call
        self._buf, self._in_call = "", False
        if in_call:  # the output ended inside a block
            return self._block(rest, closed=False)
        return [rest] if rest else []

    def _block(self, body: str, closed: bool) -> list[Event]:
        raw = [self.START + body + (self.END if closed else "")]
        try:
            obj = json.loads(body)
        except ValueError:
            return raw  # not a call after all: content
        objs = obj if isinstance(obj, list) else [obj]
        calls = [_call(o, "arguments", "parameters") for o in objs]
        return raw if not calls or None in calls else calls  # type: ignore[return-value]


class _WholeOutputParser:
    """Formats where the whole output is the calls: decided by its first characters (``_starts``).
    Calls are held to the end of the output and read then (``_calls``: the calls, or None where the
    text is not calls after all: then it is content); any other output streams as content."""

    def __init__(self) -> None:
        self._buf = ""
        self._mode = ""  # "": undecided; "calls"; "content"

    def _starts(self, text: str) -> bool | None:
        """Whether text (no leading whitespace, not empty) starts calls; None: cannot tell yet."""
        raise NotImplementedError

    def _calls(self, text: str) -> list[Call] | None:
        raise NotImplementedError

    def feed(self, text: str) -> list[Event]:
        if self._mode == "content":
            return [text] if text else []
        self._buf += text
        if not self._mode:
            head = self._buf.lstrip()
            starts = self._starts(head) if head else None
            if starts is None:
                return []
            self._mode = "calls" if starts else "content"
            if not starts:
                out, self._buf = self._buf, ""
                return [out]
        return []

    def finish(self) -> list[Event]:
        text, mode = self._buf, self._mode
        self._buf, self._mode = "", ""
        if not text:
            return []
        calls = self._calls(text.strip()) if mode == "calls" else None
        return calls if calls else [text]  # type: ignore[return-value]


class Llama3JsonParser(_WholeOutputParser):
    """Llama 3.1 / 3.2 JSON calls: ``{"name": …, "parameters": {…}}``, several separated by ``;``.

    >>> parse("llama3_json", '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')
    [Call(name='f', arguments='{"x": 1}'), Call(name='g', arguments='{}')]
    >>> parse("llama3_json", "The answer is {1}."), parse("llama3_json", '{"name": "f", "para')
    (['The answer is {1}.'], ['{"name": "f", "para'])
    """

    TAG = "<|python_tag|>"

    def _starts(self, text: str) -> bool | None:
        if text.startswith(("{", self.TAG)):
            return True
        return None if self.TAG.startswith(text) else False

    def _calls(self, text: str) -> list[Call] | None:
        text, pos, calls = text.removeprefix(self.TAG), 0, []
        decoder = json.JSONDecoder()
        while True:
            while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
            if pos == len(text):
                return calls or None
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except ValueError:
                return None
            call = _call(obj, "parameters", "arguments")
            if call is None:
                return None
            calls.append(call)


class PythonicParser(_WholeOutputParser):
    """A Python list of calls with keyword arguments of literal values.

    >>> parse("pythonic", '[get_weather(city="Paris", days=2), now()]')
    [Call(name='get_weather', arguments='{"city": "Paris", "days": 2}'), Call(name='now', arguments='{}')]
    >>> parse("pythonic", "[1, 2] are numbers")
    ['[1, 2] are numbers']
    """

    def _starts(self, text: str) -> bool | None:
        return text.startswith("[")

    def _calls(self, text: str) -> list[Call] | None:
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name | ast.Attribute):
                return None
            if any(k.arg is None for k in node.keywords):  # **kwargs
                return None
            try:
                kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                arguments = json.dumps(kwargs, ensure_ascii=False)
            except (ValueError, TypeError, SyntaxError):  # not a literal, or not JSON's (a set, bytes)
                return None
            calls.append(Call(ast.unparse(node.func), arguments))
        return calls


PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
}
DEFAULT_PARSER = "hermes"


def parse(name: str, text: str) -> list[Event]:
    """A whole output through parser ``name``: its content and calls, in order."""
    p = PARSERS[name]()
    return [*p.feed(text), *p.finish()]
