"""`specmesh up --tls --auth`: every service's command line parses with that service's own flags
(the certificates and tokens written at start exist), and the wiring is end to end: mutual TLS
on every gRPC hop, the tier token from verifier to proposers, the client token from gateway to
verifier. (tests/verifier_svc/test_auth.py runs such a deployment's pieces as real processes.)"""

from __future__ import annotations

import stat

from specmesh.deploy import DeploymentConfig, LocalDeployment


def _parse(service: str, argv: list[str]):
    if service == "verifier":
        from verifier_svc.config import parse_args
    elif service == "gateway":
        from gateway_svc.config import parse_args
    elif service == "ngram":
        from proposer_svc.ngram.server import parse_args
    elif service == "suffix":
        from proposer_svc.suffix.server import parse_args
    elif service == "rag":
        from proposer_svc.rag.server import parse_args
    elif service == "head":
        from proposer_svc.head.server import parse_args
    else:
        from proposer_svc.draft.server import parse_args
    return parse_args(argv)


def test_up_tls_auth_wires_every_hop(tmp_path):
    config = DeploymentConfig(
        run_dir=tmp_path, tls=True, auth=True, rag_address="127.0.0.1:50063", draft_address="127.0.0.1:50062",
        head_address="127.0.0.1:50065", gateway_address="127.0.0.1:8000",
    )  # fmt: skip
    dep = LocalDeployment(config)
    dep._write_credentials()
    tls, tokens = dep.tls_files, dep.token_files
    assert all(p.exists() for p in [*tls.values(), *tokens.values()])
    for private in (tls["key"], *tokens.values()):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    parsed = {s.name: _parse(s.name, s.argv[5:]) for s in dep.services}  # [python, -m, specmesh, serve, NAME, …]
    assert set(parsed) == {"ngram", "suffix", "rag", "draft", "head", "verifier", "gateway"}
    tier = (tokens["proposer"].read_text().strip(),)
    for name in ("ngram", "suffix", "rag", "draft", "head"):
        sec = parsed[name].serving.security
        assert sec.tls.client_ca == str(tls["ca"]) and sec.tls.cert == str(tls["cert"]), name
        assert sec.tokens == tier, name
    v = parsed["verifier"]
    assert v.security.tls.client_ca == str(tls["ca"]) and v.proposer_tls_ca == str(tls["ca"])
    assert (v.proposer_token,) == tier
    assert v.security.tokens == (dep.token("client"),) and v.admin_tokens == (dep.token("admin"),)
    g = parsed["gateway"]
    assert g.verifier_tls_ca == str(tls["ca"]) and g.tls_cert == str(tls["cert"])  # https + client certificate
    assert g.verifier_token == dep.token("client") and g.api_keys == (dep.token("api_key"),)
    assert dep.gateway_url.startswith("https://")


def test_up_without_tls_or_auth_passes_no_security_flag(tmp_path):
    config = DeploymentConfig(run_dir=tmp_path, gateway_address="127.0.0.1:8000", head_address="127.0.0.1:50065")
    dep = LocalDeployment(config)
    for s in dep.services:
        assert not [a for a in s.argv if "tls" in a or "token" in a or "api-key" in a], s.argv
    assert dep.client_tls is None and dep.token() == "" and dep.gateway_url.startswith("http://")
