"""TLS of every SpecMesh gRPC server, and of the channels a service opens to its peers.

Flags (every gRPC service, ``add_tls_flags``): ``--tls-cert`` / ``--tls-key`` (PEM files: serve TLS;
without them the port is plaintext, the loopback-development default) and ``--tls-client-ca``
(mutual TLS: only clients presenting a certificate this CA signed may connect). A service that
calls a peer trusts the CA its ``--<peer>-tls-ca`` flag names and, where it has one, presents its
own certificate as the client certificate (``TlsConfig.peer``).

The certificate files are read again when they change (checked at each new connection's
handshake), so a renewed certificate (cert-manager rewrites the mounted Secret) is served without
a restart. Imports grpc only.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from specmesh.credentials import TlsOptions
from specmesh_server.flags import ServiceFlags

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsConfig:
    cert: str = ""  # PEM certificate chain; "" = plaintext
    key: str = ""  # its private key
    client_ca: str = ""  # mutual TLS: clients must present a certificate this CA signed; "" = any client

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    @property
    def describe(self) -> str:
        """How the port is served, for the start-up line."""
        return "mutual TLS" if self.client_ca else "TLS" if self.cert else "plaintext"

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``add_secure_port``; the files are re-read when their modification time changes."""
        return _ReloadingCredentials(self).credentials()

    def peer(self, ca: str) -> TlsOptions | None:
        """How this service reaches a peer whose certificate ``ca`` signed ("" = plaintext): that CA
        trusted, this service's own certificate presented as the client certificate (mutual TLS)."""
        if not ca:
            return None
        return TlsOptions(ca=ca, cert=self.cert or None, key=self.key or None)


class _ReloadingCredentials:
    def __init__(self, config: TlsConfig) -> None:
        self.config = config
        self._stamp = self._mtimes()

    def _paths(self) -> list[str]:
        return [p for p in (self.config.cert, self.config.key, self.config.client_ca) if p]

    def _mtimes(self) -> tuple[float, ...]:
        try:
            return tuple(os.stat(p).st_mtime_ns for p in self._paths())
        except OSError:
            return ()

    def _load(self) -> grpc.ServerCertificateConfiguration:
        c = self.config
        pairs = [(Path(c.key).read_bytes(), Path(c.cert).read_bytes())]
        ca = Path(c.client_ca).read_bytes() if c.client_ca else None
        return grpc.ssl_server_certificate_configuration(pairs, root_certificates=ca)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC asks at every handshake: a new configuration when the files changed, else None (keep)."""
        stamp = self._mtimes()
        if not stamp or stamp == self._stamp:
            return None
        try:
            config = self._load()
        except (OSError, ValueError) as exc:  # half-written during a rotation: keep serving the old one
            log.warning("TLS files changed but cannot be read yet (%s); serving the previous certificate", exc)
            return None
        self._stamp = stamp
        log.info("TLS certificate reloaded from %s", self.config.cert)
        return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._load(), self._fetch, require_client_authentication=bool(self.config.client_ca)
        )


def add_tls_flags(flags: ServiceFlags) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-client-ca``: TLS of the service's own port."""
    flags.add("--tls-cert", "", str, "PEM certificate (chain) to serve TLS with; empty = plaintext", metavar="FILE")
    flags.add("--tls-key", "", str, "PEM private key of --tls-cert", metavar="FILE")
    flags.add(
        "--tls-client-ca",
        "",
        str,
        "mutual TLS: accept only clients whose certificate this CA (PEM) signed; needs --tls-cert",
        metavar="FILE",
    )


def tls_config(flags: ServiceFlags, a: argparse.Namespace, *peer_cas: str) -> TlsConfig:
    """The parsed TLS flags, every file checked readable (one-line flag errors); ``peer_cas``: the
    service's ``--<peer>-tls-ca`` flags (dests), checked the same way."""
    if bool(a.tls_cert) != bool(a.tls_key):
        flags.error("--tls-cert and --tls-key go together")
    if a.tls_client_ca and not a.tls_cert:
        flags.error("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    for dest in ("tls_cert", "tls_key", "tls_client_ca", *peer_cas):
        path = getattr(a, dest)
        if path and not os.access(path, os.R_OK):
            flags.error(f"--{dest.replace('_', '-')}: cannot read {path}")
    return TlsConfig(cert=a.tls_cert, key=a.tls_key, client_ca=a.tls_client_ca)


def listen(server: grpc.aio.Server, address: str, tls: TlsConfig | None) -> int:
    """Bind ``server`` to ``address``: TLS with a certificate in ``tls``, else plaintext. The port (0: failed)."""
    if tls is not None and tls.enabled:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)
