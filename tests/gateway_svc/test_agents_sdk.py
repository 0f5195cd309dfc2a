"""The OpenAI Agents SDK (``openai-agents``) running an agent with two function tools to completion through
the gateway's ``/v1/responses`` (its default model interface), whole and streamed: the forced first call
runs the tool, its output goes back as a ``function_call_output`` item, and the model's answer ends the
run; streamed and whole runs take the same greedy path."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.slow

NGRAM = {"spec_decode": {"proposer": "ngram"}}


def _agent(url: str, model: str, calls: list):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool
    from openai import AsyncOpenAI

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(("get_weather", city))
        return "21 C and sunny"

    @function_tool
    def get_time(zone: str) -> str:
        """The time now in a time zone."""
        calls.append(("get_time", zone))
        return "14:05"

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    # The first turn must call get_weather; the SDK then resets tool_choice to auto (its default), so the
    # model answers with the tool's output in its context.
    settings = ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60, extra_body=NGRAM)
    return Agent(
        name="assistant",
        instructions="Answer with the tools' help.",
        tools=[get_weather, get_time],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=settings,
    )


def test_an_agent_with_two_tools_runs_to_completion_whole_and_streamed(gateway_url, model):
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export: nothing leaves the machine
    calls: list = []
    agent = _agent(gateway_url, model, calls)

    async def both():  # one event loop: the client's connections belong to it
        whole = await Runner.run(agent, "What is the weather in Paris?", max_turns=6)
        run = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=6)
        events = [e.type async for e in run.stream_events()]
        return whole, run, events

    whole, run, events = asyncio.run(both())
    kinds = [type(i).__name__ for i in whole.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kinds
    assert calls and calls[0][0] == "get_weather" and calls[0][1], calls
    assert isinstance(whole.final_output, str) and whole.final_output
    assert "raw_response_event" in events and "run_item_stream_event" in events
    assert run.final_output == whole.final_output and calls[len(calls) // 2 :] == calls[: len(calls) // 2]


@pytest.fixture(scope="module")
def gateway_url(ngram_gateway) -> str:
    return ngram_gateway.url


@pytest.fixture(scope="module")
def gateway(ngram_gateway):
    return ngram_gateway
