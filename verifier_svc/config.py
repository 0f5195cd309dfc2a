"""Verifier configuration: flags (each defaulting to the ``SPECMESH_*`` variable named after it) → one frozen config."""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh_server.auth import token_file
from specmesh_server.flags import ServiceFlags, boolean, byte_size
from specmesh_server.gguf_weights import add_weights_flag
from specmesh_server.packed_linear import add_linears_flag
from specmesh_server.security import ServerSecurity, add_security_flags, security_config
from verifier_svc.batch_accept import KERNEL_MAX_NODES
from verifier_svc.engine import EngineConfig
from verifier_svc.kernel_paths import ATTENTION, CUDA_GRAPHS, DEVICE_ACCEPT
from verifier_svc.local_proposer import inprocess_kind
from verifier_svc.speculation import SpeculationConfig


@dataclass(frozen=True)
class VerifierConfig:
    address: str = "127.0.0.1:50051"
    model: str | None = None  # None = the default model
    device: str | None = None
    dtype: str | None = None
    threads: int = 0  # torch intra-op threads; 0 = torch's default (under tensor parallelism: the cores / ranks)
    adaptive_threads: bool = True  # CPU, one rank: the threads follow the cores others leave free (thread_budget)
    tensor_parallel_size: int = 1  # ranks the target is sharded over (``tensor_parallel``)
    tensor_parallel_timeout_s: float = 60.0  # bound on every collective wait; past it a rank counts as failed
    weights: str = "fp32"  # fp32, or gguf: the GGUF's own Q4_1 / Q8_0 blocks on the CPU kernel (``gguf_weights``)
    linears: str = "gemv"  # CPU float32: gemv (oneDNN packed + the small-step kernel), packed, stock
    attention: str = "auto"  # tree verification's attention: auto (the Triton kernel on CUDA), triton, sdpa
    cuda_graphs: str = "auto"  # decode/verify steps as static steps: auto (CUDA graphs on CUDA), on, off
    grammar_threads: int = 8  # structured outputs compiled at once (distinct schemas do not wait in line)
    grammar_compile_timeout_s: float = 10.0  # a schema compiling longer is refused (INVALID_ARGUMENT)
    max_context: int = 0  # 0 = the model's max_position_embeddings
    kv_cache_bytes: int | None = None  # KV cache budget; None = kv_cache.default_budget_bytes
    block_size: int = 16  # KV positions per block of the paged cache
    prefix_caching: bool = True  # reuse the KV of prompt prefixes seen before (kv_blocks)
    proposers: tuple[tuple[str, str], ...] = ()  # (name, address)
    auto_proposers: tuple[str, ...] | None = None  # what `auto` may pick; None = every configured one
    grace_s: float = 30.0
    redis_url: str = ""  # shared router statistics; "" = in this process only
    stats_prefix: str = "specmesh:stats"
    stats_half_life_s: float = 300.0
    metrics_port: int = 0  # Prometheus /metrics; 0 = off
    metrics_address: str = ""  # /metrics host; "" = the host of `address`
    metrics_tags: tuple[str, ...] = ()  # workload tags exported as labels; the rest are "other"
    spec_gating: str = "cost"  # "cost": speculate where the measured step cost says it pays; "always"
    engine: EngineConfig = field(default_factory=EngineConfig)
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, client tokens, reflection
    admin_tokens: tuple[str, ...] = field(default=(), repr=False)  # AdminService's; () = client tokens suffice
    admin_address: str = ""  # AdminService on its own port; "" = on `address`
    proposer_tls_ca: str = ""  # CA of the proposers' certificates: TLS to them; "" = plaintext
    proposer_token: str = field(default="", repr=False)  # tier token sent to the proposers
    learn_outputs: bool = True  # every finished output to the tiers that did not follow it (Learn)


def build_flags() -> ServiceFlags:
    """The verifier's flags (``specmesh serve verifier --help``)."""
    f = ServiceFlags("specmesh serve verifier", "SpecMesh verifier service (target model).")
    f.add_address("--address", "127.0.0.1:50051", "host:port to listen on")
    f.add("--model", None, str, "HF model folder or .gguf; default SmolLM2-135M-Instruct")
    f.add("--device", None, str, "cpu, cuda, cuda:1 …; default: the GPU if present")
    f.add("--dtype", None, str, "float32, bfloat16, float16; default: float32 on CPU, bfloat16 on GPU")
    f.add("--threads", 0, int, "torch threads (0 = torch's default)", minimum=0)
    f.add(
        "--adaptive-threads",
        True,
        boolean,
        "on a CPU (one rank): before each step, fewer torch threads while other processes keep cores busy "
        "(a busy neighbour then costs its share of the cores, not every step's barrier); at most --threads",
    )
    f.add(
        "--tensor-parallel-size",
        1,
        int,
        "shard the target over this many ranks (processes this verifier starts, or torchrun's: RANK, "
        "WORLD_SIZE); one device each (cuda:RANK on a GPU host, a share of the cores on a CPU); "
        "gloo on CPUs, NCCL on GPUs",
        minimum=1,
    )
    f.add(
        "--tensor-parallel-timeout",
        60.0,
        float,
        "seconds any collective may wait; a rank that dies or hangs past it fails the in-flight requests "
        "(UNAVAILABLE) and exits the verifier non-zero for its supervisor to restart",
        minimum=1.0,
    )
    f.add(
        "--grammar-threads",
        8,
        int,
        "structured outputs (JSON schemas, regexes, grammars) compiled at once: a cheap schema does not wait "
        "behind expensive ones; the same schema sent twice compiles once",
        minimum=1,
    )
    f.add(
        "--grammar-compile-timeout",
        10.0,
        float,
        "seconds a request waits for its structured output to compile; past it the request is refused "
        "(INVALID_ARGUMENT naming the field) while the compile finishes into the cache",
        minimum=0.01,
    )
    add_linears_flag(f)
    add_weights_flag(f, "CPU, float32, one rank; greedy speculation equals plain decoding over the same blocks")
    f.add(
        "--attention",
        "auto",
        str,
        "attention of tree-verification forwards: triton = the Triton tree-attention kernel, sdpa = SDPA under "
        "the tree mask, auto = triton on CUDA and sdpa elsewhere; a forced kernel that cannot run here (CPU "
        "tensors without Triton's interpreter, a model it does not serve) is refused at start-up",
        choices=list(ATTENTION),
    )
    f.add(
        "--cuda-graphs",
        "auto",
        str,
        "decode and verification steps as static steps (inputs in preallocated buffers, one host-to-device copy), "
        "replayed as CUDA graphs captured at start-up per batch × tokens-per-row bucket: on, off, auto = on where "
        "the tree-attention kernel runs on CUDA at --tensor-parallel-size 1; on with CPU tensors runs the same "
        "static step eagerly (Triton's interpreter); needs --attention triton (auto on CUDA)",
        choices=list(CUDA_GRAPHS),
    )
    f.add(
        "--device-accept",
        "auto",
        str,
        "token-tree acceptance: on = the whole batch walked by the Triton kernel (one device-to-host copy per "
        "step; CPU tensors in Triton's interpreter), off = the host walk, auto = on for CUDA logits; trees over "
        f"{KERNEL_MAX_NODES} nodes always take the host walk",
        choices=list(DEVICE_ACCEPT),
    )
    f.add("--max-context", 0, int, "context tokens per request (0 = the model's maximum)", minimum=0)
    f.add("--max-running", 32, int, "batch slots: requests decoded together", minimum=1)
    f.add(
        "--max-waiting", 64, int, "admitted requests that wait for a slot; beyond them: RESOURCE_EXHAUSTED", minimum=0
    )
    f.add(
        "--prefill-chunk",
        512,
        int,
        "a prefill forward's work in prompt tokens (fewer tokens deeper into a long prompt); bounds the gap a "
        "prefill puts between the running requests' tokens",
        minimum=1,
    )
    f.add(
        "--kv-cache-memory",
        "auto",
        byte_size,
        "KV cache memory budget, e.g. 4GiB: requests wait (or are refused if they can never fit) rather than "
        "exceed it; auto = 30%% of the memory free after the model loads (the GPU's on a GPU)",
    )
    f.add(
        "--block-size",
        16,
        int,
        "KV cache positions per block: memory is held and shared in blocks (docs/ARCHITECTURE.md, KV cache)",
        minimum=1,
    )
    f.add(
        "--enable-prefix-caching",
        True,
        boolean,
        "reuse the KV of prompt prefixes seen before, within one cache_scope (the gateway: one API key)",
    )
    f.add(
        "--proposer",
        [],
        str,
        "a proposer service, e.g. ngram=127.0.0.1:50061 or ngram=dns:///ngram:50061 (repeatable); "
        "ADDRESS inprocess:ngram runs the n-gram algorithm inside the verifier",
        repeat=True,
        metavar="NAME=ADDRESS",
    )
    f.add(
        "--auto-proposers",
        "",
        str,
        "proposers the router may choose for proposer=auto (empty: every configured one); others serve only "
        "requests that name them, e.g. a benchmark's oracle",
        metavar="NAME,NAME",
    )
    f.add(
        "--spec-gating",
        "cost",
        str,
        "cost: verify trees only where expected goodput beats plain decoding (profiled at start-up); "
        "always: verify every tree",
        choices=["cost", "always"],
    )
    f.add(
        "--redis-url",
        "",
        str,
        "Redis for the router's statistics, shared by every verifier replica "
        "(e.g. redis://:PASSWORD@redis:6379/0); empty = statistics in this process",
    )
    f.add("--stats-prefix", "specmesh:stats", str, "Redis key prefix")
    f.add(
        "--stats-half-life",
        300.0,
        float,
        "seconds after which a statistic counts half (the router follows drift)",
        minimum=1e-3,
    )
    f.add("--metrics-port", 0, int, "Prometheus /metrics port; 0 = off", minimum=0)
    f.add("--metrics-address", "", str, "host /metrics listens on (empty: the host of --address)", metavar="HOST")
    f.add(
        "--metrics-tags",
        "",
        str,
        "workload tags exported as Prometheus label values; any other client tag is reported as 'other' "
        "(bounded series, no tenant names on /metrics)",
        metavar="TAG,TAG",
    )
    f.add(
        "--learn-outputs",
        True,
        boolean,
        "send every finished request's output to the proposer tiers that did not serve it (ProposerService.Learn), "
        "so proposers that learn from past outputs (suffix) see all traffic; tiers that learn nothing are asked once",
    )
    f.add(
        "--proposer-wait-ms",
        5.0,
        float,
        "longest wait per step for the requests' trees (a draft model needs about its proposal latency)",
        minimum=0,
    )
    f.add(
        "--step-layout",
        "packed",
        str,
        "decode steps with trees: packed = only the batch's real tokens, each row paying for its own tree (rows "
        "sized apart); padded = every row padded to the widest tree (one width for the batch)",
        choices=["packed", "padded"],
    )
    f.add(
        "--proposer-timeout",
        2.0,
        float,
        "seconds without any answer after which a request drops its proposer (and decodes plainly)",
        minimum=1e-3,
    )
    f.add("--grace", 30.0, float, "seconds running requests get to finish on SIGTERM", minimum=0)
    add_security_flags(f, "clients (SDK, CLI, gateway)")
    f.add(
        "--admin-token-file",
        "",
        str,
        "file of the token(s) AdminService needs (SetPolicy, GetPolicy, GetRouterStats; GetStats takes a client "
        "token too): a client token there is PERMISSION_DENIED; empty = whoever may generate may administer",
        metavar="FILE",
    )
    f.add(
        "--admin-address",
        "",
        str,
        "serve AdminService on this host:port only (e.g. 127.0.0.1:50052, loopback), not on --address; "
        "empty = on --address",
        metavar="HOST:PORT",
    )
    f.add(
        "--proposer-tls-ca",
        "",
        str,
        "CA (PEM) that signed the proposers' certificates: their channels use TLS, and with --tls-cert/--tls-key "
        "this verifier presents its certificate (mutual TLS); a proposer without such a certificate gets no "
        "request (it decodes plainly, fallback_reason says why); empty = plaintext",
        metavar="FILE",
    )
    f.add(
        "--proposer-token-file",
        "",
        str,
        "file of the token sent to the proposers (their --auth-token-file); empty = none",
        metavar="FILE",
    )
    return f


def parse_args(argv: list[str] | None = None) -> VerifierConfig:
    p = build_flags()
    a = p.parse(argv)
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
    if a.admin_address:
        host, sep, port = a.admin_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            p.error(f"--admin-address expects HOST:PORT, got {a.admin_address!r}")
        if a.admin_address == a.address:
            p.error("--admin-address must differ from --address")
    if a.weights == "gguf" and (a.tensor_parallel_size > 1 or a.dtype not in (None, "float32")):
        p.error("--weights gguf runs on one rank in float32 (the CPU kernel): no --tensor-parallel-size or --dtype")
    proposer_token = token_file(p, a, "proposer_token_file")
    return VerifierConfig(
        address=a.address,
        model=a.model,
        device=a.device,
        dtype=a.dtype,
        threads=a.threads,
        adaptive_threads=a.adaptive_threads,
        tensor_parallel_size=a.tensor_parallel_size,
        tensor_parallel_timeout_s=a.tensor_parallel_timeout,
        weights=a.weights,
        linears=a.linears,
        attention=a.attention,
        cuda_graphs=a.cuda_graphs,
        grammar_threads=a.grammar_threads,
        grammar_compile_timeout_s=a.grammar_compile_timeout,
        max_context=a.max_context,
        kv_cache_bytes=a.kv_cache_memory,
        block_size=a.block_size,
        prefix_caching=a.enable_prefix_caching,
        proposers=tuple(proposers),
        auto_proposers=_auto_proposers(p, a.auto_proposers, [n for n, _ in proposers]),
        grace_s=a.grace,
        redis_url=a.redis_url,
        stats_prefix=a.stats_prefix,
        stats_half_life_s=a.stats_half_life,
        metrics_port=a.metrics_port,
        metrics_address=a.metrics_address,
        metrics_tags=tuple(dict.fromkeys(t.strip() for t in a.metrics_tags.split(",") if t.strip())),
        spec_gating=a.spec_gating,
        engine=EngineConfig(
            max_running=a.max_running,
            max_waiting=a.max_waiting,
            prefill_chunk_tokens=a.prefill_chunk,
            device_accept=DEVICE_ACCEPT[a.device_accept],
            speculation=SpeculationConfig(
                proposer_wait_ms=a.proposer_wait_ms,
                proposer_timeout_s=a.proposer_timeout,
                packed_steps=a.step_layout == "packed",
            ),
        ),
        security=security_config(p, a, "proposer_tls_ca"),
        admin_tokens=token_file(p, a, "admin_token_file"),
        admin_address=a.admin_address,
        proposer_tls_ca=a.proposer_tls_ca,
        proposer_token=proposer_token[0] if proposer_token else "",
        learn_outputs=a.learn_outputs,
    )


def _auto_proposers(p: ServiceFlags, value: str, configured: list[str]) -> tuple[str, ...] | None:
    if not value:
        return None
    names = tuple(x.strip().lower() for x in value.split(",") if x.strip())
    unknown = [n for n in names if n not in configured]
    if unknown:
        p.error(f"--auto-proposers: {', '.join(unknown)} not configured with --proposer")
    return names
