"""Bearer tokens on SpecMesh gRPC servers: a server interceptor (``TokenAuth``) and the flags.

Each call carries ``authorization: Bearer <token>`` metadata. Two kinds of token:

- **client** (``--auth-token-file``): the verifier's clients (SDK, CLI, gateway); on a proposer,
  the tier token the verifier sends (``--proposer-token-file``), so only the verifier is served.
- **admin** (``--admin-token-file``, the verifier): what the methods in ``admin_methods`` need
  (the verifier's AdminService: the policy, the router's per-tag statistics). A valid client token
  there is ``PERMISSION_DENIED``; no token or an unknown one is ``UNAUTHENTICATED``. An admin token
  is accepted wherever a client token is.

``open_methods`` (health, reflection) need no token. Methods in ``client_methods`` (the
verifier's ``GetStats``, which the gateway reads for /v1/models) take either kind even when they
belong to an admin service. Tokens are compared in constant time (``hmac.compare_digest``); a token
file may list several, one a line, all accepted (rotation). Imports grpc only.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from specmesh.credentials import AUTHORIZATION, read_tokens, token_matches, token_of
from specmesh_server.flags import ServiceFlags

log = logging.getLogger(__name__)

# Unauthenticated everywhere: load balancers and kubelets probe health without credentials.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _tokens(tokens: Iterable[str]) -> tuple[bytes, ...]:
    return tuple(t.encode() for t in tokens if t)


class TokenAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without the token their method needs (see the module's doc).

    ``admin_prefixes``: method-name prefixes (``/pkg.Service/``) that need an admin token;
    ``client_methods``: full method names of those that a client token may call anyway.
    """

    def __init__(
        self,
        client_tokens: Iterable[str] = (),
        admin_tokens: Iterable[str] = (),
        admin_prefixes: Iterable[str] = (),
        client_methods: Iterable[str] = (),
    ) -> None:
        self.client = _tokens(client_tokens)
        self.admin = _tokens(admin_tokens)
        self.admin_prefixes = tuple(admin_prefixes)
        self.client_methods = frozenset(client_methods)

    @property
    def active(self) -> bool:
        return bool(self.client or self.admin)

    def check(self, method: str, metadata: Iterable[tuple[str, Any]] | None) -> tuple[grpc.StatusCode, str] | None:
        """None if the call may proceed, else the status and message it ends with."""
        if method.startswith(OPEN_PREFIXES):
            return None
        admin_only = bool(self.admin) and method.startswith(self.admin_prefixes) and method not in self.client_methods
        needed = self.admin if admin_only else self.client + self.admin if self.client else ()
        if not needed:
            return None
        token = _bearer(metadata)
        if token is None:
            return grpc.StatusCode.UNAUTHENTICATED, "missing credentials: send 'authorization: Bearer <token>'"
        if token_matches(token, needed):
            return None
        if admin_only and token_matches(token, self.client):
            return grpc.StatusCode.PERMISSION_DENIED, f"{method} needs the admin token"
        return grpc.StatusCode.UNAUTHENTICATED, "invalid token"

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        refusal = self.check(details.method, details.invocation_metadata)
        if refusal is None:
            return handler
        code, message = refusal

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(code, message)

        kind = ("stream" if handler.request_streaming else "unary") + "_"
        kind += "stream" if handler.response_streaming else "unary"
        return handler._replace(**{kind: refuse})


def _bearer(metadata: Iterable[tuple[str, Any]] | None) -> bytes | None:
    """The call's bearer token (b"" for another scheme), None without an ``authorization`` entry."""
    return next((token_of(value) for key, value in metadata or () if key == AUTHORIZATION), None)


def add_auth_token_flag(flags: ServiceFlags, who: str) -> None:
    """``--auth-token-file``: the token(s) every call must carry (``who`` says whose)."""
    flags.add(
        "--auth-token-file",
        "",
        str,
        f"file of the bearer token(s) {who} must send, one a line (authorization: Bearer …; health checks are "
        "exempt); empty = no token needed",
        metavar="FILE",
    )


def token_file(flags: ServiceFlags, a: argparse.Namespace, dest: str) -> tuple[str, ...]:
    """The tokens of the file flag ``dest`` (none when unset); an unreadable or empty file is a flag error."""
    path = getattr(a, dest)
    if not path:
        return ()
    flag = "--" + dest.replace("_", "-")
    try:
        tokens = read_tokens(path)
    except OSError as exc:
        flags.error(f"{flag}: cannot read {path}: {exc.strerror}")
    if not tokens:
        flags.error(f"{flag}: {path} holds no token")
    return tokens
