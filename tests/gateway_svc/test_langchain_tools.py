"""LangChain (``langchain-openai``) tool calling against the real gateway in front of a real verifier:
``ChatOpenAI(...).bind_tools([a python function, a pydantic tool], tool_choice=<name or "required">)``
answers an AIMessage with tool calls whose arguments fit the tool, whole and streamed; the test runs
the tool, sends its ToolMessage back, and the model's next turn arrives as a plain AIMessage."""

from __future__ import annotations

import functools
import operator
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from support import langchain_chat

langchain_openai = pytest.importorskip("langchain_openai")

pytestmark = pytest.mark.slow
QUESTION = "What is the weather in Paris right now?"


def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city.

    Args:
        city: the city's name
        unit: the temperature's unit
    """
    return f"21 degrees {unit}, sunny, in {city}"


class GetTime(BaseModel):
    """The time now in a time zone."""

    zone: Literal["UTC", "CET", "PST"] = Field(description="the time zone")


@pytest.fixture(scope="module")
def chat(ngram_gateway):
    return langchain_chat(ngram_gateway, max_tokens=60)


def _run(call: dict):
    """The ToolMessage of one tool call, the tool really run on its arguments."""
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool

    if call["name"] == "get_weather":
        return tool(get_weather).invoke(call)  # a ToolCall in: a ToolMessage out
    zone = GetTime(**call["args"]).zone
    return ToolMessage(content=f"12:00 {zone}", tool_call_id=call["id"], name=call["name"])


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
@pytest.mark.parametrize("tool_choice", ["get_weather", "required"])
def test_bind_tools_calls_a_tool_whose_result_goes_back_for_the_next_turn(chat, tool_choice, stream):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    bound = chat.bind_tools([get_weather, GetTime], tool_choice=tool_choice)
    messages = [HumanMessage(QUESTION)]
    ai = functools.reduce(operator.add, bound.stream(messages)) if stream else bound.invoke(messages)
    assert isinstance(ai, AIMessage) and ai.tool_calls and not ai.invalid_tool_calls, ai
    if tool_choice == "get_weather":
        assert [c["name"] for c in ai.tool_calls] == ["get_weather"]
    results = [_run(c) for c in ai.tool_calls]
    pairs = zip(results, ai.tool_calls, strict=True)
    assert all(isinstance(r, ToolMessage) and r.tool_call_id == c["id"] for r, c in pairs)
    reply = chat.bind_tools([get_weather, GetTime]).invoke([*messages, ai, *results])
    assert isinstance(reply, AIMessage) and reply.content and not reply.tool_calls, reply
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
