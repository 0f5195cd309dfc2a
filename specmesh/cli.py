"""The ``specmesh`` command line: serve, up, generate, status, admin, demo.

Client commands (generate, status, admin, --help) need only the SDK's grpcio + protobuf; the
others need ``specmesh[serve]`` and say so in one line when it is missing (``specmesh.extras``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

import grpc

from specmesh import extras
from specmesh.client import DEFAULT_ADDRESS, Client
from specmesh.credentials import TlsOptions, add_client_flags, client_tls, client_token, read_token
from specmesh.params import SamplingParams, SpecDecodeParams

# An edit task: the answer copies most of the input, where prompt lookup shines.
DEMO_PROMPT = """Rename the variable `total` to `running_sum` in this function and output the whole function.

```python
def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages
```"""
DEMO_CONCURRENT_PROMPTS = [
    "What is the capital of France?",
    "Give three tips for writing clean code.",
    "Explain what a hash table is.",
    "Translate 'good morning' into German and Spanish.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Write a haiku about the sea.",
    "What is 17 times 23? Show your steps.",
]


# `specmesh serve NAME …` → the service module's own main(argv); each service parses its own flags.
SERVICES = {
    "verifier": "verifier_svc.server",
    "ngram": "proposer_svc.ngram.server",
    "suffix": "proposer_svc.suffix.server",
    "draft": "proposer_svc.draft.server",
    "head": "proposer_svc.head.server",
    "rag": "proposer_svc.rag.server",
    "gateway": "gateway_svc.server",
}
# Commands that own their whole argument list (`specmesh NAME …` → module.main(argv)).
TOOLS: dict[str, str] = {
    "bench": "specmesh_bench.cli",
    "draft": "proposer_svc.draft.distill",
    "head": "proposer_svc.head.train",
    "rag": "proposer_svc.rag.cli",
}
TOOL_EXTRAS = {"bench": "serve,bench"}  # the pip extra each tool needs; default "serve"


def _serve(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        names = ",".join(SERVICES)
        print(f"usage: specmesh serve {{{names}}} [service flags]  (e.g. specmesh serve verifier --help)")
        return
    service, rest = argv[0], argv[1:]
    if service not in SERVICES:
        sys.exit(f"specmesh serve: unknown service {service!r} (known: {', '.join(SERVICES)})")
    # OpenMP's wait policy stays the default (spin briefly, then sleep): with the model loaded and
    # stepped on one thread (``TorchThread``) a forced PASSIVE made each 2-core decode step 25% slower.
    extras.run_main(f"serve {service}", SERVICES[service], rest)


def _deployment(args: argparse.Namespace):
    extras.require(args.cmd)  # before any process starts: each would fail alone, in its log
    from specmesh.deploy import DeploymentConfig, LocalDeployment

    cfg = DeploymentConfig(
        model=args.model,
        verifier_address=args.verifier_address,
        verifier_threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        redis_url=args.redis_url,
        rag_address=args.rag,
        suffix_address=args.suffix,
        draft_address=args.draft,
        draft_model=args.draft_model,
        head_address=args.head,
        head_dir=args.head_dir,
        gateway_address=args.gateway,
        run_dir=Path(args.run_dir) if args.run_dir else DeploymentConfig().run_dir,
        tls=args.tls,
        auth=args.auth,
    )
    return LocalDeployment(cfg)


def _up(args: argparse.Namespace) -> None:
    dep = _deployment(args)
    print("specmesh: starting services (the first start converts the default model, ~1 min)…", flush=True)
    if args.head and not args.head_dir:
        print("specmesh: the head proposer trains the target's cached head once on first use (~10 min)", flush=True)
    dep.start()
    for svc in dep.services:
        print(f"  {svc.name:<10} {svc.address:<22} pid {svc.proc.pid}  log {svc.log_path}", flush=True)
    if dep.gateway_url:
        print(f"specmesh: OpenAI-compatible API at {dep.gateway_url} (e.g. OpenAI(base_url=...))", flush=True)
    if tls := dep.tls_files:
        print(f"specmesh: mutual TLS on every hop; CA {tls['ca']}, certificate {tls['cert']}, key {tls['key']}")
    if tokens := dep.token_files:
        listed = ", ".join(f"{k} {v}" for k, v in tokens.items())
        print(f"specmesh: tokens required: {listed}")
    if tls or tokens:
        print("specmesh: generate/admin/status use these for this deployment; other clients pass them explicitly")
    print("specmesh: ready. Ctrl-C stops every service.", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.is_set():
            if any(s.proc.poll() is not None for s in dep.services):
                print("specmesh: a service exited; stopping the rest", file=sys.stderr)
                break
            stop.wait(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        print("specmesh: stopping…", flush=True)
        dep.stop()


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )


def _stream_one(client: Client, prompt: str, sampling: SamplingParams, spec: SpecDecodeParams, chat: bool) -> float:
    """Stream one answer to stdout; return its decode tokens/s."""
    t0 = time.perf_counter()
    stream = client.generate(prompt, sampling, spec, chat=chat)
    for chunk in stream:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    elapsed = time.perf_counter() - t0
    s = stream.summary
    assert s is not None
    decode_s = max(elapsed - s.time_to_first_token_ms / 1e3, 1e-9)
    tps = (s.completion_tokens - 1) / decode_s if s.completion_tokens > 1 else 0.0
    m = s.speculation
    print(
        f"\n[{s.completion_tokens} tokens, finish={s.finish_reason}, TTFT {s.time_to_first_token_ms:.0f} ms, "
        f"{tps:.1f} tok/s, steps {m.steps}, {m.mean_accepted_length:.2f} tokens per step (every step counted)"
        + (f", no speculation: {m.fallback_reason}" if m.fallback_reason else "")
        + "]",
        file=sys.stderr,
        flush=True,
    )
    return tps


def _rpc_error(cmd: str, exc: grpc.RpcError, tls: TlsOptions | None) -> str:
    """The one line a failed call exits with; a refused connection hints at TLS (a plaintext client
    on a TLS port, or a missing client certificate, reads "Socket closed" otherwise)."""
    line = f"specmesh {cmd}: {exc.code().name}: {exc.details()}"
    if exc.code() == grpc.StatusCode.UNAVAILABLE and "Socket closed" in (exc.details() or ""):
        line += (
            " (a TLS port? give --tls-ca, and --tls-cert/--tls-key for mutual TLS)"
            if tls is None or not tls.cert
            else " (is the server's CA --tls-ca, and does it accept this client certificate?)"
        )
    return line


def _credentials(args: argparse.Namespace, token_kind: str) -> tuple[TlsOptions | None, str]:
    """TLS and token for ``args.target``: the flags (or their variables), else, for an address of the
    running ``specmesh up`` deployment, the certificates and the ``token_kind`` token it generated."""
    from specmesh.deploy import known_credentials, known_services

    try:
        tls, token = client_tls(args), client_token(args)
    except (OSError, ValueError) as exc:
        sys.exit(f"specmesh {args.cmd}: {exc}")
    targets = args.target if isinstance(args.target, list) else [args.target]
    if args.cmd == "status" or set(targets) & set(known_services().values()):
        local_tls, local_tokens = known_credentials()
        if tls is None and local_tls:
            tls = TlsOptions(ca=local_tls["ca"], cert=local_tls["cert"], key=local_tls["key"])
        if not token and token_kind in local_tokens:
            token = read_token(local_tokens[token_kind])
    return tls, token


def _generate(args: argparse.Namespace) -> None:
    spec = SpecDecodeParams(proposer=args.proposer, num_speculative_tokens=args.num_speculative_tokens)
    tls, token = _credentials(args, "client")
    with Client(args.target, tls=tls, token=token) as client:
        try:
            _stream_one(client, args.prompt, _sampling(args), spec, chat=not args.raw)
        except grpc.RpcError as exc:
            sys.exit(_rpc_error("generate", exc, tls))


def _status(args: argparse.Namespace) -> None:
    # A client command: the health check is plain grpcio (specmesh.health), the state file stdlib.
    from specmesh.deploy import check_http_health, default_run_dir, known_health_urls, known_services
    from specmesh.health import check_health

    services, urls = dict(known_services()), known_health_urls()
    tls, _ = _credentials(args, "client")
    for i, addr in enumerate(args.target or []):
        services[f"target{i}"] = addr
    if not services:
        note = f"no local deployment recorded in {default_run_dir()}; checking the default verifier"
        print(f"specmesh status: {note}", file=sys.stderr)
        services = {"verifier": DEFAULT_ADDRESS}
    bad = 0
    for name, addr in services.items():
        ca = tls.ca if tls is not None else None
        state = check_http_health(urls[name], ca=ca) if name in urls else check_health(addr, tls=tls)
        bad += state != "SERVING"
        print(f"{name:<10} {addr:<22} {state}")
    sys.exit(1 if bad else 0)


def _admin(args: argparse.Namespace) -> None:
    from google.protobuf import text_format

    from specmesh.v1 import admin_pb2

    tls, token = _credentials(args, "admin")
    with Client(args.target, tls=tls, token=token) as client:
        try:
            if args.admin_cmd == "stats":
                print(text_format.MessageToString(client.stats()), end="")
            elif args.admin_cmd == "policy":
                mode = {
                    "auto": admin_pb2.POLICY_MODE_AUTO,
                    "fixed": admin_pb2.POLICY_MODE_FIXED,
                    "off": admin_pb2.POLICY_MODE_OFF,
                }
                policy = admin_pb2.SpeculationPolicy(
                    mode=mode[args.mode],
                    proposer=args.proposer or "",
                    num_speculative_tokens=args.num_speculative_tokens,
                    max_tree_nodes=args.max_tree_nodes,
                )
                print(text_format.MessageToString(client.set_policy(policy)), end="")
            elif args.admin_cmd == "router-stats":
                print(text_format.MessageToString(client.router_stats(args.proposer, args.tag)), end="")
        except grpc.RpcError as exc:
            sys.exit(_rpc_error("admin", exc, tls))


def _demo(args: argparse.Namespace) -> None:
    from concurrent.futures import ThreadPoolExecutor

    dep = _deployment(args)
    print("specmesh demo: starting the services (n-gram proposer + verifier)…", flush=True)
    dep.start()
    try:
        with Client(dep.verifier_address, tls=dep.client_tls, token=dep.token()) as client:
            greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
            print(f"\n>>> {DEMO_PROMPT.splitlines()[0]} …\n", flush=True)
            fast = _stream_one(client, DEMO_PROMPT, greedy, SpecDecodeParams(proposer="ngram"), chat=True)
            t0 = time.perf_counter()
            plain = client.complete(DEMO_PROMPT, greedy, SpecDecodeParams(proposer="none"), chat=True)
            decode_s = time.perf_counter() - t0 - plain.summary.time_to_first_token_ms / 1e3
            plain_tps = (len(plain.token_ids) - 1) / max(decode_s, 1e-9)  # decode rate, as _stream_one reports
            same = client.complete(DEMO_PROMPT, greedy, SpecDecodeParams(proposer="ngram"), chat=True)
            print(
                f"\nspeculative (n-gram): {fast:.1f} tok/s | plain decoding: {plain_tps:.1f} tok/s | "
                f"speed-up {fast / max(plain_tps, 1e-9):.2f}x | output identical: {same.token_ids == plain.token_ids}",
                flush=True,
            )

            print(f"\n>>> {len(DEMO_CONCURRENT_PROMPTS)} concurrent streams (continuous batching)…", flush=True)
            short = SamplingParams(temperature=0.0, max_tokens=64)  # each answer ends where the model ends it
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(DEMO_CONCURRENT_PROMPTS)) as pool:
                results = list(pool.map(lambda p: client.complete(p, short, chat=True), DEMO_CONCURRENT_PROMPTS))
            elapsed = time.perf_counter() - t0
            total = sum(len(r.token_ids) for r in results)
            print(f"    first answer: {results[0].text.strip()[:100]!r}")
            print(f"    {len(results)} streams: {total / elapsed:.1f} tok/s aggregate", flush=True)
        if dep.gateway_url and importlib.util.find_spec("openai") is None:
            print("\n(the OpenAI-client part needs the openai package: pip install 'specmesh[bench]')", flush=True)
        elif dep.gateway_url:
            _demo_openai(dep.gateway_url, dep.token("api_key") or "unused", dep.tls_files.get("ca"))
    finally:
        dep.stop()
        print("specmesh demo: services stopped.", flush=True)


def _demo_openai(base_url: str, api_key: str = "unused", ca: Path | None = None) -> None:
    """The same server through its OpenAI-compatible API, with the official client (``ca``: an https gateway's)."""
    from openai import DefaultHttpxClient, OpenAI

    print(f"\n>>> The OpenAI API at {base_url}: a streamed chat, speculation chosen per request…\n", flush=True)
    http = DefaultHttpxClient(verify=_ssl_context(ca)) if ca else None
    client = OpenAI(base_url=base_url, api_key=api_key, http_client=http)
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": DEMO_PROMPT}],
        max_tokens=120,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"spec_decode": {"proposer": "ngram"}},
    )
    for chunk in stream:
        if chunk.choices:
            sys.stdout.write(chunk.choices[0].delta.content or "")
            sys.stdout.flush()
        elif chunk.usage is not None:
            spec = (chunk.model_extra or {}).get("metrics", {}).get("speculative_decoding", {})
            print(
                f"\n[usage {chunk.usage.completion_tokens} tokens; speculation: "
                f"{spec.get('num_accepted_draft_tokens')}/{spec.get('num_draft_tokens')} drafted tokens accepted, "
                f"mean acceptance length {spec.get('mean_acceptance_length', 0):.2f} (vLLM's: 1 + accepted tokens "
                "per step that carried a draft; the gRPC line above counts every step)]",
                flush=True,
            )


def _ssl_context(ca: Path):
    import ssl

    return ssl.create_default_context(cafile=str(ca))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _add_deploy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--verifier-address", default=DEFAULT_ADDRESS)
    p.add_argument("--threads", type=int, default=0, help="torch threads of the verifier (0 = default)")
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="the verifier shards the target over N ranks (processes) on this machine; on a GPU, rank r "
        "uses cuda:r (default 1)",
    )
    p.add_argument("--run-dir", default=None, help="where logs and the deployment state file go")
    p.add_argument(
        "--rag", default="", metavar="ADDRESS", help="also start the rag proposer here (e.g. 127.0.0.1:50063)"
    )
    p.add_argument(
        "--suffix",
        default="127.0.0.1:50064",
        metavar="ADDRESS",
        help="the suffix proposer (learns from every output) listens here; '' = not started",
    )
    p.add_argument("--draft", default="", metavar="ADDRESS", help="also start a draft-model proposer here")
    p.add_argument("--draft-model", default=None, help="the draft's HF folder (default: the target model)")
    p.add_argument(
        "--head",
        default="",
        metavar="ADDRESS",
        help="also start a learned-head proposer here (e.g. 127.0.0.1:50065); '' = not started",
    )
    p.add_argument(
        "--head-dir",
        default="",
        metavar="DIR",
        help="the head's folder (`specmesh head train --out`); default: the target's cached head, trained once "
        "on first use (minutes)",
    )
    p.add_argument(
        "--gateway",
        default="127.0.0.1:8000",
        metavar="ADDRESS",
        help="the OpenAI-compatible HTTP gateway's host:port (default 127.0.0.1:8000); '' = none",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("SPECMESH_REDIS_URL", ""),
        help="router statistics in Redis (e.g. redis://127.0.0.1:6379/0); default: in the verifier process",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="encrypt every hop: a throwaway CA and certificate under RUN_DIR/tls, mutual TLS between the "
        "services, the gateway on https",
    )
    p.add_argument(
        "--auth",
        action="store_true",
        help="require tokens: throwaway client, admin, proposer-tier tokens and a gateway API key under "
        "RUN_DIR/secrets (the CLI's generate/admin use them for this deployment)",
    )


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specmesh",
        description="SpecMesh: speculative decoding as gRPC services.",
        epilog="generate, status and admin are client commands; the others need pip install 'specmesh[serve]'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the pip line whole
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    sub.add_parser("serve", help="run one service in the foreground (as a container does)", add_help=False)
    for name, module in TOOLS.items():
        sub.add_parser(name, help=f"see `specmesh {name} --help` ({module})", add_help=False)

    up = sub.add_parser("up", help="start every service as its own local process")
    _add_deploy_flags(up)

    gen = sub.add_parser("generate", help="stream a completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--target", default=DEFAULT_ADDRESS, help="verifier host:port")
    gen.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    gen.add_argument("--proposer", default="auto", help="auto, none, ngram, suffix, draft, head, rag")
    gen.add_argument("--num-speculative-tokens", type=int, default=0)
    _add_sampling_flags(gen)
    add_client_flags(gen)

    st = sub.add_parser("status", help="health of each service")
    st.add_argument("--target", action="append", help="extra host:port to check (repeatable)")
    add_client_flags(st)

    adm = sub.add_parser("admin", help="live statistics and the runtime speculation policy")
    adm.add_argument("--target", default=DEFAULT_ADDRESS, help="verifier host:port (its --admin-address if set)")
    add_client_flags(adm)
    adm_sub = adm.add_subparsers(dest="admin_cmd", required=True)
    adm_sub.add_parser("stats", help="print live statistics")
    pol = adm_sub.add_parser("policy", help="set the default speculation policy")
    pol.add_argument("--mode", choices=["auto", "fixed", "off"], required=True)
    pol.add_argument("--proposer", default="", help="proposer for --mode fixed")
    pol.add_argument("--num-speculative-tokens", type=int, default=0)
    pol.add_argument("--max-tree-nodes", type=int, default=0)
    rs = adm_sub.add_parser("router-stats", help="the router's acceptance statistics per proposer and tag")
    rs.add_argument("--proposer", default="", help="only this proposer")
    rs.add_argument("--tag", default="", help="only this workload tag")

    demo = sub.add_parser("demo", help="start the services, stream answers, print tokens/s, stop")
    _add_deploy_flags(demo)
    demo.add_argument("--max-tokens", type=int, default=160)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":  # service flags belong to the service's own parser
        _serve(argv[1:])
        return
    if argv and argv[0] in TOOLS:
        extras.run_main(argv[0], TOOLS[argv[0]], argv[1:], TOOL_EXTRAS.get(argv[0], "serve"))
        return
    args = build_parser().parse_args(argv)
    {"up": _up, "generate": _generate, "status": _status, "admin": _admin, "demo": _demo}[args.cmd](args)
