"""The gateway's state: its one SDK client to the verifier, the served model, its metrics.

One ``Gateway`` per app, on ``app.state.gateway``; routes receive it through the ``current_gateway``
dependency, and ask it for the model, the verifier's health, and a request's opened streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from fastapi import Request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_svc.choices import Choice, close_choices
from gateway_svc.config import GatewayConfig
from gateway_svc.errors import ApiError, from_grpc
from gateway_svc.metrics import GatewayMetrics
from gateway_svc.openai_responses import ResponseStore
from specmesh.client import AsyncClient
from specmesh.credentials import TlsOptions
from specmesh.params import Prompt, SamplingParams, SpecDecodeParams


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_context: int
    created: int


class Gateway:
    """State of one gateway process: the verifier channel, the served model, metrics."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config, self.metrics = config, metrics
        self.responses = ResponseStore(config.response_store)  # /v1/responses' previous_response_id
        self.client: AsyncClient | None = None
        self._model: ModelInfo | None = None

    async def start(self) -> None:
        c = self.config
        tls = None
        if c.verifier_tls_ca:  # a client certificate of its own, else its https one (mutual TLS)
            cert, key = (c.verifier_tls_cert, c.verifier_tls_key) if c.verifier_tls_cert else (c.tls_cert, c.tls_key)
            tls = TlsOptions(ca=c.verifier_tls_ca, cert=cert or None, key=key or None)
        # the channel belongs to the serving loop; the token is the gateway's own, never a client's
        self.client = AsyncClient(c.verifier, tls=tls, token=c.verifier_token)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def model(self) -> ModelInfo:
        """The served model, asked of the verifier once (503 while it cannot be reached). A verifier
        that serves AdminService only on its --admin-address answers UNIMPLEMENTED here: then the
        name is --served-model-name and the context length unknown (0)."""
        if self._model is None:
            try:
                stats = (await self.client.stats(timeout=5.0)).server
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED and self.config.served_model_name:
                    self._model = ModelInfo(self.config.served_model_name, 0, int(time.time()))
                    return self._model
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    msg = "the verifier serves AdminService on a separate --admin-address: set --served-model-name"
                    raise ApiError(500, msg, "server_error") from None
                raise from_grpc(exc) from None
            name = self.config.served_model_name or stats.model
            self._model = ModelInfo(name, stats.max_context_tokens, int(time.time()))
        return self._model

    async def check_model(self, requested: str) -> ModelInfo:
        info = await self.model()
        if requested != info.name:
            raise ApiError(
                404,
                f"The model `{requested}` does not exist; this server serves `{info.name}`.",
                "not_found_error",
                "model",
                "model_not_found",
            )
        return info

    async def healthy(self) -> bool:
        try:
            resp = await health_pb2_grpc.HealthStub(self.client.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2.0
            )
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def open(
        self,
        prompts: list[Prompt],
        chat: bool,
        n: int,
        sampling_for: Callable[[int], SamplingParams],
        spec: SpecDecodeParams,
        rid: str,
        params: dict,
        tools: list[dict] | None = None,
    ) -> list[Choice]:
        """Start every choice's stream and wait for its first item; refusals raise ApiError.
        ``tools``: OpenAI tool objects a chat's template is given."""
        choices = []
        for p, prompt in enumerate(prompts):
            for j in range(n):
                sampling: SamplingParams = sampling_for(j)
                stream = self.client.generate(
                    prompt,
                    sampling,
                    spec,
                    chat=chat,
                    request_id=f"{rid}-{p * n + j}",
                    timeout=self.config.request_timeout_s,
                    tools=tools,
                )
                choices.append(Choice(p * n + j, stream))
        firsts = await asyncio.gather(*(anext(c.stream) for c in choices), return_exceptions=True)
        failure = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failure is not None:
            await close_choices(choices)
            if isinstance(failure, grpc.RpcError):
                raise from_grpc(failure, **params) from None
            raise failure
        for c, first in zip(choices, firsts, strict=True):
            c.first = first
        return choices


async def current_gateway(request: Request) -> Gateway:
    """The app's ``Gateway`` (a FastAPI dependency; async, so it runs on the loop, not in a thread)."""
    return request.app.state.gateway
