"""Gateway configuration: flags, each defaulting to the ``SPECMESH_*`` variable named after it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gateway_svc.tool_parsers import DEFAULT_PARSER, PARSERS
from specmesh_server.auth import token_file
from specmesh_server.flags import ServiceFlags


@dataclass(frozen=True)
class GatewayConfig:
    address: str = "127.0.0.1:8000"  # HTTP host:port
    verifier: str = "127.0.0.1:50051"  # gRPC target; dns:///name:port spreads over verifier replicas
    served_model_name: str = ""  # "" = the verifier's model name
    request_timeout_s: float = 600.0  # gRPC deadline of one generation → 504
    max_n: int = 8  # choices per request (each its own generation)
    grace_s: float = 30.0  # SIGTERM: in-flight streams get this long to finish
    retry_after_s: int = 1  # Retry-After of a 429 (the verifier's queue is full)
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # what /v1 requests must send; () = none
    tls_cert: str = ""  # https with this certificate (and its client certificate towards the verifier)
    tls_key: str = ""
    verifier_tls_ca: str = ""  # TLS to the verifier, trusting this CA; "" = plaintext
    verifier_tls_cert: str = ""  # client certificate for a verifier that requires mutual TLS; "" = tls_cert
    verifier_tls_key: str = ""
    verifier_token: str = field(default="", repr=False)  # the gateway's own token on the verifier
    tool_call_parser: str = DEFAULT_PARSER  # how tool_choice auto reads calls out of the model's text
    response_store: int = 1000  # /v1/responses kept for previous_response_id (per gateway, LRU); 0 = none


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
    f.add(
        "--api-key-file",
        "",
        str,
        "file of the API key(s) clients must send (Authorization: Bearer …), one a line; else 401; "
        "/health and /metrics stay open; empty = no key needed",
        metavar="FILE",
    )
    f.add(
        "--tls-cert",
        "",
        str,
        "PEM certificate: serve https (and, without --verifier-tls-cert, the client certificate shown to the verifier)",
        metavar="FILE",
    )
    f.add("--tls-key", "", str, "PEM private key of --tls-cert", metavar="FILE")
    f.add("--verifier-tls-ca", "", str, "TLS to the verifier, trusting this CA (PEM); empty: plain", metavar="FILE")
    f.add(
        "--verifier-tls-cert",
        "",
        str,
        "client certificate (PEM) for a verifier that requires mutual TLS; empty = --tls-cert",
        metavar="FILE",
    )
    f.add("--verifier-tls-key", "", str, "PEM private key of --verifier-tls-cert", metavar="FILE")
    f.add(
        "--verifier-token-file",
        "",
        str,
        "file of the token the gateway sends to the verifier (its --auth-token-file); empty = none",
        metavar="FILE",
    )
    f.add(
        "--tool-call-parser",
        DEFAULT_PARSER,
        str,
        "how tool_choice auto reads tool calls out of the model's text: the format its family writes "
        "(hermes: <tool_call> blocks, Qwen2.5, Hermes, SmolLM2, the default model's Hermes rendering; "
        "llama3_json: Llama 3.1/3.2 JSON calls; pythonic: [f(x=1)], Llama 3.2/4)",
        choices=tuple(PARSERS),
    )
    f.add(
        "--response-store",
        1000,
        int,
        "/v1/responses answers kept in memory for previous_response_id, per gateway process, the least "
        "recently used dropped first (each API key sees its own); 0 = none kept",
        minimum=0,
    )
    return f


def parse_args(argv: list[str] | None = None) -> GatewayConfig:
    f = build_flags()
    a = f.parse(argv)
    if bool(a.tls_cert) != bool(a.tls_key):
        f.error("--tls-cert and --tls-key go together")
    if bool(a.verifier_tls_cert) != bool(a.verifier_tls_key):
        f.error("--verifier-tls-cert and --verifier-tls-key go together")
    for dest in ("tls_cert", "tls_key", "verifier_tls_ca", "verifier_tls_cert", "verifier_tls_key"):
        if getattr(a, dest) and not os.access(getattr(a, dest), os.R_OK):
            f.error(f"--{dest.replace('_', '-')}: cannot read {getattr(a, dest)}")
    verifier_token = token_file(f, a, "verifier_token_file")
    return GatewayConfig(
        address=a.address,
        verifier=a.verifier,
        served_model_name=a.served_model_name,
        request_timeout_s=a.request_timeout,
        max_n=a.max_n,
        grace_s=a.grace,
        api_keys=token_file(f, a, "api_key_file"),
        tls_cert=a.tls_cert,
        tls_key=a.tls_key,
        verifier_tls_ca=a.verifier_tls_ca,
        verifier_tls_cert=a.verifier_tls_cert,
        verifier_tls_key=a.verifier_tls_key,
        verifier_token=verifier_token[0] if verifier_token else "",
        tool_call_parser=a.tool_call_parser,
        response_store=a.response_store,
    )
