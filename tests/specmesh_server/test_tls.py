"""TLS, mutual TLS, tier tokens and the reflection switch on a real gRPC service process (the n-gram
proposer: no model, starts in a second), through the shared helpers every service uses
(specmesh_server/tls.py, auth.py, security.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specmesh.certs import write_dev_pki
from specmesh.credentials import TlsOptions, bearer
from specmesh.credentials import channel as open_channel
from specmesh.deploy import free_port, wait_healthy
from specmesh.health import check, check_health
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc
from specmesh_server.auth import TokenAuth

pytestmark = pytest.mark.slow
TOKEN = "tier-token-for-the-test"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Two independent throwaway CAs, each with one certificate for the loopback names."""
    root = tmp_path_factory.mktemp("pki")
    return write_dev_pki(root / "a"), write_dev_pki(root / "b")


def _start_ngram(tmp: Path, *args: str, tls: TlsOptions | None = None) -> tuple[str, subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "specmesh", "serve", "ngram", "--address", address, *args]
    with (tmp / f"ngram-{address.rsplit(':', 1)[1]}.log").open("wb") as log:  # the child keeps its own copy
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_healthy(address, 60, proc, tls=tls)
    return address, proc


@pytest.fixture(scope="module")
def mtls_ngram(pki, tmp_path_factory):
    """Mutual TLS (CA a), a tier token, reflection off."""
    a, _ = pki
    token_file = tmp_path_factory.mktemp("secrets") / "tier.token"
    token_file.write_text(f"{TOKEN}\n")
    tls = TlsOptions(ca=a.ca, cert=a.cert, key=a.key)
    address, proc = _start_ngram(
        tmp_path_factory.mktemp("ngram"),
        *("--tls-cert", str(a.cert), "--tls-key", str(a.key), "--tls-client-ca", str(a.ca)),
        *("--auth-token-file", str(token_file), "--reflection", "off"),
        tls=tls,
    )
    yield address
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def tls_ngram(pki, tmp_path_factory):
    """Server-only TLS (CA a), no token, reflection on (the default)."""
    a, _ = pki
    address, proc = _start_ngram(
        tmp_path_factory.mktemp("ngram"), "--tls-cert", str(a.cert), "--tls-key", str(a.key), tls=TlsOptions(ca=a.ca)
    )
    yield address
    proc.terminate()
    proc.wait(30)


def _propose(address: str, tls: TlsOptions | None, token: str = "") -> proposer_pb2.ProposeResponse:
    start = proposer_pb2.ProposeStart(
        prompt_token_ids=[1, 2, 3, 1, 2], budget=proposer_pb2.TreeBudget(max_nodes=8, max_depth=4)
    )
    with open_channel(address, tls) as ch:
        stub = proposer_pb2_grpc.ProposerServiceStub(ch)
        replies = stub.Propose(iter([proposer_pb2.ProposeRequest(start=start)]), timeout=10, metadata=bearer(token))
        return next(iter(replies))


def test_a_tls_port_refuses_a_plaintext_client_and_serves_one_that_trusts_its_ca(tls_ngram, pki):
    a, b = pki
    assert check_health(tls_ngram).startswith("UNREACHABLE (UNAVAILABLE")  # plaintext: fails cleanly
    assert check_health(tls_ngram, tls=TlsOptions(ca=b.ca)).startswith("UNREACHABLE (UNAVAILABLE")  # wrong CA
    assert check_health(tls_ngram, tls=TlsOptions(ca=a.ca)) == "SERVING"
    assert _propose(tls_ngram, TlsOptions(ca=a.ca)).tree.tokens  # the cycle 1 2 3 matches: a tree
    with open_channel(tls_ngram, TlsOptions(ca=a.ca)) as ch:  # reflection on by default
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "specmesh.v1.ProposerService" in {s.name for s in reply.list_services_response.service}


def test_mutual_tls_refuses_a_client_without_a_certificate_of_its_ca(mtls_ngram, pki):
    a, b = pki
    assert check_health(mtls_ngram, tls=TlsOptions(ca=a.ca)).startswith("UNREACHABLE (UNAVAILABLE")
    assert check_health(mtls_ngram, tls=TlsOptions(ca=a.ca, cert=b.cert, key=b.key)).startswith("UNREACHABLE")
    assert check_health(mtls_ngram, tls=TlsOptions(ca=a.ca, cert=a.cert, key=a.key)) == "SERVING"


def test_the_tier_token_is_required_for_proposals_but_not_for_health(mtls_ngram, pki):
    a, _ = pki
    tls = TlsOptions(ca=a.ca, cert=a.cert, key=a.key)
    for token in ("", "wrong"):
        with pytest.raises(grpc.RpcError) as err:
            _propose(mtls_ngram, tls, token)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
    assert _propose(mtls_ngram, tls, TOKEN).tree.tokens  # the cycle 1 2 3 matches: a tree
    with open_channel(mtls_ngram, tls) as ch:
        assert check(ch) == "SERVING"  # no token


def test_reflection_off_serves_no_reflection(mtls_ngram, pki):
    a, _ = pki
    with open_channel(mtls_ngram, TlsOptions(ca=a.ca, cert=a.cert, key=a.key)) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_renewed_certificate_is_served_without_a_restart(tmp_path, pki):
    a, _ = pki
    folder = tmp_path / "live"
    folder.mkdir()
    for f in (a.cert, a.key):
        shutil.copy(f, folder / f.name)
    address, proc = _start_ngram(
        tmp_path, "--tls-cert", str(folder / "cert.pem"), "--tls-key", str(folder / "key.pem"), tls=TlsOptions(a.ca)
    )
    try:
        renewed = write_dev_pki(tmp_path / "renewed")  # a new CA signs the renewed certificate
        for f in (renewed.cert, renewed.key):
            shutil.copy(f, folder / f.name)
            os.utime(folder / f.name, ns=(1, 10**18))  # a different mtime, however fast the copy
        assert check_health(address, tls=TlsOptions(ca=renewed.ca)) == "SERVING"
        assert check_health(address, tls=TlsOptions(ca=a.ca)).startswith("UNREACHABLE")
    finally:
        proc.terminate()
        proc.wait(30)


def test_token_auth_codes():
    auth = TokenAuth(["c1"], ["a1"], ["/pkg.Admin/"], ["/pkg.Admin/Read"])
    md = lambda t: [("authorization", f"Bearer {t}")]  # noqa: E731
    assert auth.check("/grpc.health.v1.Health/Check", []) is None
    assert auth.check("/pkg.Gen/Go", md("c1")) is None and auth.check("/pkg.Gen/Go", md("a1")) is None
    assert auth.check("/pkg.Gen/Go", [])[0] == grpc.StatusCode.UNAUTHENTICATED
    assert auth.check("/pkg.Gen/Go", md("x"))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert auth.check("/pkg.Admin/Set", md("c1"))[0] == grpc.StatusCode.PERMISSION_DENIED
    assert auth.check("/pkg.Admin/Set", md("x"))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert auth.check("/pkg.Admin/Set", md("a1")) is None
    assert auth.check("/pkg.Admin/Read", md("c1")) is None
    assert auth.check("/pkg.Gen/Go", [("authorization", "Basic c1")])[0] == grpc.StatusCode.UNAUTHENTICATED
