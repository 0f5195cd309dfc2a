"""``POST /v1/responses``: OpenAI's Responses API over the chat pipeline (``gateway_svc.openai_responses``):
what agent SDKs call by default. Errors keep OpenAI's shape (the app's handlers)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway_svc.errors import RequestError, parse_body, validated
from gateway_svc.generation import chat_chunks
from gateway_svc.openai_responses import ResponseEvents, ResponsesRequest, output_messages, response_of, to_chat
from gateway_svc.protocol import ChatCompletionRequest
from gateway_svc.routes_chat import answer_chat
from gateway_svc.upstream import Gateway, current_gateway

router = APIRouter()
ENDPOINT = "/v1/responses"


@router.post(ENDPOINT)
async def responses(request: Request, gw: Annotated[Gateway, Depends(current_gateway)]) -> Response:
    req = parse_body(await request.body(), ResponsesRequest)
    tenant = getattr(request.state, "tenant", None)
    history: list[dict[str, Any]] = []
    if req.previous_response_id:
        if gw.responses.size <= 0:
            why = "responses are not stored on this gateway (--response-store 0)"
            raise RequestError(f"previous_response_id: {why}", "previous_response_id")
        found = gw.responses.get(tenant, req.previous_response_id)
        if found is None:
            raise RequestError(
                f"Previous response with id '{req.previous_response_id}' not found.", "previous_response_id"
            )
        history = found
    chat = to_chat(req, history)
    body = validated(chat, ChatCompletionRequest)
    answer = await answer_chat(gw, body, request, ENDPOINT)
    rid = f"resp_{uuid.uuid4().hex}"
    store = req.store is not False
    if isinstance(answer, StreamingResponse):
        events = _events(answer.body_iterator, ResponseEvents(rid, req), gw, tenant if store else None, chat, store)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    out = response_of(json.loads(bytes(answer.body)), rid, req)
    if store:
        gw.responses.put(tenant, rid, [*chat["messages"], *output_messages(out["output"])])
    return JSONResponse(out)


async def _events(
    chunks: AsyncIterator[Any], out: ResponseEvents, gw: Gateway, tenant: str | None, chat: dict, store: bool
) -> AsyncIterator[bytes]:
    """The chat stream's events, re-said as the Responses stream's; a finished one is stored."""
    async for chunk in chat_chunks(chunks):
        if chunk is None:
            for e in out.done():
                yield e
            if store:
                gw.responses.put(tenant, out.rid, [*chat["messages"], *output_messages(out.output)])
            return
        for e in out.feed(chunk):
            yield e
        if "error" in chunk:
            return
