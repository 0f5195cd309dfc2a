"""The security flags every SpecMesh gRPC service takes, parsed into one frozen config:
TLS of its port (``specmesh_server.tls``), the token its callers must send
(``specmesh_server.auth``) and whether it serves gRPC reflection."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from specmesh_server.auth import add_auth_token_flag, token_file
from specmesh_server.flags import ServiceFlags, boolean
from specmesh_server.tls import TlsConfig, add_tls_flags, tls_config


@dataclass(frozen=True)
class ServerSecurity:
    tls: TlsConfig = field(default_factory=TlsConfig)
    tokens: tuple[str, ...] = ()  # what callers must send (authorization: Bearer …); () = no token needed
    reflection: bool = True  # serve gRPC reflection (grpcurl, grpcui): on for local development
    health_port: int = 0  # also the health check alone, plaintext, on this port (kubelet probes of a TLS port)

    def __repr__(self) -> str:  # never print a token
        return (
            f"ServerSecurity(tls={self.tls!r}, tokens=<{len(self.tokens)}>, reflection={self.reflection}, "
            f"health_port={self.health_port})"
        )


def add_security_flags(flags: ServiceFlags, callers: str) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-client-ca``, ``--health-port``, ``--auth-token-file``
    (``callers``: who sends that token) and ``--reflection``."""
    add_tls_flags(flags)
    flags.add(
        "--health-port",
        0,
        int,
        "also serve the gRPC health check alone, plaintext, on this port (host of --address): for probes that "
        "cannot speak TLS, as kubelet's gRPC probes; 0 = off",
        minimum=0,
    )
    add_auth_token_flag(flags, callers)
    flags.add(
        "--reflection",
        True,
        boolean,
        "serve gRPC reflection (lists this port's services for grpcurl); switch off in production",
    )


def security_config(flags: ServiceFlags, a: argparse.Namespace, *peer_cas: str) -> ServerSecurity:
    """The parsed security flags (``peer_cas``: the service's ``--<peer>-tls-ca`` dests, checked readable)."""
    return ServerSecurity(
        tls=tls_config(flags, a, *peer_cas),
        tokens=token_file(flags, a, "auth_token_file"),
        reflection=a.reflection,
        health_port=a.health_port,
    )
