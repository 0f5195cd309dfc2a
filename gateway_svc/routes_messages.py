"""``POST /v1/messages``: Anthropic's Messages API over the chat pipeline (``gateway_svc.anthropic``), so
its requests get what chat requests get (tools through the grammar, speculation per request, the
prefix cache), answered and refused in Anthropic's shapes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway_svc.anthropic import MessageEvents, MessagesRequest, error_body, message_of, to_chat
from gateway_svc.error_handlers import error_response
from gateway_svc.errors import ApiError, parse_body, validated
from gateway_svc.generation import chat_chunks
from gateway_svc.protocol import ChatCompletionRequest
from gateway_svc.routes_chat import answer_chat
from gateway_svc.upstream import Gateway, current_gateway

router = APIRouter()
ENDPOINT = "/v1/messages"


@router.post(ENDPOINT)
async def messages(request: Request, gw: Annotated[Gateway, Depends(current_gateway)]) -> Response:
    try:
        req = parse_body(await request.body(), MessagesRequest)
        body = validated(to_chat(req), ChatCompletionRequest)
        answer = await answer_chat(gw, body, request, ENDPOINT)
    except ApiError as err:  # in Anthropic's shape
        return error_response(gw, err, ENDPOINT, error_body(err))
    if isinstance(answer, StreamingResponse):
        events = _events(answer.body_iterator, MessageEvents(req.model))
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(message_of(json.loads(bytes(answer.body)), req.model))


async def _events(chunks: AsyncIterator[bytes | str], out: MessageEvents) -> AsyncIterator[bytes]:
    """The chat stream's server-sent events, re-said as the Messages stream's."""
    async for chunk in chat_chunks(chunks):
        if chunk is None:
            for e in out.finish():
                yield e
            return
        for e in out.feed(chunk):
            yield e
        if "error" in chunk:
            return
