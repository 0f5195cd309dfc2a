"""``POST /v1/completions``: text completion of one prompt or several, streamed or not."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway_svc.generation import generate, request_spec
from gateway_svc.protocol import CompletionRequest
from gateway_svc.upstream import Gateway, current_gateway

router = APIRouter()


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, request: Request, gw: Annotated[Gateway, Depends(current_gateway)]
) -> Response:
    body.check(gw.config.max_n)
    info = await gw.check_model(body.model)
    params = {"max_tokens_param": "max_tokens", "logprobs_param": "logprobs"}
    params["structured_output_param"] = body.structured_output_param
    params["prompt_logprobs_param"] = body.prompt_logprobs_param
    return await generate(gw, body, info, body.prompts(), False, params, request_spec(body, request))
