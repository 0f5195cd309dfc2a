"""What a response shows of each prompt: with ``echo`` (completions) the prompt's text before each of
its choices' text and, with ``logprobs``, its tokens' logprobs before theirs; with vLLM's
``prompt_logprobs``, the prompt tokens' logprobs in vLLM's shape.

The logprobs come in the first chunk of a prompt's first choice (only it asks for them: every choice
of a prompt has the same). A token-id prompt's text is the verifier's decoding of the ids (not the
tokens' strings joined: a character may span tokens); so is the first prompt token's string, which no
logprob carries (nothing precedes it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from gateway_svc.errors import ApiError, from_grpc
from gateway_svc.logprob_shapes import echo_logprobs, vllm_prompt_logprobs
from gateway_svc.protocol import ChatCompletionRequest, CompletionRequest
from specmesh.client import AsyncClient
from specmesh.params import Chunk, Prompt, PromptLogprobs


@dataclass(frozen=True)
class PromptView:
    text: str = ""  # echoed before each choice's text ("" without echo)
    logprobs: dict | None = None  # echo's legacy logprobs of the prompt's tokens (None: not asked)
    prompt_logprobs: list | None = None  # vLLM's prompt_logprobs (None: not asked)


async def prompt_views(
    client: AsyncClient,
    body: ChatCompletionRequest | CompletionRequest,
    prompts: list[Prompt],
    firsts: list[object],
    params: dict,
) -> list[PromptView]:
    """One view per prompt; ``firsts[p]``: the first item of prompt p's first choice."""
    echo = isinstance(body, CompletionRequest) and bool(body.echo)
    echo_n = body.echo_logprobs if isinstance(body, CompletionRequest) else None
    if not echo and body.prompt_logprobs is None:
        return [PromptView()] * len(prompts)

    async def view(prompt: Prompt, first: object) -> PromptView:
        logprobs = first.prompt if isinstance(first, Chunk) else None
        if logprobs is None and (echo_n is not None or body.prompt_logprobs is not None):
            raise ApiError(500, "the verifier sent no prompt logprobs", "server_error")
        text = ""
        if echo:
            text = prompt if isinstance(prompt, str) else await client.detokenize(prompt)  # type: ignore[arg-type]
        return PromptView(
            text,
            await _echo_logprobs(client, logprobs, echo_n) if echo_n is not None else None,
            vllm_prompt_logprobs(logprobs, body.prompt_logprobs) if body.prompt_logprobs is not None else None,
        )

    try:
        return list(await asyncio.gather(*(view(p, f) for p, f in zip(prompts, firsts, strict=True))))
    except grpc.RpcError as exc:
        err = from_grpc(exc, **params)
        if err.param == "tokens":  # Detokenize's field: the prompt's token ids
            err.param, err.message = "prompt", "prompt" + err.message.removeprefix("tokens")
        raise err from None


async def _echo_logprobs(client: AsyncClient, logprobs: PromptLogprobs | None, n: int) -> dict:
    assert logprobs is not None and logprobs.token_ids
    first = await client.detokenize(logprobs.token_ids[:1])
    return echo_logprobs(logprobs, first, n)
