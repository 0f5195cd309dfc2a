"""What a SpecMesh client channel presents: TLS (a CA to trust, a client certificate under mutual
TLS) and a bearer token (``authorization: Bearer <token>`` metadata on every call).

Used by the SDK, the CLI, the gateway's verifier channel and the verifier's proposer channels;
imports grpc only (a client-only install has it).
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

# The SDK's and the CLI's token when none is given (the token itself; the CLI also reads a file).
TOKEN_ENV = "SPECMESH_TOKEN"
AUTHORIZATION = "authorization"  # gRPC metadata keys are lower case

Pem = str | bytes | os.PathLike | None  # a PEM file's path, or the PEM itself


def read_pem(value: Pem) -> bytes | None:
    """PEM bytes from a path or from the PEM text itself (None stays None).

    >>> read_pem(b"-----BEGIN CERTIFICATE-----")[:5], read_pem(None)
    (b'-----', None)
    """
    if value is None or value == "":
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and value.lstrip().startswith("-----BEGIN"):
        return value.encode()
    return Path(value).read_bytes()


@dataclass(frozen=True)
class TlsOptions:
    """TLS of a channel: ``ca`` the certificate authority that signed the server's certificate (None:
    the system's trust store); ``cert`` + ``key`` a client certificate, for servers that require
    mutual TLS; ``server_name`` the name to verify when it differs from the target's host."""

    ca: Pem = None
    cert: Pem = None
    key: Pem = None
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("TlsOptions: a client certificate needs both cert and key")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(read_pem(self.ca), read_pem(self.key), read_pem(self.cert))

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def read_token(path: str | os.PathLike) -> str:
    """The first non-empty line of a token file (a Kubernetes Secret mounted as a file, say).

    A file may list several tokens, one a line (servers accept each: rotation); a client sends the first.
    """
    tokens = read_tokens(path)
    if not tokens:
        raise ValueError(f"token file {path} is empty")
    return tokens[0]


def read_tokens(path: str | os.PathLike) -> tuple[str, ...]:
    """Every token of a token file: its non-empty lines, stripped."""
    return tuple(line.strip() for line in Path(path).read_text().splitlines() if line.strip())


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (none without one).

    >>> bearer("s3cret"), bearer("")
    ((('authorization', 'Bearer s3cret'),), ())
    """
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()


def token_of(header: str | bytes) -> bytes:
    """The token of an ``Authorization`` value: ``Bearer <token>`` → the token, anything else → b"".

    >>> token_of("Bearer abc "), token_of(b"bearer x"), token_of("Basic abc")
    (b'abc', b'x', b'')
    """
    text = header.encode() if isinstance(header, str) else header
    scheme, _, token = text.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def token_matches(token: bytes | None, known: Sequence[bytes]) -> bool:
    """Whether ``token`` is one of ``known``, compared in constant time against every one (the time
    taken says neither whether nor which one matched).

    >>> token_matches(b"b", (b"a", b"b")), token_matches(None, (b"a",)), token_matches(b"", (b"a",))
    (True, False, False)
    """
    found = False
    for k in known:
        found |= token is not None and hmac.compare_digest(token, k)
    return found


def env_token() -> str:
    return os.environ.get(TOKEN_ENV, "").strip()


def channel(
    target: str, tls: TlsOptions | None = None, options: Sequence[tuple[str, Any]] = (), *, aio: bool = False
) -> grpc.Channel | grpc.aio.Channel:
    """A channel to ``target``: TLS with ``tls``, else plaintext."""
    opts = [*options, *(tls.channel_options() if tls else [])]
    if aio:
        if tls is None:
            return grpc.aio.insecure_channel(target, options=opts)
        return grpc.aio.secure_channel(target, tls.credentials(), options=opts)
    if tls is None:
        return grpc.insecure_channel(target, options=opts)
    return grpc.secure_channel(target, tls.credentials(), options=opts)


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """The CLI's connection flags: ``--tls-ca`` / ``--tls-cert`` / ``--tls-key`` and ``--token-file``,
    each defaulting to its ``SPECMESH_*`` variable (the token itself may come in ``SPECMESH_TOKEN``)."""
    env = os.environ.get
    parser.add_argument(
        "--tls-ca",
        default=env("SPECMESH_TLS_CA", ""),
        metavar="FILE",
        help="connect over TLS, trusting this CA (PEM) [env SPECMESH_TLS_CA]",
    )
    parser.add_argument(
        "--tls-cert",
        default=env("SPECMESH_TLS_CERT", ""),
        metavar="FILE",
        help="client certificate (PEM) for a server that requires mutual TLS [env SPECMESH_TLS_CERT]",
    )
    parser.add_argument(
        "--tls-key", default=env("SPECMESH_TLS_KEY", ""), metavar="FILE", help="its key [env SPECMESH_TLS_KEY]"
    )
    parser.add_argument(
        "--token-file",
        default=env("SPECMESH_TOKEN_FILE", ""),
        metavar="FILE",
        help=f"file of the bearer token to send [env SPECMESH_TOKEN_FILE; or the token itself in {TOKEN_ENV}]",
    )


def client_tls(args: argparse.Namespace) -> TlsOptions | None:
    """The TLS the CLI flags ask for (None: plaintext); a client certificate alone implies TLS."""
    if not (args.tls_ca or args.tls_cert):
        return None
    return TlsOptions(ca=args.tls_ca or None, cert=args.tls_cert or None, key=args.tls_key or None)


def client_token(args: argparse.Namespace) -> str:
    """The token the CLI flags name (``--token-file``, else ``$SPECMESH_TOKEN``; "" = none)."""
    return read_token(args.token_file) if args.token_file else env_token()
