"""gRPC client SDK: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

>>> from specmesh import Client, SamplingParams            # doctest: +SKIP
>>> with Client("127.0.0.1:50051") as c:                    # doctest: +SKIP
...     for chunk in (stream := c.generate("Hi!", SamplingParams(temperature=0), chat=True)):
...         print(chunk.text, end="")
...     print(stream.summary.completion_tokens)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import grpc

from specmesh.credentials import TlsOptions, bearer, channel, env_token
from specmesh.params import (
    Chunk,
    Completion,
    Prompt,
    SamplingParams,
    SpecDecodeParams,
    Summary,
    Tokens,
    Tools,
    build_request,
    build_tokenize_request,
)
from specmesh.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
# Every channel of ours (this SDK and the gateway on it, the verifier's proposer tiers): a restarted
# server is used again within ~2 s. gRPC's default backoff grows ×1.6 from 1 s to 120 s, so a
# proposer back after a 40 s outage sat unused for 14 s more. min_reconnect_backoff_ms is gRPC
# core's connect-attempt timeout (default 20 s): a peer that drops SYNs holds no attempt longer.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.min_reconnect_backoff_ms", 5_000),
]
# round_robin: a dns:/// target naming several verifier replicas spreads requests over them.
_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.enable_retries", 1),
    ("grpc.lb_policy_name", "round_robin"),
    *RECONNECT_OPTIONS,
]


def _channel(address: str, tls: TlsOptions | None, *, aio: bool = False) -> grpc.Channel | grpc.aio.Channel:
    return channel(address, tls, _OPTIONS, aio=aio)


class GenerationStream:
    """Iterate for ``Chunk``s; ``summary`` is set once the stream has ended."""

    def __init__(self, call: grpc.Call) -> None:
        self._call = call
        self.summary: Summary | None = None
        self.request_id = ""

    def __iter__(self) -> Iterator[Chunk]:
        for resp in self._call:
            self.request_id = resp.request_id
            if resp.HasField("summary"):
                self.summary = Summary.from_proto(resp.summary)
            else:
                yield Chunk.from_proto(resp.chunk)

    def cancel(self) -> None:
        self._call.cancel()


class Client:
    """``tls``: connect over TLS (``TlsOptions(ca=…)``; ``cert``/``key`` too where the server requires
    mutual TLS); ``token``: sent as ``authorization: Bearer …`` on every call (None: ``$SPECMESH_TOKEN``
    if set; "" none). An admin token is what ``stats``/``set_policy``/``router_stats`` need on a
    verifier started with ``--admin-token-file``."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        channel: grpc.Channel | None = None,
        tls: TlsOptions | None = None,
        token: str | None = None,
    ) -> None:
        self.channel = channel or _channel(address, tls)
        self._md = bearer(env_token() if token is None else token)
        self._gen = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self._admin = admin_pb2_grpc.AdminServiceStub(self.channel)

    def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        spec: SpecDecodeParams | None = None,
        *,
        chat: bool = False,
        request_id: str = "",
        timeout: float | None = None,
        tools: Tools | None = None,
    ) -> GenerationStream:
        """``tools``: OpenAI tool objects the chat's template is given (``ChatMessages.tools_json``)."""
        req = build_request(prompt, sampling, spec, chat, request_id, tools)
        return GenerationStream(self._gen.Generate(req, timeout=timeout, metadata=self._md))

    def complete(self, prompt: Prompt, sampling: SamplingParams | None = None, spec: SpecDecodeParams | None = None,
                 *, chat: bool = False, timeout: float | None = None,
                 tools: Tools | None = None) -> Completion:  # fmt: skip
        out = Completion()
        stream = self.generate(prompt, sampling, spec, chat=chat, timeout=timeout, tools=tools)
        for chunk in stream:
            out.add(chunk)
        out.summary = stream.summary
        return out

    def tokenize(
        self,
        prompt: str | list[dict[str, Any]],
        *,
        chat: bool = False,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        return_token_strs: bool = False,
        timeout: float | None = None,
        tools: Tools | None = None,
    ) -> Tokens:
        """The prompt's token ids as Generate would see them (a chat through the model's template,
        with ``tools``). ``add_special_tokens`` None: the tokenizer's special tokens for text, none
        beyond the template's for a chat; ``add_generation_prompt`` None: true (chat only)."""
        req = build_tokenize_request(prompt, chat, add_special_tokens, add_generation_prompt, return_token_strs, tools)
        return Tokens.from_proto(self._gen.Tokenize(req, timeout=timeout, metadata=self._md), return_token_strs)

    def detokenize(self, tokens: Iterable[int], *, timeout: float | None = None) -> str:
        """The text of token ids (an id outside the vocabulary: INVALID_ARGUMENT)."""
        req = generation_pb2.DetokenizeRequest(tokens=tokens)
        return self._gen.Detokenize(req, timeout=timeout, metadata=self._md).text

    def stats(self) -> admin_pb2.GetStatsResponse:
        return self._admin.GetStats(admin_pb2.GetStatsRequest(), metadata=self._md)

    def policy(self) -> admin_pb2.SpeculationPolicy:
        return self._admin.GetPolicy(admin_pb2.GetPolicyRequest(), metadata=self._md).policy

    def set_policy(self, policy: admin_pb2.SpeculationPolicy) -> admin_pb2.SpeculationPolicy:
        return self._admin.SetPolicy(admin_pb2.SetPolicyRequest(policy=policy), metadata=self._md).policy

    def router_stats(self, proposer: str = "", workload_tag: str = "") -> admin_pb2.GetRouterStatsResponse:
        """The router's decayed acceptance statistics (shared by every replica when in Redis)."""
        req = admin_pb2.GetRouterStatsRequest(proposer=proposer, workload_tag=workload_tag)
        return self._admin.GetRouterStats(req, metadata=self._md)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """``Client`` on asyncio; ``tls`` and ``token`` as there."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        channel: grpc.aio.Channel | None = None,
        tls: TlsOptions | None = None,
        token: str | None = None,
    ) -> None:
        self.channel = channel or _channel(address, tls, aio=True)
        self._md = bearer(env_token() if token is None else token)
        self._gen = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self._admin = admin_pb2_grpc.AdminServiceStub(self.channel)

    async def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        spec: SpecDecodeParams | None = None,
        *,
        chat: bool = False,
        request_id: str = "",
        timeout: float | None = None,
        tools: Tools | None = None,
    ) -> AsyncIterator[Chunk | Summary]:
        """Yields ``Chunk``s, then exactly one ``Summary``. Closing the generator early (or cancelling
        the task reading it) cancels the RPC, and the verifier frees the request's slot. ``tools`` as
        ``Client.generate``'s."""
        req = build_request(prompt, sampling, spec, chat, request_id, tools)
        call = self._gen.Generate(req, timeout=timeout, metadata=self._md)
        try:
            async for resp in call:
                if resp.HasField("summary"):
                    yield Summary.from_proto(resp.summary)
                else:
                    yield Chunk.from_proto(resp.chunk)
        finally:
            call.cancel()  # no-op once the stream has ended

    async def complete(self, prompt: Prompt, sampling: SamplingParams | None = None,
                       spec: SpecDecodeParams | None = None, *, chat: bool = False,
                       timeout: float | None = None, tools: Tools | None = None) -> Completion:  # fmt: skip
        out = Completion()
        async for item in self.generate(prompt, sampling, spec, chat=chat, timeout=timeout, tools=tools):
            if isinstance(item, Summary):
                out.summary = item
            else:
                out.add(item)
        return out

    async def tokenize(
        self,
        prompt: str | list[dict[str, Any]],
        *,
        chat: bool = False,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool | None = None,
        return_token_strs: bool = False,
        timeout: float | None = None,
        tools: Tools | None = None,
    ) -> Tokens:
        """``Client.tokenize`` on asyncio."""
        req = build_tokenize_request(prompt, chat, add_special_tokens, add_generation_prompt, return_token_strs, tools)
        resp = await self._gen.Tokenize(req, timeout=timeout, metadata=self._md)
        return Tokens.from_proto(resp, return_token_strs)

    async def detokenize(self, tokens: Iterable[int], *, timeout: float | None = None) -> str:
        """``Client.detokenize`` on asyncio."""
        req = generation_pb2.DetokenizeRequest(tokens=tokens)
        return (await self._gen.Detokenize(req, timeout=timeout, metadata=self._md)).text

    async def stats(self, timeout: float | None = None) -> admin_pb2.GetStatsResponse:
        return await self._admin.GetStats(admin_pb2.GetStatsRequest(), timeout=timeout, metadata=self._md)

    async def policy(self) -> admin_pb2.SpeculationPolicy:
        return (await self._admin.GetPolicy(admin_pb2.GetPolicyRequest(), metadata=self._md)).policy

    async def set_policy(self, policy: admin_pb2.SpeculationPolicy) -> admin_pb2.SpeculationPolicy:
        return (await self._admin.SetPolicy(admin_pb2.SetPolicyRequest(policy=policy), metadata=self._md)).policy

    async def router_stats(self, proposer: str = "", workload_tag: str = "") -> admin_pb2.GetRouterStatsResponse:
        req = admin_pb2.GetRouterStatsRequest(proposer=proposer, workload_tag=workload_tag)
        return await self._admin.GetRouterStats(req, metadata=self._md)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
