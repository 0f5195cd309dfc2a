"""Gateway configuration: flags, each defaulting to the ``SPECMESH_*`` variable named after it."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.server.flags import ServiceFlags


@dataclass(frozen=True)
class GatewayConfig:
    address: str = "127.0.0.1:8000"  # HTTP host:port
    verifier: str = "127.0.0.1:50051"  # gRPC target; dns:///name:port spreads over verifier replicas
    served_model_name: str = ""  # "" = the verifier's model name
    request_timeout_s: float = 600.0  # gRPC deadline of one generation → 504
    max_n: int = 8  # choices per request (each its own generation)
    grace_s: float = 30.0  # SIGTERM: in-flight streams get this long to finish
    retry_after_s: int = 1  # Retry-After of a 429 (the verifier's queue is full)


def build_flags() -> ServiceFlags:
    """The gateway's flags (``specmesh serve gateway --help``)."""
    f = ServiceFlags(
        "specmesh serve gateway",
        "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) over a verifier.",
    )
    f.add_address("--address", "127.0.0.1:8000", "HTTP host:port to listen on")
    f.add("--verifier", "127.0.0.1:50051", str, "verifier gRPC target (dns:///host:port spreads over replicas)")
    f.add("--served-model-name", "", str, "the model id clients send; empty = the verifier's")
    f.add("--request-timeout", 600.0, float, "seconds one generation may take (then 504)", minimum=1e-3)
    f.add("--max-n", 8, int, "most choices (n) one request may ask for", minimum=1)
    f.add("--grace", 30.0, float, "seconds in-flight streams get to finish on SIGTERM", minimum=0)
    return f


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    f = build_flags()
    a = f.parse(argv)
    return GatewayConfig(
        address=a.address,
        verifier=a.verifier,
        served_model_name=a.served_model_name,
        request_timeout_s=a.request_timeout,
        max_n=a.max_n,
        grace_s=a.grace,
    )
