"""``specmesh bench``: argument parsing, the deployment it starts, and the files it writes.

    specmesh bench --limit 2 --max-tokens 64 --concurrency 1,8
    specmesh bench --target 10.0.0.5:50051 --modes plain,ngram,auto --categories code_edit,rag
    specmesh bench --target http://10.0.0.5:8000/v1 --also-grpc 10.0.0.5:50051 --modes plain,ngram
    specmesh bench --modes plain,ngram,head,auto --head DIR   # DIR: `specmesh head train --out DIR`
    specmesh bench --structured json --modes plain,ngram,suffix --limit 5   # every answer a small JSON object
    specmesh bench --mix --modes plain,ngram,suffix,auto --concurrency 1,8 --limit 20 \
        --workload workloads/specbench_dev_measured.jsonl --warmup-workload workloads/specbench_dev_warmup.jsonl

Writes ``records.jsonl`` (one line per request), ``summary.md`` and PNG plots to ``--out``;
exits 1 when any greedy output differs from plain decoding (a losslessness failure).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import grpc

from specmesh.client import Client
from specmesh.params import SamplingParams, StructuredOutput
from specmesh_bench.http_target import HttpTarget, is_http
from specmesh_bench.report import (
    COMPARED,
    gateway_vs_grpc,
    losslessness_failures,
    markdown,
    mode_intervals,
    mode_ratios,
    pipeline_overhead,
    plots,
    primary,
    summarize,
)
from specmesh_bench.runner import (
    ALL_MODES,
    HF_MODES,
    LEARNING_MODES,
    SERVICE_MODES,
    BenchRunner,
    GrpcTarget,
    HfReference,
    RunConfig,
    Target,
    spec_for,
)
from specmesh_bench.structured import KINDS as STRUCTURED_KINDS
from specmesh_bench.structured import structure
from specmesh_bench.verifier_metrics import VerifierMeter
from specmesh_bench.workload import (
    DEFAULT_WORKLOAD,
    BenchPrompt,
    ChatEncoder,
    load_prompts,
    second_turns,
    warmup_conflicts,
)

if TYPE_CHECKING:
    from specmesh.deploy import DeploymentConfig

DEFAULT_MODES = "plain,ngram,ngram-local,suffix,auto,oracle,hf-greedy,hf-pld"
# Proposers the local deployment adds for the benchmark itself; `auto` never picks them.
BENCH_ONLY = ("ngram-local", "oracle")


def _csv(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specmesh bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--target",
        default="",
        help="verifier host:port (gRPC), or the base URL of any OpenAI-compatible server, http[s]://host:port/v1 "
        "(requests through the openai client, prompts as token ids of --model's tokenizer; OPENAI_API_KEY if "
        "set). A SpecMesh gateway serves every mode (each as extra_body spec_decode); another server (vLLM, "
        "SGLang…) only plain (and the local hf-* modes): no extra_body is sent, so it is measured as it is "
        "configured. Default: start a local deployment",
    )
    p.add_argument(
        "--served-model", default=None, help="HTTP target: the model to ask for (default: /v1/models' first)"
    )
    p.add_argument(
        "--also-grpc",
        default="",
        metavar="HOST:PORT",
        help="HTTP target (a SpecMesh gateway): also run every service mode through the gRPC SDK against this "
        "verifier, interleaved with the HTTP runs (same prompts, seeds and waves); summary.md then compares them",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model folder: the prompts' tokenizer (an HTTP target must serve the same model), the local "
        "deployment, the hf-* modes",
    )
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma list of {', '.join(ALL_MODES)}")
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD, help="Spec-Bench-shaped JSONL")
    p.add_argument("--categories", default="", help="comma list; default: every category in the workload")
    p.add_argument("--limit", type=int, default=2, help="prompts (rows) per category")
    p.add_argument(
        "--turns",
        type=int,
        choices=(1, 2),
        default=None,
        help="2 (the default): a multi-turn row (mt_bench) also gives its second turn as a prompt of its own (row "
        "id <id>#2), the chat [turn 1, the model's own greedy answer to turn 1 (generated once through the "
        "deployment before timing, plain decoding, --max-tokens), turn 2], run after every first turn; 1: first "
        "turns only (the default, and the only choice, with --structured)",
    )
    p.add_argument(
        "--structured",
        choices=STRUCTURED_KINDS,
        default=None,
        help="a structured-output workload (specmesh_bench/structured.py), first turns only: json: every prompt asks "
        "for a small JSON object (answer, topic: one of the 8 categories, confidence) and the request carries its "
        "schema (gRPC SamplingParams.structured_output, HTTP response_format); tools: every prompt lists 3 "
        "functions and must call one (gRPC: the function's parameters schema; HTTP: chat completions with tools "
        "and tool_choice). Each output is validated against its schema (schema validity in summary.md, with the "
        "drafted nodes the grammar pruned); the hf-* modes, which decode unconstrained, are left out",
    )
    p.add_argument(
        "--warmup-workload",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSONL of other prompts (e.g. workloads/specbench_dev_warmup.jsonl, measuring "
        "workloads/specbench_dev_measured.jsonl) that warm the caches learning from past outputs: each measured "
        "run (mode, sampling, concurrency) of a mode that learns (suffix, auto) has a cache scope of its own, and "
        "these prompts' first turns go through it first: untimed, not recorded, greedy, --max-tokens, at the "
        "highest --concurrency. Modes that learn nothing (plain, ngram, ngram-local, draft, head, rag, oracle, "
        "hf-*) get no warm-up. Same --categories. Refused if it shares a row id or a prompt text with the measured "
        "prompts",
    )
    p.add_argument(
        "--warmup-limit",
        type=int,
        default=None,
        metavar="N",
        help="warm-up prompts (rows) per category, the first N of each as --limit (default: every row)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1", help="comma list of concurrent streams, e.g. 1,8,32")
    p.add_argument("--mix", action="store_true", help="at concurrency > 1, waves mix all categories")
    p.add_argument(
        "--load",
        choices=("waves", "continuous"),
        default="waves",
        help="at concurrency c > 1: waves of c requests sent together (the slowest sets each wave's time), or "
        "continuous: c streams kept busy over a turn's prompts, a finished stream taking the next at once "
        "(throughput under a sustained load, as a serving benchmark's --max-concurrency)",
    )
    p.add_argument(
        "--tag",
        action="store_true",
        help="tag each request with its category (SpecDecodeParams.workload_tag), as an application tags "
        "its traffic; the router then keeps statistics per category",
    )
    p.add_argument("--sampling", default="greedy", help="comma list of greedy, sampled")
    p.add_argument("--temperature", type=float, default=1.0, help="for sampled runs")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="every request's repetition penalty (vLLM's; an HTTP target gets it as extra_body), the hf-* "
        "modes' generate() too; default: none",
    )
    p.add_argument("--pld-sweep", default="3,5,10", help="prompt_lookup_num_tokens values for hf-pld (best is kept)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the verifier and the hf-* modes")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="local deployment only: shard the verifier's target over N ranks (the verifier starts the N-1 others "
        "itself; gloo on CPUs). The ranks share the cores: each gets max(1, --threads // N) torch threads (the "
        "hf-* modes keep --threads). summary.md and decode_steps.json give each run's decode steps and mean step "
        "time (with N > 1 also the mean all-reduce time per decode step), read from the verifier's /metrics",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="local deployment only: mutual TLS on every hop (a throwaway CA, as `specmesh up --tls`)",
    )
    p.add_argument(
        "--auth",
        action="store_true",
        help="local deployment only: client, admin and proposer-tier tokens (as `specmesh up --auth`)",
    )
    p.add_argument("--corpus", default="", help="RAG corpus for the rag mode (with --target: one it already has)")
    p.add_argument(
        "--rag",
        action="store_true",
        help="local deployment: start a rag proposer too, with a corpus (--corpus, default 'workload') of the "
        "passages of the workload's rag prompts",
    )
    p.add_argument("--draft-model", default="", help="local deployment: start a draft proposer with this HF folder")
    p.add_argument(
        "--draft-arg",
        action="append",
        default=[],
        help="extra flag for the local draft proposer, e.g. --draft-arg=--weights=gguf (repeatable)",
    )
    p.add_argument(
        "--head",
        default="",
        metavar="DIR",
        help="local deployment: start a head proposer with this head folder (`specmesh head train --out`)",
    )
    p.add_argument(
        "--verifier-arg",
        action="append",
        default=[],
        help="extra flag for the local verifier, e.g. --verifier-arg=--spec-gating=always (repeatable)",
    )
    p.add_argument("--out", type=Path, default=None, help="output folder (default bench-results/<time>)")
    p.add_argument("--corrupt", default="", help=argparse.SUPPRESS)  # self-test: flip a token of this mode
    a = p.parse_args(argv)
    unknown = [m for m in _csv(a.modes) if m not in ALL_MODES]
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(ALL_MODES)})")
    if "plain" not in _csv(a.modes):
        p.error("--modes must include plain: every speed-up and losslessness check is against it")
    if "head" in _csv(a.modes) and not (a.head or a.target):
        p.error("--modes head: give --head DIR, the head folder the local deployment serves (`specmesh head train`)")
    bad = [s for s in _csv(a.sampling) if s not in ("greedy", "sampled")]
    if bad:
        p.error(f"--sampling: unknown {', '.join(bad)}")
    if a.also_grpc and not is_http(a.target):
        p.error("--also-grpc compares an HTTP --target (http[s]://…/v1) with gRPC; give one")
    if a.served_model and not is_http(a.target):
        p.error("--served-model is for an HTTP --target")
    if a.warmup_limit is not None and a.warmup_workload is None:
        p.error("--warmup-limit needs --warmup-workload")
    if a.warmup_limit is not None and a.warmup_limit < 1:
        p.error("--warmup-limit must be at least 1")
    if a.tensor_parallel_size < 1:
        p.error("--tensor-parallel-size must be at least 1")
    if a.tensor_parallel_size > 1 and a.target:
        p.error("--tensor-parallel-size configures the local deployment's verifier; a --target brings its own")
    if a.structured and a.turns == 2:
        p.error("--structured runs first turns only (--turns 1)")
    a.turns = a.turns or (1 if a.structured else 2)
    return a


def check_http_target(target: HttpTarget, modes: list[str], also_grpc: str) -> str | None:
    """Why this run cannot go to ``target``, or None. Another server than SpecMesh takes no
    per-request speculation: of the service modes only plain, with no extra body.

    >>> check_http_target(HttpTarget(None, "m", "vllm"), ["plain", "hf-greedy"], "")
    >>> check_http_target(HttpTarget(None, "m", "vllm"), ["plain", "ngram"], "")[:50]
    'modes ngram need a SpecMesh server; m at this URL '
    """
    if target.specmesh:
        return None
    owner = f"owned_by {target.owned_by!r}" if target.owned_by else "no owned_by"
    bad = [m for m in modes if m in SERVICE_MODES and m != "plain"]
    if bad:
        return (
            f"modes {', '.join(bad)} need a SpecMesh server; {target.model} at this URL is {owner}, which only "
            "serves plain (measured as that server is configured): use --modes plain, with hf-greedy, hf-pld "
            "if wanted (they run here)"
        )
    if also_grpc:
        return f"--also-grpc compares a SpecMesh gateway with its verifier; {target.model} here is {owner}"
    return None


def git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.processor())
    return f"{name} ({os.cpu_count()} cores)"


def _available(client: Client, modes: list[str], prompt: BenchPrompt, corpus: str) -> list[str]:
    """Service modes this verifier serves (a 2-token probe each, which also warms it up, and compiles
    a structured prompt's grammar before any request is timed)."""
    task = prompt.structured
    grammar = StructuredOutput(json_schema=task.schema) if task is not None else None
    probe = SamplingParams(temperature=0.0, max_tokens=2, structured_output=grammar)
    ok = []
    for m in modes:
        if m not in SERVICE_MODES:
            ok.append(m)
            continue
        spec = spec_for(m, corpus)
        try:
            client.complete(list(prompt.token_ids), probe, spec, timeout=120)
            ok.append(m)
        except grpc.RpcError as exc:
            print(f"bench: mode {m} unavailable here ({exc.code().name}: {exc.details()}); skipped", file=sys.stderr)
    return ok


def _available_http(target: HttpTarget, modes: list[str], prompt: BenchPrompt, corpus: str) -> list[str]:
    """``_available`` through an HTTP target."""
    import openai

    ok = []
    for m in modes:
        try:
            if m in SERVICE_MODES:
                target.request(prompt, m, SamplingParams(temperature=0.0, max_tokens=2), corpus)
            ok.append(m)
        except openai.APIError as exc:
            print(f"bench: mode {m} unavailable at {target.model} over HTTP ({exc}); skipped", file=sys.stderr)
    return ok


def _fail(message: str) -> NoReturn:
    print(f"specmesh bench: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    modes = _csv(a.modes)
    out_dir = a.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from proposer_svc.oracle import OracleServer
    from specmesh_server.model_loading import resolve_model_path

    model_path = resolve_model_path(a.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    encoder = ChatEncoder(tokenizer)
    encode, encode_chat = encoder.user, encoder.chat

    categories = _csv(a.categories) or None
    try:
        prompts = load_prompts(a.workload, categories, a.limit, encode)
        warmup = load_prompts(a.warmup_workload, categories, a.warmup_limit, encode) if a.warmup_workload else []
    except ValueError as exc:
        _fail(str(exc))
    if a.structured:
        prompts, warmup = structure(prompts, a.structured, encode), structure(warmup, a.structured, encode)
        if dropped := [m for m in modes if m in HF_MODES]:
            print(f"bench: --structured leaves out {', '.join(dropped)} (unconstrained decoding)", file=sys.stderr)
            modes = [m for m in modes if m not in HF_MODES]
    if warmup and (why := warmup_conflicts(warmup, prompts)):
        _fail(f"--warmup-workload {a.warmup_workload}: {why}; warm up on other prompts (workloads/README.md)")
    if a.warmup_workload and not any(m in LEARNING_MODES for m in modes):
        print(f"bench: no mode of {a.modes} learns from outputs; the warm-up is not sent", file=sys.stderr)
    config = RunConfig(
        modes=tuple(modes),
        concurrency=tuple(int(c) for c in _csv(a.concurrency)),
        samplings=tuple(_csv(a.sampling)),
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        repetition_penalty=a.repetition_penalty,
        pld_sweep=tuple(int(k) for k in _csv(a.pld_sweep)),
        corpus=a.corpus,
        mix=a.mix,
        tag=a.tag,
        load=a.load,
    )
    http = is_http(a.target)
    if (a.tls or a.auth) and (a.target or http):
        _fail("--tls and --auth configure the local deployment; a --target brings its own")
    with ExitStack() as stack:
        oracle = dep = None
        if http:
            address = a.also_grpc
        elif a.target:
            address = a.target
        else:
            from specmesh.deploy import LocalDeployment

            oracle = stack.enter_context(OracleServer())
            run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specmesh-bench-")))
            dep = LocalDeployment(local_deployment(a, modes, str(model_path), oracle.address, run_dir))
            print("bench: starting the local deployment …", file=sys.stderr)
            stack.enter_context(dep)
            address = dep.verifier_address
            if a.rag:
                a.corpus = a.corpus or "workload"
                ingest_workload_passages(a.workload, dep.services_by_name["rag"].address, a.corpus, run_dir)
        targets: list[Target] = []
        http_target = _http_target(a, modes, prompts) if http else None
        if http_target is not None:
            modes = _available_http(http_target, modes, prompts[0], a.corpus)
            targets.append(http_target)
        client = server = None
        if address:
            credentials = {"tls": dep.client_tls, "token": dep.token()} if dep is not None else {}
            client = stack.enter_context(Client(address, **credentials))
            modes = _available(client, modes, prompts[0], a.corpus)
            targets.append(GrpcTarget(client, spread=http))  # with HTTP: ITL estimated alike, for the comparison
            server = client.stats().server
        config = RunConfig(**{**asdict(config), "modes": tuple(modes), "corpus": a.corpus})
        from tqdm import tqdm  # with transformers ([serve]) and openai ([bench]); on stderr

        set_oracle = oracle.servicer.set_continuation if oracle else None
        metrics_url = verifier_metrics_url(dep.config) if dep is not None else ""
        meter = VerifierMeter(metrics_url) if metrics_url else None  # decode steps, their time, all-reduces
        router_stats: list[str] = []  # the router's statistics as each block left them
        runner = BenchRunner(
            config,
            targets,
            None,
            set_oracle,
            a.corrupt or None,
            warmup=warmup if any(m in LEARNING_MODES for m in modes) else (),
            log=lambda line: tqdm.write(line, file=sys.stderr),
            block_done=lambda sampling, c: router_stats.append(_router_stats(client, f"after {sampling} c={c}")),
            meter=meter.wave if meter is not None else None,
        )
        if a.turns > 1:  # before the hf-* model loads: the answers come from the deployment
            prompts += second_turns(prompts, runner.first_answers(prompts), encode_chat)
            if http_target is not None:
                _check_length(http_target, prompts, a.max_tokens)
        runner.hf = HfReference(str(model_path), a.threads) if any(m in HF_MODES for m in modes) else None
        meta = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "model": http_target.model if http_target else server.model,
            "device": server.device if server else "",
            "dtype": server.dtype if server else "",
            "cpu": cpu_name(),
            "gpu": _gpu_name(),
            "threads": a.threads,
            "tensor_parallel_size": dep.config.tensor_parallel_size if dep is not None else None,
            "verifier_threads": dep.config.verifier_threads if dep is not None else None,
            "git_commit": git_commit(),
            "max_tokens": a.max_tokens,
            "limit": a.limit,
            "workload": str(a.workload),
            "turns": a.turns,
            "structured": a.structured or "",
            "load": a.load,
            "cache_scope_token": runner.run_token,
            "warmup_workload": str(a.warmup_workload) if runner.warmup else "",
            "warmup_limit": a.warmup_limit,
            "warmup_prompts": len(runner.warmup),
            "warmup_scopes": runner.scopes() if runner.warmup else [],
        }
        if http_target is not None:
            meta.update(target=a.target, http_server=http_target.owned_by, also_grpc=a.also_grpc)
        records = []
        with (
            (out_dir / "records.jsonl").open("w") as f,
            tqdm(total=runner.planned_requests(prompts), desc="bench", unit="req") as progress,
        ):
            for rec in runner.run(prompts):
                rec.update(meta)
                f.write(json.dumps(rec) + "\n")
                records.append(rec)
                via = f" {rec['transport']}" if len(targets) > 1 and "transport" in rec else ""
                progress.set_postfix_str(f"{rec['category']} {rec['mode']}{via} c={rec['concurrency']}", refresh=False)
                progress.update()

    main_records = primary(records)  # with --also-grpc, the gRPC side only feeds the comparison
    rows = summarize(main_records)
    failures = losslessness_failures(records)
    transports = gateway_vs_grpc(records)
    ratios = {(x, y): mode_ratios(main_records, x, y) for x, y in COMPARED}
    intervals = {(x, y): mode_intervals(main_records, x, y) for x, y in COMPARED}
    decode = meter.rows() if meter is not None else []
    text = markdown(rows, meta, pipeline_overhead(main_records), failures, transports, ratios, intervals, decode)
    (out_dir / "summary.md").write_text(text)
    (out_dir / "summary.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    written = ["records.jsonl", "summary.md", "summary.json"]
    if any(router_stats):
        (out_dir / "router_stats.txt").write_text("".join(router_stats))
        written.append("router_stats.txt")
    if decode:
        (out_dir / "decode_steps.json").write_text(json.dumps([asdict(r) for r in decode], indent=1))
        written.append("decode_steps.json")
    if transports:
        (out_dir / "gateway_vs_grpc.json").write_text(json.dumps([asdict(r) for r in transports], indent=1))
        written.append("gateway_vs_grpc.json")
    images = plots(rows, main_records, out_dir)
    print(text)
    print(f"bench: wrote {out_dir}/" + ", ".join([*written, *(p.name for p in images)]))
    if failures:
        print(f"bench: LOSSLESSNESS FAILURE in {len(failures)} request(s); see summary.md", file=sys.stderr)
        sys.exit(1)


def _router_stats(client: Client | None, label: str) -> str:
    """The router's statistics (as ``specmesh admin router-stats`` prints them) under a ``label``
    line; "" without a gRPC client, a line saying why where the server refuses."""
    if client is None:
        return ""
    try:
        reply = client.router_stats()
    except grpc.RpcError as exc:
        return f"# {label}: no router statistics ({exc.code().name}: {exc.details()})\n"
    from google.protobuf import text_format

    return f"# {label}\n{text_format.MessageToString(reply)}\n"


def local_deployment(
    a: argparse.Namespace, modes: list[str], model: str, oracle: str, run_dir: Path
) -> DeploymentConfig:
    """The ``DeploymentConfig`` of the local deployment a run without ``--target`` starts: n-gram, the
    tiers its modes and flags ask for (suffix for suffix/auto, ``--rag``, ``--draft-model``, ``--head``),
    and the bench-only proposers (``ngram-local``, the ``oracle`` at ``oracle``), which ``auto`` never picks.

    >>> a = parse_args(["--modes", "plain,ngram,head,auto", "--head", "heads/h"])
    >>> cfg = local_deployment(a, _csv(a.modes), "m", "127.0.0.1:1", Path("/tmp/run"))
    >>> cfg.head_dir, bool(cfg.head_address), bool(cfg.suffix_address), bool(cfg.draft_address)
    ('heads/h', True, True, False)
    >>> cfg.extra_verifier_args[cfg.extra_verifier_args.index("--auto-proposers") + 1]
    'ngram,suffix,head'
    >>> a = parse_args(["--modes", "plain,draft", "--draft-model", "m", "--draft-arg=--weights=gguf"])
    >>> local_deployment(a, _csv(a.modes), "m", "127.0.0.1:1", Path("/tmp/run")).draft_args
    ('--weights=gguf',)

    ``--tensor-parallel-size N`` > 1: N ranks sharing ``--threads`` (``verifier_threads``), and a
    /metrics port for the bench to read (unless a ``--verifier-arg`` gives one).
    """
    from specmesh.deploy import DeploymentConfig, free_port

    ngram = f"127.0.0.1:{free_port()}"
    suffix = f"127.0.0.1:{free_port()}" if any(m in ("suffix", "auto") for m in modes) else ""
    extra = ["--proposer", "ngram-local=inprocess:ngram", "--proposer", f"oracle={oracle}"]
    tiers = {"suffix": suffix, "rag": a.rag, "draft": a.draft_model, "head": a.head}  # `auto` may pick, besides ngram
    auto = ",".join(["ngram", *(name for name, started in tiers.items() if started)])
    extra += ["--auto-proposers", auto, *a.verifier_arg]
    tp = a.tensor_parallel_size
    if not int(_flag_value(a.verifier_arg, "--metrics-port") or 0):  # decode steps per run (``VerifierMeter``)
        extra += ["--metrics-port", str(free_port())]
    return DeploymentConfig(
        model=model,
        verifier_address=f"127.0.0.1:{free_port()}",
        verifier_threads=max(1, a.threads // tp) if a.threads > 0 else 0,  # the ranks share the cores
        tensor_parallel_size=tp,
        ngram_address=ngram,
        suffix_address=suffix,
        rag_address=f"127.0.0.1:{free_port()}" if a.rag else "",
        rag_data_dir=run_dir / "rag" if a.rag else None,
        draft_address=f"127.0.0.1:{free_port()}" if a.draft_model else "",
        draft_model=a.draft_model or None,
        draft_args=tuple(a.draft_arg),
        head_address=f"127.0.0.1:{free_port()}" if a.head else "",
        head_dir=a.head,
        extra_verifier_args=tuple(extra),
        run_dir=run_dir,
        tls=a.tls,
        auth=a.auth,
    )


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value given to ``flag`` among command-line ``args`` (``--flag V`` or ``--flag=V``).

    >>> _flag_value(["--metrics-port", "9", "--x", "--metrics-port=10"], "--metrics-port")
    '10'
    """
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def verifier_metrics_url(config: DeploymentConfig) -> str:
    """The local verifier's /metrics URL, "" where it serves none (no ``--metrics-port``).

    >>> from specmesh.deploy import DeploymentConfig
    >>> verifier_metrics_url(DeploymentConfig(extra_verifier_args=("--metrics-port", "7")))
    'http://127.0.0.1:7/metrics'
    """
    port = int(_flag_value(config.extra_verifier_args, "--metrics-port") or 0)
    if not port:
        return ""
    host = _flag_value(config.extra_verifier_args, "--metrics-address") or config.verifier_address.rsplit(":", 1)[0]
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
    return f"http://{host}:{port}/metrics"


def _http_target(a: argparse.Namespace, modes: list[str], prompts: list[BenchPrompt]) -> HttpTarget:
    """The OpenAI-compatible server at ``--target``, checked against the run (exits 2 if it cannot serve it)."""
    import openai

    try:
        target = HttpTarget.connect(a.target, a.served_model)
    except (openai.APIError, ValueError) as exc:
        _fail(f"cannot list the models of {a.target}: {exc}")
    if why := check_http_target(target, modes, a.also_grpc):
        _fail(why)
    _check_length(target, prompts, a.max_tokens)
    print(f"bench: {a.target} serves {target.model} (owned_by {target.owned_by or '?'})", file=sys.stderr)
    return target


def _check_length(target: HttpTarget, prompts: list[BenchPrompt], max_tokens: int) -> None:
    longest = max(len(p.token_ids) for p in prompts)
    if target.max_model_len and longest + max_tokens > target.max_model_len:
        _fail(f"a prompt of {longest} tokens + --max-tokens {max_tokens} exceeds {target.model}'s max_model_len")


def ingest_workload_passages(workload: Path, rag_address: str, corpus: str, tmp: Path) -> None:
    """The passages quoted by the workload's rag prompts → one corpus of the rag proposer."""
    from proposer_svc.rag.cli import main as rag_cli
    from specmesh_bench.workload import rag_passages, read_rows

    folder = tmp / "passages"
    folder.mkdir(exist_ok=True)
    texts: dict[str, Path] = {}  # a passage quoted by several prompts is one document
    for row in read_rows(workload):
        if row["category"] == "rag":
            for source, text in rag_passages(row["turns"][0]):
                texts.setdefault(text, folder / f"{len(texts):04d}-{source.replace('/', '_')[:80]}.txt")
    for text, path in texts.items():
        path.write_text(text)
    files = list(texts.values())
    rag_cli(["ingest", *map(str, files), "--corpus", corpus, "--target", rag_address])


def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    except ImportError:
        return ""
