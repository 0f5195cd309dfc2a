"""A chat's messages as clients send them: role and content (a string or text parts) are what the
model's chat template sees, and so are an assistant's ``tool_calls`` and a tool message's
``tool_call_id`` and ``name`` (checked by ``gateway_svc.tools.message_fields``). The other fields of
OpenAI's and vLLM's messages are accepted empty (a conversation replayed from earlier responses
carries them as null) and refused, naming the field, when set: the template would never see them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from gateway_svc.errors import RequestError
from gateway_svc.tools import message_fields


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a part's other keys belong to its type (non-text: refused)
    type: str
    text: str | None = None


# A message's fields beyond role and content (OpenAI's and vLLM's).
_MESSAGE_EXTRAS = ("name", "refusal", "tool_calls", "tool_call_id", "function_call", "audio", "annotations",
                   "reasoning", "reasoning_content")  # fmt: skip
_TOOL_FIELDS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}  # what the template sees, by role


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self, index: int) -> str:
        """The content as the template sees it (message ``index`` of the chat).

        >>> Message(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]).text(0)
        'ab'
        >>> Message(role="user", content="hi", name="al").text(3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        gateway_svc.errors.RequestError: messages.3.name is not supported on a user message: ...
        """
        for name in _MESSAGE_EXTRAS:
            if name not in _TOOL_FIELDS.get(self.role, ()) and getattr(self, name) not in (None, "", []):
                param = f"messages.{index}.{name}"
                why = "the chat template sees role and content (and tool calls and results) only"
                raise RequestError(f"{param} is not supported on a {self.role} message: {why}", param)
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if bad := [p.type for p in self.content if p.type != "text"]:
            raise RequestError(f"content part of type {bad[0]!r} is not supported (text only)", f"messages.{index}")
        return "".join(p.text or "" for p in self.content)

    def chat(self, index: int) -> dict[str, Any]:
        """The message as the SDK sends it: role, content, and its tool fields where set.

        >>> Message(role="tool", content="21 C", tool_call_id="call_1").chat(2)
        {'role': 'tool', 'content': '21 C', 'tool_call_id': 'call_1'}
        """
        text = self.text(index)
        return {
            "role": self.role,
            "content": text,
            **message_fields(self.role, index, self.tool_calls, self.tool_call_id, self.name),
        }
