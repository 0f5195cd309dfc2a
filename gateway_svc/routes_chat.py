"""``POST /v1/chat/completions``: one conversation, answered by the verifier's chat template."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway_svc.generation import generate, request_spec
from gateway_svc.protocol import ChatCompletionRequest
from gateway_svc.upstream import Gateway, current_gateway

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, gw: Annotated[Gateway, Depends(current_gateway)]
) -> Response:
    return await answer_chat(gw, body, request)


async def answer_chat(
    gw: Gateway, body: ChatCompletionRequest, request: Request, endpoint: str = "/v1/chat/completions"
) -> Response:
    """The chat completion ``body`` asks for (the Messages endpoint's too, counted under ``endpoint``)."""
    body.check(gw.config.max_n)
    info = await gw.check_model(body.model)
    params = {"max_tokens_param": body.max_tokens_param, "logprobs_param": "top_logprobs"}
    params["structured_output_param"] = body.structured_output_param
    tools = body.tool_plan(gw.config.tool_call_parser)
    if tools and tools.forced:  # a schema the verifier cannot compile came from the tools
        params["structured_output_param"] = "tools"
    spec = request_spec(body, request)
    return await generate(gw, body, info, [body.chat()], True, params, spec, tools, endpoint=endpoint)
