"""``POST /v1/messages``: Anthropic's Messages API over the chat pipeline (``gateway_svc.anthropic``), so
its requests get what chat requests get (tools through the grammar, speculation per request, the
prefix cache), answered and refused in Anthropic's shapes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from gateway_svc.anthropic import MessageEvents, MessagesRequest, error_body, message_of, to_chat
from gateway_svc.errors import ApiError, validation_error
from gateway_svc.generation import chat_chunks
from gateway_svc.protocol import ChatCompletionRequest
from gateway_svc.routes_chat import answer_chat
from gateway_svc.upstream import Gateway, current_gateway

router = APIRouter()
ENDPOINT = "/v1/messages"


@router.post(ENDPOINT)
async def messages(request: Request, gw: Annotated[Gateway, Depends(current_gateway)]) -> Response:
    try:
        try:
            raw = json.loads(await request.body())
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        try:
            req = MessagesRequest.model_validate(raw)
            body = ChatCompletionRequest.model_validate(to_chat(req))
        except ValidationError as exc:
            raise validation_error(exc) from None
        answer = await answer_chat(gw, body, request, ENDPOINT)
    except ApiError as err:
        gw.metrics.requests.labels(ENDPOINT, str(err.status)).inc()
        headers = {"Retry-After": str(gw.config.retry_after_s)} if err.status == 429 else None
        return JSONResponse(error_body(err), status_code=err.status, headers=headers)
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
