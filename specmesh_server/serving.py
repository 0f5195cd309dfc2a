"""What every SpecMesh gRPC server shares: health, reflection, graceful SIGTERM drain (streams
still open when its grace runs out end UNAVAILABLE, ``LiveStreams``).

Used by the verifier and by every proposer process; imports no torch.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from specmesh_server.request_decoding import DecodeGuard
from specmesh_server.tls import TlsConfig, listen

log = logging.getLogger(__name__)

# Long-lived streams need keepalive; max_connection_age makes clients re-resolve so new replicas get traffic.
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.max_connection_age_ms", 300_000),
    # A stream open when its connection ages out may finish (generation or its proposer stream):
    # only new streams move to the re-resolved connection.
    ("grpc.max_connection_age_grace_ms", 3_600_000),
]


# What a stream cut by a drain whose grace ran out ends with (status UNAVAILABLE: a client may retry).
RETRY_ELSEWHERE = "server shutting down; retry the request on another replica"
# After the drain's grace: how long the cut streams have to send that status before gRPC cancels them.
CUT_GRACE_S = 1.0


class _Stream:
    """One open response stream: its handler task, and whether it is awaiting its servicer (``producing``:
    a cut cancels it there) or suspended in gRPC's write of an item (a cut ends it once the write is done)."""

    __slots__ = ("cut", "method", "producing", "task")

    def __init__(self, task: asyncio.Task, method: str) -> None:
        self.task, self.method = task, method
        self.producing = False
        self.cut = False


class LiveStreams(grpc.aio.ServerInterceptor):
    """The server's open response streams, so that a drain whose grace runs out ends them itself.

    Left to ``server.stop``, a stream still open at the end of the grace was cancelled by gRPC: an
    ERROR traceback apiece (``CancelledError`` in ``_schedule_rpc_coro``) and a bare "Cancelling all
    calls" to its client. ``cut`` ends each with ``UNAVAILABLE`` and ``RETRY_ELSEWHERE``; the
    servicer's cleanup (its ``finally``) runs as on a client's cancel. Installed by ``new_server``;
    ``serve`` cuts at the drain's deadline and logs one line for all of them.
    """

    def __init__(self) -> None:
        self._open: set[_Stream] = set()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: Any
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or not handler.response_streaming:
            return handler
        kind = "stream_stream" if handler.request_streaming else "unary_stream"
        behavior = getattr(handler, kind)
        if not inspect.isasyncgenfunction(behavior):
            return handler
        return handler._replace(**{kind: self._tracked(behavior, details.method)})

    def _tracked(self, behavior: Callable[..., AsyncIterator[Any]], method: str) -> Callable[..., AsyncIterator[Any]]:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            s = _Stream(asyncio.current_task(), method)
            self._open.add(s)
            try:
                async with aclosing(behavior(request, context)) as items:
                    while not s.cut:
                        s.producing = True
                        try:
                            item = await anext(items)
                        except StopAsyncIteration:
                            return
                        finally:
                            s.producing = False
                        yield item
            except asyncio.CancelledError:
                if not s.cut:
                    raise  # the client cancelled, or its deadline passed
                s.task.uncancel()
            finally:
                self._open.discard(s)
            await context.abort(grpc.StatusCode.UNAVAILABLE, RETRY_ELSEWHERE)

        return stream

    def cut(self) -> Counter[str]:
        """End every open stream with UNAVAILABLE (once its servicer has cleaned up); how many, by method."""
        cut = [s for s in self._open if not s.cut]
        for s in cut:
            s.cut = True
            if s.producing:
                s.task.cancel()
        return Counter(s.method for s in cut)

    async def wait_idle(self, timeout: float) -> bool:
        """Whether every stream ended within ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._open and loop.time() < deadline:
            await asyncio.sleep(min(0.05, deadline - loop.time()))
        return not self._open


_LIVE: weakref.WeakKeyDictionary[grpc.aio.Server, LiveStreams] = weakref.WeakKeyDictionary()


def new_server(auth: grpc.aio.ServerInterceptor | None = None) -> grpc.aio.Server:
    """Every SpecMesh gRPC server: a malformed request message is INVALID_ARGUMENT (``DecodeGuard``);
    its response streams are tracked (``LiveStreams``) for ``serve`` to cut when a drain's grace ends.
    ``auth`` (``specmesh_server.auth.TokenAuth``) runs first: a call without its token goes no further."""
    live = LiveStreams()
    interceptors = [DecodeGuard(), live] if auth is None else [auth, DecodeGuard(), live]
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    _LIVE[server] = live
    return server


def live_streams(server: grpc.aio.Server) -> LiveStreams | None:
    """The open response streams of a server from ``new_server`` (None for any other server)."""
    return _LIVE.get(server)


async def serve(
    server: grpc.aio.Server,
    address: str,
    service_names: Sequence[str],
    *,
    on_drain: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 30.0,
    ready_message: str = "",
    metrics_port: int = 0,
    metrics_address: str = "",
    tls: TlsConfig | None = None,
    reflection_on: bool = True,
    health_port: int = 0,
) -> None:
    """Start ``server`` on ``address`` and run until SIGTERM/SIGINT, then drain and stop.

    ``tls``: serve TLS (mutual with its ``client_ca``) when it has a certificate, else plaintext;
    ``reflection_on``: also serve gRPC reflection (listing the services of this port);
    ``health_port``: also serve the health check alone, plaintext, on that port of ``address``'s host
    (for probes that cannot speak TLS, as kubelet's gRPC probes).

    ``metrics_port``: also serve the process's Prometheus registry on http://HOST:PORT/metrics, HOST
    being ``metrics_address`` or else ``address``'s host (``metrics.metrics_host``).

    Drain order: health → NOT_SERVING (load balancers stop routing), ``on_drain`` (the service
    refuses new work), then in-flight RPCs get ``grace_s`` seconds to finish, all within one deadline.
    Response streams still open then (a server from ``new_server``) end with UNAVAILABLE and
    ``RETRY_ELSEWHERE``, with one warning line for all of them.
    """
    health, port = await start_port(server, address, service_names, tls, reflection_on)
    health_only = await _health_only(health, address, health_port) if health_port else None
    for name in ("", *service_names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    host = address.rsplit(":", 1)[0]
    over = f" ({tls.describe})" if tls is not None and tls.enabled else ""
    print(f"{ready_message or 'serving'} on {host}:{port}{over}", flush=True)
    from specmesh_server.metrics import metrics_host, start_metrics_server

    exporter = start_metrics_server(metrics_port, metrics_host(address, metrics_address))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server_done = asyncio.ensure_future(server.wait_for_termination())
    stop_wait = asyncio.ensure_future(stop.wait())
    await asyncio.wait([server_done, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    stop_wait.cancel()
    log.info("draining: health NOT_SERVING, finishing in-flight requests (grace %.0f s)", grace_s)
    deadline = loop.time() + grace_s
    await health.enter_graceful_shutdown()
    if on_drain is not None:
        await on_drain()
    live = live_streams(server)
    if live is None:
        await server.stop(max(deadline - loop.time(), 1.0))  # the whole drain stays within grace_s
    else:  # cut at the deadline what still streams; the cut streams' statuses go out within CUT_GRACE_S
        cutter = asyncio.ensure_future(_cut_at(live, deadline, grace_s))
        await server.stop(max(deadline - loop.time(), 0.0) + CUT_GRACE_S)
        cutter.cancel()
    server_done.cancel()
    if health_only is not None:
        await health_only.stop(0)
    if exporter is not None:
        exporter.close()


async def start_port(
    server: grpc.aio.Server,
    address: str,
    service_names: Sequence[str],
    tls: TlsConfig | None,
    reflection_on: bool,
) -> tuple[HealthServicer, int]:
    """Add health (and reflection listing ``service_names``) to ``server``, listen on ``address``
    (TLS when ``tls`` has a certificate) and start it: its health servicer and port. The caller sets
    the services SERVING once it is ready for them."""
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if reflection_on:
        names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
    port = listen(server, address, tls)
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    await server.start()
    return health, port


async def _health_only(health: HealthServicer, address: str, port: int) -> grpc.aio.Server:
    """A plaintext server carrying only ``health`` (no request data, no credentials) on ``port``."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    where = f"{address.rsplit(':', 1)[0]}:{port}"
    if server.add_insecure_port(where) == 0:
        raise RuntimeError(f"cannot listen on {where}")
    await server.start()
    return server


async def _cut_at(live: LiveStreams, deadline: float, grace_s: float) -> None:
    """At ``deadline`` (loop time), end the streams still open with UNAVAILABLE; one line for them all."""
    if await live.wait_idle(deadline - asyncio.get_running_loop().time()):
        return
    if cut := live.cut():
        methods = ", ".join(f"{n} {method}" for method, n in sorted(cut.items()))
        log.warning(
            "drain grace of %g s over: cutting %d streams (%s); each ends UNAVAILABLE for its client to retry",
            grace_s,
            cut.total(),
            methods,
        )
