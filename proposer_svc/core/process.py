"""What every proposer process shares: its serving flags (address, grace, metrics port, what one
stream may ask: ``StreamLimits``) and the gRPC server that carries ``ProposerService`` beside health and reflection."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from proposer_svc.core.stream import SERVING_LIMITS, StreamLimits
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc
from specmesh_server.auth import TokenAuth
from specmesh_server.flags import ServiceFlags
from specmesh_server.security import ServerSecurity, add_security_flags, security_config
from specmesh_server.serving import new_server, serve


@dataclass(frozen=True)
class ServingConfig:
    address: str
    grace_s: float = 30.0  # SIGTERM: open streams get this long to finish
    metrics_port: int = 0  # Prometheus /metrics; 0 = off
    metrics_address: str = ""  # /metrics host; "" = the host of `address`
    limits: StreamLimits = SERVING_LIMITS  # every stream's, whoever calls
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, the verifier's tier token, reflection


def add_serving_flags(flags: ServiceFlags, address: str) -> None:
    """``--address`` (defaulting to ``address``), ``--grace``, ``--metrics-port`` / ``--metrics-address``
    and the stream limits."""
    flags.add_address("--address", address, "host:port to listen on")
    flags.add("--grace", 30.0, float, "seconds open streams get to finish on SIGTERM", minimum=0)
    flags.add("--metrics-port", 0, int, "Prometheus /metrics port; 0 = off", minimum=0)
    flags.add("--metrics-address", "", str, "host /metrics listens on (empty: the host of --address)", metavar="HOST")
    d, beyond = SERVING_LIMITS, "; beyond, the stream is refused (RESOURCE_EXHAUSTED)"
    flags.add("--max-stream-tokens", d.max_stream_tokens, int, f"context tokens per stream{beyond}", minimum=1)
    flags.add("--max-budget-nodes", d.max_budget_nodes, int, f"tree nodes a stream may ask for{beyond}", minimum=1)
    flags.add("--max-budget-depth", d.max_budget_depth, int, f"tree depth a stream may ask for{beyond}", minimum=1)
    add_security_flags(flags, "the verifier (its --proposer-token-file)")


def serving_config(flags: ServiceFlags, a: argparse.Namespace) -> ServingConfig:
    """The parsed serving flags (checked by ``ServiceFlags.parse``; files by ``security_config``)."""
    limits = StreamLimits(a.max_stream_tokens, a.max_budget_nodes, a.max_budget_depth)
    return ServingConfig(
        address=a.address,
        grace_s=a.grace,
        metrics_port=a.metrics_port,
        metrics_address=a.metrics_address,
        limits=limits,
        security=security_config(flags, a),
    )


async def serve_proposer(
    server: grpc.aio.Server,
    proposer: proposer_pb2_grpc.ProposerServiceServicer,
    config: ServingConfig,
    name: str,
    other_services: Sequence[str] = (),
) -> None:
    """Serve ``proposer`` (and the services already added under ``other_services``) until SIGTERM."""
    proposer_pb2_grpc.add_ProposerServiceServicer_to_server(proposer, server)
    names = [proposer_pb2.DESCRIPTOR.services_by_name["ProposerService"].full_name, *other_services]
    await serve(
        server,
        config.address,
        names,
        grace_s=config.grace_s,
        ready_message=f"{name} proposer",
        metrics_port=config.metrics_port,
        metrics_address=config.metrics_address,
        tls=config.security.tls,
        reflection_on=config.security.reflection,
        health_port=config.security.health_port,
    )


def proposer_server(config: ServingConfig) -> grpc.aio.Server:
    """The proposer's gRPC server: every call but health needs the tier token, where one is set."""
    tokens = config.security.tokens
    return new_server(TokenAuth(client_tokens=tokens) if tokens else None)
