"""What every proposer process shares: its serving flags (address, grace, metrics port) and the
gRPC server that carries ``ProposerService`` beside health and reflection."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from specmesh.server.flags import ServiceFlags
from specmesh.server.serving import serve
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc


@dataclass(frozen=True)
class ServingConfig:
    address: str
    grace_s: float = 30.0  # SIGTERM: open streams get this long to finish
    metrics_port: int = 0  # Prometheus /metrics; 0 = off


def add_serving_flags(flags: ServiceFlags, address: str) -> None:
    """``--address`` (defaulting to ``address``), ``--grace`` and ``--metrics-port``."""
    flags.add_address("--address", address, "host:port to listen on")
    flags.add("--grace", 30.0, float, "seconds open streams get to finish on SIGTERM", minimum=0)
    flags.add("--metrics-port", 0, int, "Prometheus /metrics port; 0 = off", minimum=0)


def serving_config(a: argparse.Namespace) -> ServingConfig:
    """The parsed serving flags (checked by ``ServiceFlags.parse``)."""
    return ServingConfig(address=a.address, grace_s=a.grace, metrics_port=a.metrics_port)


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
    )
