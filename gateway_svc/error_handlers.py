"""Every error the app answers, in OpenAI's error shape: raised ApiErrors, invalid bodies, unknown
routes and unexpected exceptions; a 429 carries Retry-After, and errors of an endpoint are counted."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway_svc.errors import ApiError, validation_error
from gateway_svc.upstream import Gateway

log = logging.getLogger(__name__)


def error_response(gw: Gateway, err: ApiError, endpoint: str = "", body: dict | None = None) -> JSONResponse:
    """``err`` as a JSON response (``body``: in another API's shape; default OpenAI's); counted under
    ``endpoint`` unless that is ""."""
    headers = {"Retry-After": str(gw.config.retry_after_s)} if err.status == 429 else None
    if endpoint:
        gw.metrics.requests.labels(endpoint, str(err.status)).inc()
    return JSONResponse(err.body() if body is None else body, status_code=err.status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Register the handlers; they read the ``Gateway`` off ``app.state.gateway``."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request.app.state.gateway, exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.app.state.gateway, validation_error(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(request.app.state.gateway, ApiError(exc.status_code, str(exc.detail), kind), "")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        err = ApiError(500, f"internal error: {type(exc).__name__}", "server_error")
        return error_response(request.app.state.gateway, err, request.url.path)
