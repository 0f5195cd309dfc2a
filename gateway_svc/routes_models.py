"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model the verifier serves."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from gateway_svc.upstream import Gateway, current_gateway

router = APIRouter()


@router.get("/v1/models")
async def models(gw: Annotated[Gateway, Depends(current_gateway)]) -> dict:
    info = await gw.model()
    card = {
        "id": info.name,
        "object": "model",
        "created": info.created,
        "owned_by": "specmesh",
        "root": info.name,
        "max_model_len": info.max_context,
    }
    return {"object": "list", "data": [card]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, gw: Annotated[Gateway, Depends(current_gateway)]) -> dict:
    info = await gw.check_model(model_id)
    return {"id": info.name, "object": "model", "created": info.created, "owned_by": "specmesh"}
