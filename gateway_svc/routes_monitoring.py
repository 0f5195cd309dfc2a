"""``GET /health`` (200 while the verifier serves, else 503) and ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway_svc.upstream import Gateway, current_gateway
from specmesh_server.metrics import REGISTRY

router = APIRouter()


@router.get("/health")
async def health(gw: Annotated[Gateway, Depends(current_gateway)]) -> Response:
    ok = await gw.healthy()
    return PlainTextResponse("ok" if ok else "verifier not serving", status_code=200 if ok else 503)


@router.get("/metrics")
async def prometheus() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
