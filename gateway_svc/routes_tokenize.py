"""``POST /tokenize`` and ``POST /detokenize``: vLLM's tokenizer endpoints, answered by the verifier.

The bodies are vLLM's (``TokenizeCompletionRequest`` / ``TokenizeChatRequest``, told apart by
``messages``; ``DetokenizeRequest``) and so are the answers (``{count, max_model_len, tokens,
token_strs}``; ``{prompt}``). The verifier tokenizes exactly as Generate does, so a chat's ``count``
is the ``prompt_tokens`` a chat completion of it reports, ``tools`` and tool messages included. A
field vLLM accepts that this server cannot honour (a custom ``chat_template``,
``continue_final_message``, …) is a 400 naming it, and so is an unknown field. ``model`` may be
left out (vLLM's default: the served model); one that names another model is a 404.
"""

from __future__ import annotations

from typing import Annotated, Any

import grpc
from fastapi import APIRouter, Body, Depends
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway_svc.errors import from_grpc
from gateway_svc.protocol import Message, RequestError
from gateway_svc.tools import check_tools
from gateway_svc.upstream import Gateway, current_gateway

router = APIRouter()
# The verifier's ids are int32; ids at or above the vocabulary size it refuses itself.
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of the template's own
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def check(self) -> None:
        """Refuse what vLLM would honour and this server cannot: 400 naming the field."""
        if self.continue_final_message:
            raise RequestError(
                "continue_final_message is not supported by this server (only false)", "continue_final_message"
            )
        if self.chat_template:
            raise RequestError("chat_template is not supported: the model's own template is used", "chat_template")
        for name in ("chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported by this server", name)
        check_tools(self.tools)

    def chat(self) -> list[dict[str, Any]]:
        return [m.chat(i) for i, m in enumerate(self.messages)]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


def tokenize_body(payload: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as vLLM reads it: a chat when it has ``messages``, else text. Invalid: the 400 of an
    invalid body, naming the first bad field.

    >>> type(tokenize_body({"prompt": "hi"})).__name__
    'TokenizeCompletionRequest'
    >>> type(tokenize_body({"model": "m", "messages": [{"role": "user", "content": "hi"}]})).__name__
    'TokenizeChatRequest'
    >>> tokenize_body({"prompt": "hi", "echo": True})
    Traceback (most recent call last):
    fastapi.exceptions.RequestValidationError: 1 validation error:
    ...
    """
    if "messages" in payload and "prompt" in payload:
        raise RequestError("set prompt (text) or messages (a chat), not both", "messages")
    kind = TokenizeChatRequest if "messages" in payload else TokenizeCompletionRequest
    try:
        return kind.model_validate(payload)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


@router.post("/tokenize")
async def tokenize(
    payload: Annotated[dict[str, Any], Body()], gw: Annotated[Gateway, Depends(current_gateway)]
) -> dict[str, Any]:
    body = tokenize_body(payload)
    chat = isinstance(body, TokenizeChatRequest)
    if chat:
        body.check()
    if body.model is not None:
        await gw.check_model(body.model)
    strs = bool(body.return_token_strs)
    try:
        if chat:
            out = await gw.client.tokenize(
                body.chat(),
                chat=True,
                add_special_tokens=body.add_special_tokens,
                add_generation_prompt=body.add_generation_prompt,
                return_token_strs=strs,
                timeout=gw.config.request_timeout_s,
                tools=body.tools or None,
            )
        else:
            out = await gw.client.tokenize(
                body.prompt,
                add_special_tokens=body.add_special_tokens,
                return_token_strs=strs,
                timeout=gw.config.request_timeout_s,
            )
    except grpc.RpcError as exc:
        raise from_grpc(exc) from None
    gw.metrics.requests.labels("/tokenize", "200").inc()
    return {
        "count": len(out.tokens),
        "max_model_len": out.max_model_len,
        "tokens": out.tokens,
        "token_strs": out.token_strs,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, gw: Annotated[Gateway, Depends(current_gateway)]) -> dict[str, str]:
    if body.model is not None:
        await gw.check_model(body.model)
    try:
        text = await gw.client.detokenize(body.tokens, timeout=gw.config.request_timeout_s)
    except grpc.RpcError as exc:
        raise from_grpc(exc) from None
    gw.metrics.requests.labels("/detokenize", "200").inc()
    return {"prompt": text}
