"""The OpenAI-compatible ASGI app: /v1/models, /v1/completions, /v1/chat/completions, /tokenize,
/detokenize, /health, /metrics, /v1/responses; and Anthropic's /v1/messages.

``create_app`` wires the parts: the ``Gateway`` state (``gateway_svc.upstream``) on
``app.state.gateway``, the API key check, the error handlers (``gateway_svc.error_handlers``) and one
router per endpoint group (``gateway_svc.routes_*``). Each choice of a request is one Generate stream
on the verifier, through the async SDK (``gateway_svc.generation``).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway_svc import (
    routes_chat,
    routes_completions,
    routes_messages,
    routes_models,
    routes_monitoring,
    routes_responses,
    routes_tokenize,
)
from gateway_svc.auth import ApiKeyCheck
from gateway_svc.config import GatewayConfig
from gateway_svc.error_handlers import add_error_handlers
from gateway_svc.metrics import GatewayMetrics
from gateway_svc.upstream import Gateway


def create_app(config: GatewayConfig, metrics: GatewayMetrics | None = None) -> FastAPI:
    gw = Gateway(config, metrics or GatewayMetrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        yield
        await gw.close()

    app = FastAPI(title="SpecMesh OpenAI-compatible API", lifespan=lifespan)
    app.state.gateway = gw
    if config.api_keys:
        app.add_middleware(ApiKeyCheck, keys=config.api_keys)
    add_error_handlers(app)
    groups = (routes_monitoring, routes_models, routes_chat, routes_completions, routes_responses, routes_messages)
    for group in (*groups, routes_tokenize):
        app.include_router(group.router)
    return app
