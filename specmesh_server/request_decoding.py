"""Malformed request bytes → ``INVALID_ARGUMENT``, for every method of every SpecMesh server.

grpc.aio parses a request before the servicer runs, so a ``DecodeError`` there (garbage, a
truncated message, invalid UTF-8 in a string field) became ``UNKNOWN`` "Unexpected DecodeError"
with an ERROR traceback. ``DecodeGuard`` (installed by ``serving.new_server``) moves the parsing
into the handler, where a bad message is refused like any other bad argument and logged once,
as one line. Servicers read request streams through their iterator (never ``context.read()``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)

Prepare = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Refuses a request message that does not parse with ``INVALID_ARGUMENT``."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return guarded(handler, details.method)


def guarded(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` receiving raw bytes and parsing them itself; unchanged where the behaviour is sync."""
    parse = handler.request_deserializer
    kind = ("stream_" if handler.request_streaming else "unary_") + (
        "stream" if handler.response_streaming else "unary"
    )

    async def one(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await _parsed(parse, raw, context, method)

    async def many(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        return _parsed_stream(parse, raws, context, method)

    behavior = _wrap(getattr(handler, kind), many if handler.request_streaming else one)
    if behavior is None:
        return handler
    return handler._replace(request_deserializer=None, **{kind: behavior})


def _wrap(behavior: Callable, prepare: Prepare) -> Callable | None:
    """``behavior`` with its request passed through ``prepare`` first, of the same async kind
    (grpc.aio dispatches on it); None for a sync behaviour."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with aclosing(behavior(await prepare(request, context), context)) as items:
                async for item in items:
                    yield item

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await prepare(request, context), context)

        return call
    return None


async def _parsed(parse: Callable[[bytes], Any], raw: bytes, context: grpc.aio.ServicerContext, method: str) -> Any:
    try:
        return parse(raw)
    except (DecodeError, UnicodeDecodeError, ValueError) as exc:
        log.warning("%s: refused a malformed request message (%d bytes): %s", method, len(raw), exc)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}")


async def _parsed_stream(
    parse: Callable[[bytes], Any], raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext, method: str
) -> AsyncIterator[Any]:
    async for raw in raws:
        try:
            message = await _parsed(parse, raw, context, method)
        except grpc.aio.AbortError:
            # The status is sent; to the servicer, mid-stream, the call ends as a cancelled one
            # does (an abort raised inside its reading loop, or its reader task, would not).
            raise asyncio.CancelledError from None
        yield message
