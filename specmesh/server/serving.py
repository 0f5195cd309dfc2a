"""What every SpecMesh gRPC server shares: health, reflection, graceful SIGTERM drain.

Used by the verifier and by every proposer process; imports no torch.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from specmesh.server.request_decoding import DecodeGuard

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


def new_server() -> grpc.aio.Server:
    """Every SpecMesh gRPC server: a malformed request message is INVALID_ARGUMENT (``DecodeGuard``)."""
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=[DecodeGuard()])


async def serve(
    server: grpc.aio.Server,
    address: str,
    service_names: Sequence[str],
    *,
    on_drain: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 30.0,
    ready_message: str = "",
    metrics_port: int = 0,
) -> None:
    """Start ``server`` on ``address`` and run until SIGTERM/SIGINT, then drain and stop.

    ``metrics_port``: also serve the process's Prometheus registry on http://0.0.0.0:PORT/metrics.

    Drain order: health → NOT_SERVING (load balancers stop routing), ``on_drain`` (the service
    refuses new work), then in-flight RPCs get ``grace_s`` seconds to finish.
    """
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot listen on {address}")
    await server.start()
    for name in ("", *service_names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    host = address.rsplit(":", 1)[0]
    print(f"{ready_message or 'serving'} on {host}:{port}", flush=True)
    from specmesh.server.metrics import start_metrics_server

    exporter = start_metrics_server(metrics_port)

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
    await server.stop(max(deadline - loop.time(), 1.0))  # the whole drain stays within grace_s
    server_done.cancel()
    if exporter is not None:
        exporter.close()
