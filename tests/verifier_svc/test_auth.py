"""A secured verifier as a real process: mutual TLS on its ports and to its proposers, client and
admin tokens, AdminService on its own loopback port, reflection; the gateway in front with an API
key; the CLI with --token-file.

One verifier for the module (mutual TLS with CA "a", a client token, an admin token,
``--admin-address``) with two proposer tiers: a real n-gram proposer (mutual TLS with CA "a" and
the tier token: speculation works end to end) and a recording ProposerService in this process
whose certificate CA "b" signed: it must never receive a Start.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import httpx
import openai
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support import start_gateway, start_verifier, stop_process, stop_verifier

from specmesh import Client, SamplingParams, SpecDecodeParams, TlsOptions
from specmesh.certs import write_dev_pki
from specmesh.credentials import channel as open_channel
from specmesh.deploy import free_port, wait_healthy
from specmesh.health import check_health
from specmesh.v1 import admin_pb2, proposer_pb2, proposer_pb2_grpc

pytestmark = pytest.mark.slow
# An edit task: the answer repeats the prompt, so the n-gram proposer's trees get accepted.
PROMPT = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog."
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TOKENS = {"client": "client-token-1", "admin": "admin-token-1", "tier": "tier-token-1", "api": "sk-test-key-1"}


class RecordingProposer(proposer_pb2_grpc.ProposerServiceServicer):
    """Counts every Propose call and Start it receives; answers empty trees."""

    def __init__(self) -> None:
        self.calls = 0
        self.starts: list[proposer_pb2.ProposeStart] = []

    def Propose(self, request_iterator, context):
        self.calls += 1
        for req in request_iterator:
            if req.HasField("start"):
                self.starts.append(req.start)
            yield proposer_pb2.ProposeResponse()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    return write_dev_pki(root / "a"), write_dev_pki(root / "b")


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("secrets")
    for name, token in TOKENS.items():
        (folder / name).write_text(token + "\n")
    return folder


@pytest.fixture(scope="module")
def rogue(pki):
    """A ProposerService with a certificate from the other CA ("b")."""
    _, b = pki
    recorder = RecordingProposer()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    proposer_pb2_grpc.add_ProposerServiceServicer_to_server(recorder, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_secure_port(address, grpc.ssl_server_credentials([(b.key.read_bytes(), b.cert.read_bytes())]))
    server.start()
    yield address, recorder
    server.stop(None)


@pytest.fixture(scope="module")
def ngram(pki, secrets, tmp_path_factory):
    a, _ = pki
    address = f"127.0.0.1:{free_port()}"
    log = (tmp_path_factory.mktemp("ngram") / "ngram.log").open("wb")
    tls = ["--tls-cert", str(a.cert), "--tls-key", str(a.key), "--tls-client-ca", str(a.ca)]
    cmd = [sys.executable, "-m", "specmesh", "serve", "ngram", "--address", address, *tls]
    proc = subprocess.Popen([*cmd, "--auth-token-file", str(secrets / "tier")], stdout=log, stderr=subprocess.STDOUT)
    wait_healthy(address, 60, proc, tls=TlsOptions(ca=a.ca, cert=a.cert, key=a.key))
    yield address
    stop_process(proc)


@pytest.fixture(scope="module")
def mtls(pki) -> TlsOptions:
    a, _ = pki
    return TlsOptions(ca=a.ca, cert=a.cert, key=a.key)


@pytest.fixture(scope="module")
def secured(pki, secrets, ngram, rogue, mtls, tmp_path_factory, lm):
    """The verifier; yields (its client address, its admin address)."""
    a, _ = pki
    admin_address = f"127.0.0.1:{free_port()}"
    v = start_verifier(
        tmp_path_factory.mktemp("verifier"),
        *("--tls-cert", str(a.cert), "--tls-key", str(a.key), "--tls-client-ca", str(a.ca)),
        *("--auth-token-file", str(secrets / "client"), "--admin-token-file", str(secrets / "admin")),
        *("--admin-address", admin_address),
        *("--proposer", f"ngram={ngram}", "--proposer", f"rogue={rogue[0]}", "--auto-proposers", "ngram"),
        *("--proposer-tls-ca", str(a.ca), "--proposer-token-file", str(secrets / "tier")),
        *("--max-running", "8"),
        tls=mtls,
    )
    yield v, admin_address
    stop_verifier(v)


@pytest.fixture(scope="module")
def address(secured) -> str:
    return secured[0].address


@pytest.fixture(scope="module")
def admin_address(secured) -> str:
    return secured[1]


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_a_plaintext_client_fails_cleanly(address):
    with Client(address, token=TOKENS["client"]) as c:
        assert _code(lambda: c.complete("Hi", GREEDY)) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_client_without_a_certificate(address, pki):
    a, b = pki
    with Client(address, tls=TlsOptions(ca=a.ca), token=TOKENS["client"]) as c:
        assert _code(lambda: c.complete("Hi", GREEDY)) == grpc.StatusCode.UNAVAILABLE
    with Client(address, tls=TlsOptions(ca=a.ca, cert=b.cert, key=b.key), token=TOKENS["client"]) as c:
        assert _code(lambda: c.complete("Hi", GREEDY)) == grpc.StatusCode.UNAVAILABLE


def test_the_sdk_with_the_ca_its_certificate_and_token_gets_speculation_over_mutual_tls(address, mtls):
    with Client(address, tls=mtls, token=TOKENS["client"]) as c:
        out = c.complete(PROMPT, GREEDY, SpecDecodeParams(proposer="ngram"), chat=True)
    m = out.summary.speculation
    assert out.summary.completion_tokens == 24
    assert m.fallback_reason == "" and m.drafted_tokens > 0 and m.accepted_tokens > 0, m


def test_a_proposer_with_an_untrusted_certificate_gets_no_start_and_the_request_decodes_plainly(address, mtls, rogue):
    _, recorder = rogue
    with Client(address, tls=mtls, token=TOKENS["client"]) as c:
        out = c.complete(PROMPT, GREEDY, SpecDecodeParams(proposer="rogue"), chat=True)
        plain = c.complete(PROMPT, GREEDY, SpecDecodeParams(proposer="none"), chat=True)
    m = out.summary.speculation
    assert recorder.calls == 0 and recorder.starts == []  # the prompt never left the verifier
    assert out.token_ids == plain.token_ids and m.drafted_tokens == 0
    assert "proposer 'rogue' failed: UNAVAILABLE" in m.fallback_reason, m.fallback_reason


def test_a_missing_or_wrong_token_is_unauthenticated(address, admin_address, mtls):
    for token in ("", "not-a-token"):
        with Client(address, tls=mtls, token=token) as c:
            assert _code(lambda c=c: c.complete("Hi", GREEDY)) == grpc.StatusCode.UNAUTHENTICATED
        with Client(admin_address, tls=mtls, token=token) as c:
            assert _code(c.stats) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(c.policy) == grpc.StatusCode.UNAUTHENTICATED


def test_a_client_token_on_the_admin_methods_is_permission_denied(admin_address, mtls):
    with Client(admin_address, tls=mtls, token=TOKENS["client"]) as c:
        off = admin_pb2.SpeculationPolicy(mode=admin_pb2.POLICY_MODE_OFF)
        assert _code(lambda: c.set_policy(off)) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(c.router_stats) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(c.policy) == grpc.StatusCode.PERMISSION_DENIED
        assert c.stats().server.model  # aggregate statistics: a client token may read them (the gateway does)


def test_the_admin_token_works_and_health_needs_no_token(address, admin_address, mtls):
    with Client(admin_address, tls=mtls, token=TOKENS["admin"]) as c:
        policy = c.policy()
        assert c.set_policy(policy) == policy
        assert c.router_stats().backend
        assert c.stats().server.model
    with Client(address, tls=mtls, token=TOKENS["admin"]) as c:  # an admin token may generate too
        assert c.complete("Hi", SamplingParams(temperature=0, max_tokens=2)).summary.completion_tokens == 2
    assert check_health(address, tls=mtls) == "SERVING"
    assert check_health(admin_address, tls=mtls) == "SERVING"


def _services(address: str, tls: TlsOptions) -> set[str]:
    with open_channel(address, tls) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    return {s.name for s in reply.list_services_response.service}


def test_admin_service_lives_only_on_the_admin_address_and_reflection_says_so(address, admin_address, mtls):
    client_port = _services(address, mtls)
    assert "specmesh.v1.GenerationService" in client_port and "specmesh.v1.AdminService" not in client_port
    assert "specmesh.v1.AdminService" in _services(admin_address, mtls)
    with Client(address, tls=mtls, token=TOKENS["admin"]) as c:
        assert _code(c.policy) == grpc.StatusCode.UNIMPLEMENTED


def _cli(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_")}
    env["SPECMESH_CACHE_DIR"] = str(tmp_path)  # no local deployment's credentials
    cmd = [sys.executable, "-m", "specmesh", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_the_cli_with_token_file(address, admin_address, pki, secrets, tmp_path):
    a, _ = pki
    tls = ["--tls-ca", str(a.ca), "--tls-cert", str(a.cert), "--tls-key", str(a.key)]
    out = _cli(tmp_path, "generate", "Say hi.", "--target", address, *tls, "--token-file", str(secrets / "client"),
               "--max-tokens", "4")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "[4 tokens" in out.stderr
    out = _cli(tmp_path, "generate", "Say hi.", "--target", address, *tls, "--max-tokens", "4")
    assert out.returncode != 0 and "specmesh generate: UNAUTHENTICATED" in out.stderr
    admin = ["admin", "--target", admin_address, *tls]
    out = _cli(tmp_path, *admin, "--token-file", str(secrets / "client"), "policy", "--mode", "off")
    assert out.returncode != 0 and "specmesh admin: PERMISSION_DENIED" in out.stderr, out.stderr
    out = _cli(tmp_path, *admin, "--token-file", str(secrets / "admin"), "router-stats")
    assert out.returncode == 0 and "backend:" in out.stdout, out.stderr


@pytest.fixture(scope="module")
def gateway(address, pki, secrets, tmp_path_factory):
    a, _ = pki
    g = start_gateway(
        tmp_path_factory.mktemp("gateway"),
        address,
        *("--api-key-file", str(secrets / "api"), "--verifier-token-file", str(secrets / "client")),
        *("--tls-cert", str(a.cert), "--tls-key", str(a.key), "--verifier-tls-ca", str(a.ca)),
        *("--served-model-name", "smollm2"),  # the verifier's AdminService (GetStats) is on its admin address
        ca=a.ca,
    )
    yield g
    stop_process(g.proc)


def _openai(gateway, pki, key: str) -> openai.OpenAI:
    a, _ = pki
    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(a.ca)))
    return openai.OpenAI(base_url=gateway.url, api_key=key, http_client=http, max_retries=0)


def test_the_gateway_answers_401_without_the_api_key_and_serves_with_it(gateway, pki):
    a, _ = pki
    with pytest.raises(openai.AuthenticationError) as err, _openai(gateway, pki, "sk-wrong") as wrong:
        wrong.models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    context = ssl.create_default_context(cafile=str(a.ca))
    r = httpx.post(f"{gateway.url}/chat/completions", json={"model": "smollm2", "messages": []}, verify=context)
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(gateway.url.removesuffix("/v1") + "/health", verify=context).status_code == 200  # open
    root = gateway.url.removesuffix("/v1")
    for path in ("/openapi.json", "/docs", "//v1/models", "/V1/models"):  # closed by default, not only /v1/…
        assert httpx.get(root + path, verify=context).status_code == 401, path
    with _openai(gateway, pki, TOKENS["api"]) as client:
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        resp = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0
        )
    assert resp.usage.completion_tokens == 4


def test_a_token_file_lists_several_tokens(tmp_path):
    from specmesh.credentials import read_token, read_tokens

    f = tmp_path / "t"
    f.write_text("\nnew-token\n  old-token \n")
    assert read_tokens(f) == ("new-token", "old-token") and read_token(f) == "new-token"


def test_concurrent_secured_streams(address, mtls):
    results = []

    def run() -> None:
        with Client(address, tls=mtls, token=TOKENS["client"]) as c:
            results.append(c.complete("Count to five.", GREEDY, chat=True).summary.completion_tokens)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [24] * 4


def test_tokenize_and_detokenize_need_a_token_as_generate_does_and_the_gateway_its_api_key(address, mtls, gateway, pki):
    for token in ("", "not-a-token"):
        with Client(address, tls=mtls, token=token) as c:
            assert _code(lambda c=c: c.tokenize("Hi")) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda c=c: c.detokenize([1])) == grpc.StatusCode.UNAUTHENTICATED
    with Client(address, tls=mtls, token=TOKENS["client"]) as c:
        assert c.detokenize(c.tokenize("Hi there").tokens) == "Hi there"
    a, _ = pki
    root, context = gateway.url.removesuffix("/v1"), ssl.create_default_context(cafile=str(a.ca))
    body = {"model": "smollm2", "prompt": "Hi there"}
    assert httpx.post(f"{root}/tokenize", json=body, verify=context).status_code == 401
    assert httpx.post(f"{root}/detokenize", json={"tokens": [1]}, verify=context).status_code == 401
    key = {"Authorization": f"Bearer {TOKENS['api']}"}
    tokens = httpx.post(f"{root}/tokenize", json=body, headers=key, verify=context).json()["tokens"]
    resp = httpx.post(f"{root}/detokenize", json={"tokens": tokens}, headers=key, verify=context)
    assert resp.json() == {"prompt": "Hi there"}
