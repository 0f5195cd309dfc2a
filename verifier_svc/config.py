"""Verifier configuration: flags, each with an environment-variable default (for containers)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from specmesh.server.packed_linear import add_linears_flag
from verifier_svc.engine import EngineConfig
from verifier_svc.local_proposer import inprocess_kind


@dataclass(frozen=True)
class VerifierConfig:
    address: str = "127.0.0.1:50051"
    model: str | None = None  # None = the default model
    device: str | None = None
    dtype: str | None = None
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    packed_linears: bool = True  # CPU: linear layers through oneDNN with pre-packed weights
    max_context: int = 0  # 0 = the model's max_position_embeddings
    proposers: tuple[tuple[str, str], ...] = ()  # (name, address)
    auto_proposers: tuple[str, ...] | None = None  # what `auto` may pick; None = every configured one
    grace_s: float = 30.0
    redis_url: str = ""  # shared router statistics; "" = in this process only
    stats_prefix: str = "specmesh:stats"
    stats_half_life_s: float = 300.0
    exploration: str = "thompson"
    metrics_port: int = 0  # Prometheus /metrics; 0 = off
    spec_gating: str = "cost"  # "cost": speculate where the measured step cost says it pays; "always"
    engine: EngineConfig = field(default_factory=EngineConfig)


def _env(name: str, default: str) -> str:
    return os.environ.get(f"SPECMESH_{name}", default)


def parse_args(argv: list[str] | None = None) -> VerifierConfig:
    p = argparse.ArgumentParser(prog="specmesh-verifier", description="SpecMesh verifier service (target model).")
    p.add_argument("--address", default=_env("VERIFIER_ADDRESS", "127.0.0.1:50051"), help="host:port to listen on")
    p.add_argument("--model", default=_env("MODEL", "") or None, help="HF model folder or .gguf; default SmolLM2-135M")
    p.add_argument("--device", default=_env("DEVICE", "") or None, help="cpu, cuda, cuda:1 …; default: GPU if present")
    p.add_argument("--dtype", default=_env("DTYPE", "") or None, help="float32, bfloat16, float16")
    p.add_argument("--threads", type=int, default=int(_env("THREADS", "0")), help="torch threads (0 = default)")
    add_linears_flag(p, _env("LINEARS", "packed"))
    p.add_argument("--max-context", type=int, default=int(_env("MAX_CONTEXT", "0")), help="0 = model maximum")
    p.add_argument("--max-running", type=int, default=int(_env("MAX_RUNNING", "32")), help="batch slots")
    p.add_argument("--max-waiting", type=int, default=int(_env("MAX_WAITING", "64")), help="queued requests")
    p.add_argument("--prefill-chunk", type=int, default=int(_env("PREFILL_CHUNK", "512")), help="tokens per prefill")
    p.add_argument(
        "--proposer",
        action="append",
        default=[x for x in _env("PROPOSERS", "").split(",") if x],
        metavar="NAME=ADDRESS",
        help="a proposer service, e.g. ngram=127.0.0.1:50061 or ngram=dns:///ngram:50061 (repeatable); "
        "ADDRESS inprocess:ngram runs the n-gram algorithm inside the verifier",
    )
    p.add_argument(
        "--auto-proposers",
        default=_env("AUTO_PROPOSERS", ""),
        metavar="NAME,NAME",
        help="proposers the router may choose for proposer=auto (default: all configured); others serve only "
        "requests that name them, e.g. a benchmark's oracle",
    )
    p.add_argument(
        "--spec-gating",
        choices=["cost", "always"],
        default=_env("SPEC_GATING", "cost"),
        help="cost: verify trees only where expected goodput beats plain decoding (profiled at start-up); "
        "always: verify every tree",
    )
    p.add_argument(
        "--redis-url",
        default=_env("REDIS_URL", ""),
        help="Redis for the router's statistics, shared by every verifier replica "
        "(e.g. redis://:PASSWORD@redis:6379/0); empty = statistics in this process",
    )
    p.add_argument("--stats-prefix", default=_env("STATS_PREFIX", "specmesh:stats"), help="Redis key prefix")
    p.add_argument(
        "--stats-half-life",
        type=float,
        default=float(_env("STATS_HALF_LIFE_S", "300")),
        help="seconds after which a statistic counts half (the router follows drift)",
    )
    p.add_argument(
        "--exploration",
        choices=["thompson", "ucb", "greedy"],
        default=_env("EXPLORATION", "thompson"),
        help="how the router tries proposers whose statistics are uncertain",
    )
    p.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", "0")), help="Prometheus; 0 = off")
    p.add_argument(
        "--proposer-wait-ms",
        type=float,
        default=float(_env("PROPOSER_WAIT_MS", "5")),
        help="longest wait per step for the requests' trees (a draft model needs about its proposal latency)",
    )
    p.add_argument(
        "--proposer-timeout",
        type=float,
        default=float(_env("PROPOSER_TIMEOUT_S", "2")),
        help="seconds without any answer after which a request drops its proposer (and decodes plainly)",
    )
    p.add_argument("--grace", type=float, default=float(_env("GRACE_S", "30")), help="drain seconds on SIGTERM")
    a = p.parse_args(argv)
    proposers = []
    for item in a.proposer:
        name, sep, addr = item.partition("=")
        if not sep or not name or not addr:
            p.error(f"--proposer expects NAME=ADDRESS, got {item!r}")
        try:
            inprocess_kind(addr)  # an unknown in-process kind is a flag error, not a runtime one
        except ValueError as exc:
            p.error(str(exc))
        proposers.append((name.strip().lower(), addr.strip()))
    return VerifierConfig(
        address=a.address,
        model=a.model,
        device=a.device,
        dtype=a.dtype,
        threads=a.threads,
        packed_linears=a.linears == "packed",
        max_context=a.max_context,
        proposers=tuple(proposers),
        auto_proposers=_auto_proposers(p, a.auto_proposers, [n for n, _ in proposers]),
        grace_s=a.grace,
        redis_url=a.redis_url,
        stats_prefix=a.stats_prefix,
        stats_half_life_s=a.stats_half_life,
        exploration=a.exploration,
        metrics_port=a.metrics_port,
        spec_gating=a.spec_gating,
        engine=EngineConfig(
            max_running=a.max_running,
            max_waiting=a.max_waiting,
            prefill_chunk_tokens=a.prefill_chunk,
            proposer_wait_ms=a.proposer_wait_ms,
            proposer_timeout_s=a.proposer_timeout,
        ),
    )


def _auto_proposers(p: argparse.ArgumentParser, value: str, configured: list[str]) -> tuple[str, ...] | None:
    if not value:
        return None
    names = tuple(x.strip().lower() for x in value.split(",") if x.strip())
    unknown = [n for n in names if n not in configured]
    if unknown:
        p.error(f"--auto-proposers: {', '.join(unknown)} not configured with --proposer")
    return names
