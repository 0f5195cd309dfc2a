"""Every error the app answers, in OpenAI's error shape: raised ApiErrors, invalid bodies, unknown
routes and unexpected exceptions; a 429 carries Retry-After, and errors of an endpoint are counted."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway_svc.errors import ApiError
from gateway_svc.upstream import Gateway

log = logging.getLogger(__name__)


def error_response(gw: Gateway, err: ApiError, endpoint: str = "") -> JSONResponse:
    """``err`` as a JSON response; counted under ``endpoint`` unless that is ""."""
    headers = {"Retry-After": str(gw.config.retry_after_s)} if err.status == 429 else None
    if endpoint:
        gw.metrics.requests.labels(endpoint, str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Register the handlers; they read the ``Gateway`` off ``app.state.gateway``."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request.app.state.gateway, exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            err = ApiError(400, f"the request body is not valid JSON: {first.get('msg', '')}", code="json_invalid")
        else:
            loc = [str(x) for x in first.get("loc", ()) if x != "body"]
            param = ".".join(loc) or None
            if first.get("type") == "extra_forbidden":  # OpenAI's words for a field it does not know
                err = ApiError(400, f"Unrecognized request argument supplied: {param}", param=param)
            else:
                err = ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param)
        return error_response(request.app.state.gateway, err, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(request.app.state.gateway, ApiError(exc.status_code, str(exc.detail), kind), "")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        err = ApiError(500, f"internal error: {type(exc).__name__}", "server_error")
        return error_response(request.app.state.gateway, err, request.url.path)
