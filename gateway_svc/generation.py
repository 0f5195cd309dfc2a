"""Serving one completion request, chat or text: its choices opened on the verifier, answered as
one JSON body or as an SSE stream.

A stream's first chunk is awaited before the HTTP response starts, so a request the verifier
refuses gets its status (400/429/503…) instead of a 200 followed by an error event; errors after
that arrive as one SSE ``data: {"error": …}`` event before ``[DONE]``. A client that goes away
closes the gRPC streams, and the verifier frees their slots.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterable

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway_svc.auth import tenant_scope
from gateway_svc.choices import Choice, close_choices, merged
from gateway_svc.echo import PromptView, prompt_views
from gateway_svc.errors import from_grpc
from gateway_svc.logprob_shapes import chat_logprobs, completion_logprobs, joined
from gateway_svc.metrics import GatewayMetrics
from gateway_svc.protocol import ChatCompletionRequest, CompletionRequest
from gateway_svc.responses import finish, speculation, usage_of
from gateway_svc.tool_calls import ToolReader, message
from gateway_svc.tools import ToolPlan
from gateway_svc.upstream import Gateway, ModelInfo
from specmesh.params import Prompt, SpecDecodeParams, Summary


def sse(obj: dict | str) -> bytes:
    """One server-sent event.

    >>> sse({"a": "é"})
    b'data: {"a":"\\xc3\\xa9"}\\n\\n'
    >>> sse("[DONE]")
    b'data: [DONE]\\n\\n'
    """
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def chat_chunks(events: AsyncIterator[bytes | str]) -> AsyncIterator[dict | None]:
    """A chat stream's server-sent events (as ``_events`` writes them, one or more per item) as parsed
    chunks, then None for ``[DONE]``: what the Messages and Responses endpoints re-say in their shapes."""
    async for raw in events:
        text = raw.decode() if isinstance(raw, bytes) else raw
        for line in text.splitlines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                yield None if data == "[DONE]" else json.loads(data)


def request_spec(body: ChatCompletionRequest | CompletionRequest, request: Request) -> SpecDecodeParams:
    """The request's SpecDecodeParams; with API keys, its cache scope inside its key's tenant."""
    spec = body.spec()
    tenant = getattr(request.state, "tenant", None)
    return dataclasses.replace(spec, cache_scope=tenant_scope(tenant, spec.cache_scope))


async def generate(
    gw: Gateway,
    body: ChatCompletionRequest | CompletionRequest,
    info: ModelInfo,
    prompts: list[Prompt],
    chat: bool,
    params: dict,
    spec: SpecDecodeParams,
    tools: ToolPlan | None = None,
    endpoint: str | None = None,
) -> Response:
    """Open the request's choices (refusals raise ApiError before any byte is sent) and answer;
    ``tools``: a chat's tool calling (its grammar sent, its calls read out of each choice's text);
    ``endpoint``: the path its metrics count it under (default: the chat or completions one)."""
    m = gw.metrics
    endpoint = endpoint or f"/v1/{'chat/' if chat else ''}completions"
    rid = body.response_id(uuid.uuid4().hex)
    t0 = time.perf_counter()
    m.in_flight.inc()
    try:
        sampling_for = tools.sampling_for(body.sampling_for) if tools else body.sampling_for
        tool_list = list(tools.tools) if tools else None
        choices = await gw.open(prompts, chat, body.n, sampling_for, spec, rid, params, tool_list)
    except BaseException:
        m.in_flight.dec()
        raise
    m.ttft.observe(time.perf_counter() - t0)
    try:
        views = await prompt_views(gw.client, body, prompts, [c.first for c in choices[:: body.n]], params)
    except BaseException:
        await close_choices(choices)
        m.in_flight.dec()
        raise
    head = {"id": rid, "created": int(time.time()), "model": info.name}
    if not body.stream:
        try:
            async for c, item in merged(choices):
                c.take(item)
        except grpc.RpcError as exc:
            raise from_grpc(exc, **params) from None
        finally:
            await close_choices(choices)
            m.in_flight.dec()
        summaries = {c.index: c.summary for c in choices}
        count_summaries(m, summaries.values())
        m.requests.labels(endpoint, "200").inc()
        m.latency.labels(endpoint, "false").observe(time.perf_counter() - t0)
        out = [_choice(c, views[c.index // body.n], body) for c in choices]
        for choice, c in zip(out, choices, strict=True):
            if tools and (reader := tools.reader()) is not None:  # the text as content and tool calls
                choice["message"] = message([*reader.feed(c.text), *reader.finish()])
                choice["finish_reason"] = reader.finish_reason(choice["finish_reason"])
        extra = {"prompt_logprobs": views[0].prompt_logprobs} if chat and body.prompt_logprobs is not None else {}
        return JSONResponse(
            {
                **head,
                "object": "chat.completion" if chat else "text_completion",
                "choices": out,
                "usage": usage_of(summaries, body.n),
                "metrics": {"speculative_decoding": speculation(list(summaries.values()))},
                **extra,
            }
        )
    m.requests.labels(endpoint, "200").inc()
    readers = {c.index: tools.reader() for c in choices} if tools else {}
    stream = _events(m, choices, views, head, body, params, endpoint, t0, readers)
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _choice(c: Choice, view: PromptView, body: ChatCompletionRequest | CompletionRequest) -> dict:
    """One choice of a whole (non-streamed) response; completions echo the prompt's text (and logprobs)."""
    choice: dict = {"index": c.index, **finish(c.summary)}
    if isinstance(body, ChatCompletionRequest):
        choice["message"] = {"role": "assistant", "content": c.text}
        choice["logprobs"] = chat_logprobs(c.logprobs) if body.wants_logprobs else None
        return choice
    choice["text"] = view.text + c.text
    logprobs = None
    if body.wants_logprobs:
        logprobs = completion_logprobs(c.logprobs, len(view.text))
        if view.logprobs is not None:
            logprobs = joined(view.logprobs, logprobs)
    choice["logprobs"] = logprobs
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = view.prompt_logprobs
    return choice


async def _events(
    m: GatewayMetrics,
    choices: list[Choice],
    views: list[PromptView],
    head: dict,
    body: ChatCompletionRequest | CompletionRequest,
    params: dict,
    endpoint: str,
    t0: float,
    readers: dict[int, ToolReader | None],
) -> AsyncIterator[bytes]:
    chat, want_logprobs, n = isinstance(body, ChatCompletionRequest), body.wants_logprobs, body.n
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if body.include_usage else {}
    continuous = body.include_usage and body.continuous_usage  # vLLM's: each chunk its choice's usage so far

    def event(choice: dict, c: Choice) -> bytes:
        return sse({**head, "object": obj, "choices": [choice], **({"usage": c.usage()} if continuous else extra)})

    last = {c.index: t0 for c in choices}
    offsets = dict.fromkeys(last, 0)
    finished = False
    try:
        for c in choices:
            if chat:
                delta = {"role": "assistant", "content": ""}
                yield event({"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}, c)
            elif text := views[c.index // n].text:  # echo: the prompt is the first text
                lp = views[c.index // n].logprobs if want_logprobs else None
                yield event({"index": c.index, "text": text, "logprobs": lp, "finish_reason": None}, c)
                offsets[c.index] = len(text)
        async for c, item in merged(choices):
            c.take(item)
            reader = readers.get(c.index)
            if isinstance(item, Summary):
                fin = {"index": c.index, **finish(item)}
                if reader is not None:  # what the tool-call reader held back, then its finish reason
                    for delta in reader.finish():
                        yield event({"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}, c)
                    fin["finish_reason"] = reader.finish_reason(fin["finish_reason"])
                fin.update({"delta": {}, "logprobs": None} if chat else {"text": "", "logprobs": None})
                yield event(fin, c)
                continue
            now = time.perf_counter()
            if item.token_ids and last[c.index] != t0:
                m.tokens_between(now - last[c.index], len(item.token_ids))
            last[c.index] = now
            if not item.text and not (want_logprobs and item.logprobs):
                continue  # held-back text (a stop string's prefix, a partial character): nothing to show
            lp = None
            if want_logprobs and item.logprobs:
                lp = chat_logprobs(item.logprobs) if chat else completion_logprobs(item.logprobs, offsets[c.index])
            offsets[c.index] += len(item.text)
            if reader is not None:  # content and tool-call deltas (none yet: the logprobs alone)
                for k, delta in enumerate(reader.feed(item.text) or ([{}] if lp else [])):
                    yield event(
                        {"index": c.index, "delta": delta, "logprobs": None if k else lp, "finish_reason": None}, c
                    )
            elif chat:
                yield event(
                    {"index": c.index, "delta": {"content": item.text}, "logprobs": lp, "finish_reason": None}, c
                )
            else:
                yield event({"index": c.index, "text": item.text, "logprobs": lp, "finish_reason": None}, c)
        summaries = {c.index: c.summary for c in choices}
        count_summaries(m, summaries.values())
        if body.include_usage:
            yield sse(
                {
                    **head,
                    "object": obj,
                    "choices": [],
                    "usage": usage_of(summaries, n),
                    "metrics": {"speculative_decoding": speculation(list(summaries.values()))},
                }
            )
        finished = True
    except grpc.RpcError as exc:  # after the 200: the error travels in the stream
        yield sse(from_grpc(exc, **params).body())
        finished = True
    finally:
        await close_choices(choices)
        m.in_flight.dec()
        m.latency.labels(endpoint, "true").observe(time.perf_counter() - t0)
        if not finished:
            m.disconnects.inc()
    yield sse("[DONE]")


def count_summaries(m: GatewayMetrics, summaries: Iterable[Summary]) -> None:
    """Add finished choices' token counts to the gateway's counters."""
    for s in summaries:
        m.prompt_tokens.inc(s.prompt_tokens)
        m.completion_tokens.inc(s.completion_tokens)
        m.drafted.inc(s.speculation.drafted_tokens)
        m.accepted.inc(s.speculation.accepted_tokens)
