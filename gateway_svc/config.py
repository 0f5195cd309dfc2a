"""Gateway configuration: flags, each defaulting to the ``SPECMESH_*`` variable named after it."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    address: str = "127.0.0.1:8000"  # HTTP host:port
    verifier: str = "127.0.0.1:50051"  # gRPC target; dns:///name:port spreads over verifier replicas
    served_model_name: str = ""  # "" = the verifier's model name
    request_timeout_s: float = 600.0  # gRPC deadline of one generation → 504
    max_n: int = 8  # choices per request (each its own generation)
    grace_s: float = 30.0  # SIGTERM: in-flight streams get this long to finish
    retry_after_s: int = 1  # Retry-After of a 429 (the verifier's queue is full)


def _flag(p: argparse.ArgumentParser, flag: str, env: str, default: str, kind: type, help: str) -> None:
    """A flag whose default comes from SPECMESH_<ENV>; argparse converts (and rejects) it in one line."""
    var = f"SPECMESH_{env}"
    p.add_argument(flag, type=kind, default=os.environ.get(var, default), help=f"{help} [env {var}]")


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    p = argparse.ArgumentParser(
        prog="specmesh serve gateway",
        description="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) over a verifier.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _flag(p, "--address", "GATEWAY_ADDRESS", "127.0.0.1:8000", str, "HTTP host:port to listen on")
    _flag(
        p,
        "--verifier",
        "VERIFIER_TARGET",
        "127.0.0.1:50051",
        str,
        "verifier gRPC target (dns:///host:port spreads over replicas)",
    )
    _flag(p, "--served-model-name", "SERVED_MODEL_NAME", "", str, "the model id clients send; empty = the verifier's")
    _flag(p, "--request-timeout", "REQUEST_TIMEOUT", "600", float, "seconds one generation may take (then 504)")
    _flag(p, "--max-n", "MAX_N", "8", int, "most choices (n) one request may ask for")
    _flag(p, "--grace", "GRACE", "30", float, "seconds in-flight streams get to finish on SIGTERM")
    a = p.parse_args(argv)
    host, sep, port = a.address.rpartition(":")
    if not sep or not host or not port.isdigit():
        p.error(f"--address expects HOST:PORT, got {a.address!r}")
    if a.max_n < 1:
        p.error(f"--max-n must be >= 1, got {a.max_n}")
    if a.request_timeout <= 0:
        p.error(f"--request-timeout must be > 0, got {a.request_timeout}")
    return GatewayConfig(
        address=a.address,
        verifier=a.verifier,
        served_model_name=a.served_model_name,
        request_timeout_s=a.request_timeout,
        max_n=a.max_n,
        grace_s=a.grace,
    )
