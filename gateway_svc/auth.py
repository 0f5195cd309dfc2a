"""The gateway's API keys (``--api-key-file``): every request needs ``Authorization: Bearer <key>`` (or
Anthropic's ``x-api-key: <key>``), else 401 in OpenAI's error shape (Anthropic's on ``/v1/messages``;
either client raises ``AuthenticationError``), but
``/health`` and ``/metrics``, which stay open for probes and scrapers.

Each key is a tenant: its requests' ``cache_scope`` is prefixed with a digest of the key
(``tenant_scope``), so caches that learn from outputs (the suffix proposer) never propose one
key's text to another, whatever scope a client names.

A pure ASGI middleware (not ``BaseHTTPMiddleware``): streamed responses and client disconnects
pass through untouched. Keys are compared in constant time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi.responses import JSONResponse

from gateway_svc.anthropic import error_body
from gateway_svc.errors import ApiError
from specmesh.credentials import token_matches, token_of

Scope = dict[str, Any]
OPEN_PATHS = frozenset({"/health", "/metrics"})
Asgi = Callable[[Scope, Callable, Callable], Awaitable[None]]


def api_key_of(scope: Scope) -> bytes | None:
    """The bearer key of a request's ``Authorization`` header, else its ``x-api-key`` header (Anthropic's
    clients send that one); None without either.

    >>> api_key_of({"headers": [(b"x-api-key", b"sk-a")]}), api_key_of({"headers": []})
    (b'sk-a', None)
    """
    headers = scope.get("headers", ())
    bearer = next((token_of(value) for name, value in headers if name == b"authorization"), None)
    return bearer if bearer is not None else next((value for name, value in headers if name == b"x-api-key"), None)


def tenant_of(key: bytes) -> str:
    """A key's tenant name: stable across gateway replicas and restarts, and not the key.

    >>> tenant_of(b"sk-a") == tenant_of(b"sk-a") != tenant_of(b"sk-b"), len(tenant_of(b"sk-a"))
    (True, 16)
    """
    return hashlib.sha256(b"specmesh-tenant:" + key).hexdigest()[:16]


def tenant_scope(tenant: str | None, scope: str) -> str:
    """The ``cache_scope`` a request of ``tenant`` runs in (no keys configured: the client's own).

    >>> tenant_scope("ab12", "chat"), tenant_scope("ab12", ""), tenant_scope(None, "chat")
    ('ab12/chat', 'ab12/', 'chat')
    """
    return scope if tenant is None else f"{tenant}/{scope}"


class ApiKeyCheck:
    def __init__(self, app: Asgi, keys: Iterable[str]) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys if k)

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        # Everything but the probes' and scrapers' paths needs a key (a closed default: a route added
        # later, or a path spelled oddly, is never open by accident).
        if scope["type"] == "http" and self.keys and scope["path"] not in OPEN_PATHS:
            key = api_key_of(scope)
            if not token_matches(key, self.keys):
                message = (
                    "You didn't provide an API key: send 'Authorization: Bearer <key>'."
                    if key is None
                    else "Incorrect API key provided."
                )
                err = ApiError(401, message, "invalid_request_error", None, "invalid_api_key")
                body = error_body(err) if scope["path"].startswith("/v1/messages") else err.body()
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant_of(key)  # request.state.tenant
        await self.app(scope, receive, send)
