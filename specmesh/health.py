"""The standard gRPC health check (``grpc.health.v1.Health/Check``) over plain grpcio.

grpcio-health-checking is a server dependency; a client needs only this one unary RPC. Its two
messages are declared here in a private descriptor pool, so protobuf does the (de)serialization
and nothing clashes with grpc_health's own registration when both are loaded.
"""

from __future__ import annotations

import subprocess
import time

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from specmesh.credentials import TlsOptions
from specmesh.credentials import channel as open_channel

_CHECK = "/grpc.health.v1.Health/Check"
# While a service starts, its port refuses connections, and a channel backs off after each refusal
# (gRPC's default: 1 s, then 1.6x a time, up to 120 s): a verifier serving at 5.9 s was seen at 9.8 s. Waiting
# for one, the channel retries at the pace it is polled instead.
WAIT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 200),
)


def _messages() -> tuple[type, type]:
    f = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="grpc/health/v1/health.proto", package="grpc.health.v1")
    proto.syntax = "proto3"
    req = proto.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    resp = proto.message_type.add(name="HealthCheckResponse")
    status = resp.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        status.value.add(name=name, number=number)
    resp.field.add(
        name="status", number=1, type=f.TYPE_ENUM, label=f.LABEL_OPTIONAL,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
    )  # fmt: skip
    file = descriptor_pool.DescriptorPool().Add(proto)
    return tuple(message_factory.GetMessageClass(file.message_types_by_name[n]) for n in (req.name, resp.name))


HealthCheckRequest, HealthCheckResponse = _messages()


def check(channel: grpc.Channel, service: str = "", timeout_s: float = 2.0) -> str:
    """The serving status's name (SERVING, NOT_SERVING, …); raises grpc.RpcError."""
    rpc = channel.unary_unary(
        _CHECK,
        request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )
    resp = rpc(HealthCheckRequest(service=service), timeout=timeout_s)
    return HealthCheckResponse.ServingStatus.Name(resp.status)


def check_health(address: str, timeout_s: float = 2.0, tls: TlsOptions | None = None) -> str:
    """SERVING / NOT_SERVING / UNREACHABLE (with the gRPC error); ``tls`` for a TLS port (no token:
    health checks are unauthenticated)."""
    try:
        with open_channel(address, tls) as channel:
            return check(channel, timeout_s=timeout_s)
    except grpc.RpcError as exc:
        return f"UNREACHABLE ({exc.code().name})"


def wait_healthy(
    address: str, timeout_s: float, proc: subprocess.Popen | None = None, tls: TlsOptions | None = None
) -> None:
    """Block until ``address`` answers SERVING; raise on timeout or when ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    with open_channel(address, tls, WAIT_OPTIONS) as channel:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"service at {address} exited with code {proc.returncode}")
            try:
                if check(channel, timeout_s=1.0) == "SERVING":
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"service at {address} not healthy after {timeout_s:.0f} s")
