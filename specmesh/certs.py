"""Throwaway certificates for a local deployment (``specmesh up --tls``) and for the tests: a CA,
and certificates it signs for loopback names (``localhost``, ``127.0.0.1``, ``::1``), each usable
both to serve and as a client certificate (mutual TLS).

Needs the ``cryptography`` package (``specmesh[serve]``); imports no torch and no server module.
Not for production: there, certificates come from your PKI (cert-manager in ``k8s/components/tls``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class KeyPair:
    cert_pem: bytes
    key_pem: bytes


@dataclass(frozen=True)
class DevPki:
    """The files ``write_dev_pki`` wrote: a CA, and a certificate (with its key) for every service."""

    ca: Path
    cert: Path
    key: Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(names: Sequence[str]):
    from cryptography import x509

    entries = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def make_ca(common_name: str = "", days: int = 30) -> tuple[KeyPair, object]:
    """A self-signed CA: its PEMs, and the private key object to sign with (``issue``). Each gets a
    name of its own by default, so certificates of two throwaway CAs are never mistaken for each other."""
    common_name = common_name or f"SpecMesh throwaway CA {secrets.token_hex(4)}"
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)), key


def issue(
    ca: KeyPair, ca_key: object, common_name: str, names: Sequence[str] = LOOPBACK_NAMES, days: int = 30
) -> KeyPair:
    """A certificate signed by ``ca`` for ``names`` (DNS names or IP addresses), valid to serve
    (serverAuth) and as a client certificate (clientAuth)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    issuer = x509.load_pem_x509_certificate(ca.cert_pem)
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_dev_pki(folder: Path, names: Sequence[str] = LOOPBACK_NAMES, common_name: str = "specmesh") -> DevPki:
    """A fresh CA and one certificate it signs (serving and client use, ``names``) under ``folder``:
    ``ca.pem``, ``cert.pem``, ``key.pem`` (mode 0600). Every local service serves with that certificate
    and presents it to its peers, so each trusts exactly what this CA signed."""
    ca, ca_key = make_ca()
    leaf = issue(ca, ca_key, common_name, names)
    pki = DevPki(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    _write(pki.ca, ca.cert_pem)
    _write(pki.cert, leaf.cert_pem)
    _write(pki.key, leaf.key_pem, private=True)
    return pki
