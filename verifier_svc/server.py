"""gRPC front of the verifier: GenerationService and AdminService over the engine."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from specmesh.client import RECONNECT_OPTIONS
from specmesh.credentials import bearer
from specmesh.credentials import channel as open_channel
from specmesh.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    params_pb2,
    proposer_pb2,
    proposer_pb2_grpc,
)
from specmesh_router.cost_model import LiveStepCost
from specmesh_router.policy import PolicyStore, SpeculationPolicy
from specmesh_router.selection import Router, SelectionConfig
from specmesh_router.stats import StatsBackend, StatsConfig, open_stats
from specmesh_server.auth import TokenAuth
from specmesh_server.metrics import REGISTRY, RouterStatsCollector, VerifierMetrics
from specmesh_server.model_loading import tokenizer_hash
from specmesh_server.serving import new_server, serve, start_port
from specmesh_server.torch_thread import TorchThread
from verifier_svc.config import VerifierConfig, parse_args
from verifier_svc.engine import Engine
from verifier_svc.events import EngineFull, EngineStopped, ErrorEvent, Event, FinishEvent, NeverFits
from verifier_svc.kernel_paths import ATTENTION, KernelUnavailable, check_kernel_device, check_kernel_model, describe
from verifier_svc.learning import LearnConfig, OutputLearning
from verifier_svc.local_proposer import inprocess_kind
from verifier_svc.logprobs import TokenLogprob
from verifier_svc.proposer_client import GrpcProposerSession
from verifier_svc.requests import (
    InvalidRequest,
    ProposerNotConfigured,
    RequestLimits,
    build_request,
    max_prompt_bytes,
)
from verifier_svc.sessions import ProposerTiers, SessionOpener
from verifier_svc.speculation import cap_of

if TYPE_CHECKING:
    from specmesh_server.model_loading import LoadedModel
    from specmesh_server.model_runner import ModelRunner

log = logging.getLogger(__name__)

_FINISH = {
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "eos": generation_pb2.FINISH_REASON_EOS,
    "stop": generation_pb2.FINISH_REASON_STOP,
}
_MODE_TO_PB = {
    "auto": admin_pb2.POLICY_MODE_AUTO,
    "fixed": admin_pb2.POLICY_MODE_FIXED,
    "off": admin_pb2.POLICY_MODE_OFF,
}
_PB_TO_MODE = {v: k for k, v in _MODE_TO_PB.items()}


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self,
        engine: Engine,
        tokenizer: object,
        limits: RequestLimits,
        router: Router,
        sessions: SessionOpener,
        metrics: VerifierMetrics | None = None,
        router_caps: bool = True,
    ) -> None:
        self.engine, self.tokenizer, self.limits, self.router = engine, tokenizer, limits, router
        self.sessions, self.metrics = sessions, metrics
        # One thread: requests tokenize in arrival order, and the fast tokenizer's settings are never
        # touched from two threads at once (its Rust object refuses concurrent mutable borrows).
        self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specmesh-tokenize")
        self.router_caps = router_caps  # False (--spec-gating always): the router picks proposers, not k
        # A token's text on its own, for logprobs; cached (bounded by the vocabulary) since it repeats.
        self.token_text = functools.lru_cache(maxsize=65536)(
            lambda token_id: tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        )

    def _logprobs_pb(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> list[generation_pb2.TokenLogprob]:
        text = self.token_text
        return [
            generation_pb2.TokenLogprob(
                logprob=lp.logprob,
                token=text(tok),
                top_logprobs=[
                    generation_pb2.TopLogprob(token_id=i, logprob=v, token=text(i))
                    for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
                ],
            )
            for tok, lp in zip(token_ids, logprobs, strict=True)
        ]

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:  # tokenizing (and chat templates) off the event loop: other streams keep flowing
            req = await asyncio.get_running_loop().run_in_executor(
                self.tokenize_pool, build_request, request, self.tokenizer, self.limits
            )
        except InvalidRequest as exc:
            if self.metrics is not None:
                self.metrics.request_finished("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ProposerNotConfigured as exc:
            if self.metrics is not None:
                self.metrics.request_finished("invalid")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        running, _ = self.engine.counts()
        spec = req.spec
        d = self.router.decide(
            spec.proposer, spec.workload_tag, spec.num_speculative_tokens, running + 1, exclude=spec.unservable
        )
        if self.metrics is not None:
            self.metrics.decision(d.proposer, d.speculate)
        # Why this request runs without speculation, unless the client asked for exactly that.
        why_plain = d.reason if d.proposer == "none" and spec.proposer != "none" else ""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        session = self.sessions.open(req, d.proposer)
        if isinstance(session, GrpcProposerSession) and spec.proposer == d.proposer:  # named by the client
            try:
                with contextlib.suppress(TimeoutError):  # one proposer round trip (~1 ms); slow → no wait
                    await asyncio.wait_for(asyncio.shield(session.first_reply), timeout=0.5)
            except asyncio.CancelledError:  # the client left while we waited: its stream must not outlive it
                session.close()
                raise
            if session.refused is not None:
                code, details = session.refused
                session.close()
                if self.metrics is not None:
                    self.metrics.request_finished("invalid")
                await context.abort(code, f"spec_decode.proposer {d.proposer!r} refused the request: {details}")
        estimate = self.router.estimate(d.proposer, spec.workload_tag) if session is not None else None
        try:
            key = self.engine.submit(
                req,
                lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                session,
                k_cap=cap_of(d.k) if self.router_caps else None,
                estimate=estimate,
            )
        except (EngineFull, NeverFits, EngineStopped) as exc:
            if session is not None:
                session.close()
            if self.metrics is not None:
                self.metrics.request_finished("rejected")
            if isinstance(exc, EngineFull):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many concurrent requests: {exc}")
            if isinstance(exc, NeverFits):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finished = False
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, ErrorEvent):
                    finished = True
                    if self.metrics is not None:
                        self.metrics.request_finished("error")
                    await context.abort(grpc.StatusCode.INTERNAL, ev.message)
                if isinstance(ev, FinishEvent):
                    finished = True
                    yield generation_pb2.GenerateResponse(request_id=req.request_id, summary=_summary(ev, why_plain))
                    return
                chunk = generation_pb2.TokenChunk(token_ids=ev.token_ids, text=ev.text)
                if ev.logprobs is not None:
                    chunk.logprobs.extend(self._logprobs_pb(ev.token_ids, ev.logprobs))
                yield generation_pb2.GenerateResponse(request_id=req.request_id, chunk=chunk)
        finally:
            if not finished:  # client cancelled, disconnected or out of time: free the slot now
                self.engine.cancel(key)
                if self.metrics is not None:
                    self.metrics.request_finished(_unfinished_status(context))


def _unfinished_status(context: grpc.aio.ServicerContext) -> str:
    """Why a stream ended before its last event: the client's deadline passed (gRPC cancels the
    call then; a little slack for the clocks), or the client cancelled or went away."""
    left = context.time_remaining()
    return "deadline_exceeded" if left is not None and left < 0.05 else "cancelled"


def _summary(ev: FinishEvent, fallback_reason: str) -> generation_pb2.GenerationSummary:
    emitted_after_prefill = max(ev.completion_tokens - 1, 0)
    spec = ev.spec
    per_proposer = {
        name: params_pb2.ProposerMetrics(steps=c.steps, drafted_tokens=c.drafted, accepted_tokens=c.accepted)
        for name, c in spec.per_proposer.items()
    }
    return generation_pb2.GenerationSummary(
        finish_reason=_FINISH[ev.finish_reason],
        usage=generation_pb2.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens),
        speculation=params_pb2.SpeculationMetrics(
            steps=ev.steps,
            drafted_tokens=spec.drafted,
            accepted_tokens=spec.accepted,
            # tokens emitted per verification step (accepted + bonus)
            mean_accepted_length=emitted_after_prefill / ev.steps if ev.steps else 0.0,
            per_proposer=per_proposer,
            proposer_wait_ms=spec.wait_s * 1e3,
            verify_ms=ev.verify_ms,
            fallback_reason=spec.fallback_reason or fallback_reason,
            invalid_trees=spec.invalid_trees,
            accepted_length_counts=spec.accepted_hist,
        ),
        timing=generation_pb2.Timing(queue_ms=ev.queue_ms, time_to_first_token_ms=ev.ttft_ms, total_ms=ev.total_ms),
        stop_string=ev.stop_string,
    )


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    def __init__(
        self, engine: Engine, policy: PolicyStore, model: str, device: str, dtype: str, stats: StatsBackend
    ) -> None:
        self.engine, self.policy = engine, policy
        self.model, self.device, self.dtype = model, device, dtype
        self.router_stats = stats

    async def GetRouterStats(
        self, request: admin_pb2.GetRouterStatsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetRouterStatsResponse:
        model, proposer, tag = request.model or self.model, request.proposer.lower(), request.workload_tag
        rows = []
        for key, s in sorted(self.router_stats.snapshot().items(), key=lambda kv: (kv[0].proposer, kv[0].workload_tag)):
            if key.model != model or (proposer and key.proposer != proposer) or (tag and key.workload_tag != tag):
                continue
            rows.append(
                admin_pb2.RouterStats(
                    model=key.model,
                    proposer=key.proposer,
                    workload_tag=key.workload_tag,
                    steps=s.steps,
                    drafted_tokens=s.drafted,
                    accepted_tokens=s.accepted,
                    accepted_per_step=s.accepted_per_step,
                    drafted_per_step=s.drafted_per_step,
                    proposer_wait_ms_per_step=s.proposer_s_per_step * 1e3,
                    position_trials=list(s.trials),
                    position_accepted=list(s.hits),
                    position_ends=list(s.ends),
                    coverage=s.coverage,
                    served_steps=sum(s.served_steps),
                    served_tokens_per_step=s.served_tokens_per_step,
                    served_tokens_per_s=s.served_tokens_per_s,
                    served_steps_by_batch=list(s.served_steps),
                    served_tokens_per_s_by_batch=s.served_tokens_per_s_by_batch(),
                )
            )
        status = self.router_stats.status()
        return admin_pb2.GetRouterStatsResponse(
            backend=status.backend,
            connected=status.connected,
            detail=status.detail,
            half_life_s=self.router_stats.config.half_life_s,
            stats=rows,
        )

    async def GetStats(
        self, request: admin_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetStatsResponse:
        s = self.engine.stats
        running, waiting = self.engine.counts()
        server = admin_pb2.ServerStats(
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            running_requests=running,
            waiting_requests=waiting,
            finished_requests=s.finished,
            rejected_requests=s.rejected,
            cancelled_requests=s.cancelled,
            prompt_tokens=s.prompt_tokens,
            generated_tokens=s.generated_tokens,
            steps=s.steps,
            max_running_requests=self.engine.config.max_running,
            max_context_tokens=self.engine.max_context,
        )
        return admin_pb2.GetStatsResponse(server=server, policy=policy_to_pb(self.policy.get()))

    async def GetPolicy(
        self, request: admin_pb2.GetPolicyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetPolicyResponse:
        return admin_pb2.GetPolicyResponse(policy=policy_to_pb(self.policy.get()))

    async def SetPolicy(
        self, request: admin_pb2.SetPolicyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SetPolicyResponse:
        p = request.policy
        if p.mode not in _PB_TO_MODE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "policy.mode: must be AUTO, FIXED or OFF")
        try:
            new = self.policy.set(
                SpeculationPolicy(
                    mode=_PB_TO_MODE[p.mode],
                    proposer=p.proposer.lower(),
                    num_speculative_tokens=p.num_speculative_tokens,
                    max_tree_nodes=p.max_tree_nodes,
                )
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("speculation policy set to %s", new)
        return admin_pb2.SetPolicyResponse(policy=policy_to_pb(new))


def policy_to_pb(p: SpeculationPolicy) -> admin_pb2.SpeculationPolicy:
    return admin_pb2.SpeculationPolicy(
        mode=_MODE_TO_PB[p.mode],
        proposer=p.proposer,
        num_speculative_tokens=p.num_speculative_tokens,
        max_tree_nodes=p.max_tree_nodes,
    )


def eos_token_ids(model: object, tokenizer: object) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for x in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(x, int):
            ids.add(x)
        elif isinstance(x, list | tuple):
            ids.update(int(i) for i in x)
    return ids


@dataclasses.dataclass(frozen=True)
class LoadedTarget:
    """The target model as the engine serves it, built on the engine's thread (``load_target``)."""

    lm: LoadedModel
    runner: ModelRunner
    max_context: int
    kv_tokens: int  # KV cache positions the budget holds
    step_cost: LiveStepCost | None  # None: no proposers, or --spec-gating always


def load_target(config: VerifierConfig) -> LoadedTarget:
    """Load the model, pack its linears and measure its step cost. Runs on the thread that will
    run the engine: a second thread opening OpenMP regions would slow every step (``TorchThread``)."""
    import torch

    from specmesh_server.kv_cache import default_budget_bytes
    from specmesh_server.model_loading import load_model, pick_device
    from specmesh_server.model_runner import ModelRunner, measure_step_cost

    if config.threads > 0:
        torch.set_num_threads(config.threads)
    # A kernel the flags force must run here: refused now, before the model loads (and imports triton).
    check_kernel_device(config.attention, config.engine.device_accept, pick_device(config.device))
    t0 = time.perf_counter()
    lm = load_model(config.model, config.device, config.dtype)
    check_kernel_model(config.attention, lm.model.config)
    model_max = int(getattr(lm.model.config, "max_position_embeddings", 0) or 4096)
    max_context = min(config.max_context or model_max, model_max)
    print(
        f"verifier: model {lm.name} from {lm.path} on {lm.device} ({lm.dtype}) in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    kv_bytes = config.kv_cache_bytes or default_budget_bytes(lm.device)
    runner = ModelRunner(
        lm.model,
        lm.device,
        lm.dtype,
        max_context,
        tree_kernel=ATTENTION[config.attention],
        packed_linears=config.packed_linears,
        kv_budget_bytes=kv_bytes,
    )
    paths = describe(runner.tree_kernel, runner.packs, config.engine.device_accept, lm.device)
    print(f"verifier: {paths}", flush=True)
    kv_tokens = runner.cache.token_budget
    print(
        f"verifier: KV cache budget {kv_bytes / 2**20:.0f} MiB = {kv_tokens} positions "
        f"({kv_tokens // max_context} requests of the full {max_context}-token context)",
        flush=True,
    )
    if runner.packed_linears:
        print("verifier: linear layers run through oneDNN with pre-packed weights (--linears stock: off)", flush=True)
    step_cost = None
    if config.proposers and config.spec_gating == "cost":
        t1 = time.perf_counter()
        rows = tuple(r for r in (1, 2, 4, 8) if r <= max(config.engine.max_running, 1))
        table = measure_step_cost(runner, rows=rows)
        step_cost = LiveStepCost(table)  # corrected from every decode step the engine runs
        widths = ", ".join(
            f"{r}×[" + " ".join(f"{s / table.seconds[0][0]:.1f}" for s in row) + "]"
            for r, row in zip(table.rows, table.seconds, strict=True)
        )
        ctx = table.context
        context = (
            f"per cached key past {ctx.prefix}: {ctx.per_row_key * 1e6:.2f} µs per row + "
            f"{ctx.per_query_key * 1e6:.2f} µs per query"
            if ctx is not None
            else "context length not priced"
        )
        print(
            f"verifier: step cost (rows×[widths {', '.join(map(str, table.widths))}], vs 1×1 = "
            f"{table.seconds[0][0] * 1e3:.1f} ms) {widths}; {context}; measured in {time.perf_counter() - t1:.1f} s",
            flush=True,
        )
    return LoadedTarget(lm, runner, max_context, kv_tokens, step_cost)


async def run(config: VerifierConfig) -> None:
    torch_thread = TorchThread("specmesh-engine")  # loads the model, then runs the engine loop
    target = await torch_thread.run(load_target, config)
    lm, runner, max_context, step_cost = target.lm, target.runner, target.max_context, target.step_cost
    kv_tokens = target.kv_tokens
    names = tuple(name for name, _ in config.proposers)
    step_room = 1 + RequestLimits.max_tree_nodes  # one verification step: the pending token and a full tree
    limits = RequestLimits(
        max_context=max_context,
        vocab_size=runner.vocab_size,
        configured_proposers=names,
        max_prompt_bytes=max_prompt_bytes(lm.tokenizer, max_context),
        max_sequence=kv_tokens - step_room,
    )
    policy = PolicyStore(names, limits.policy_limits())  # SetPolicy's bounds are the requests' own
    stats = open_stats(
        StatsConfig(redis_url=config.redis_url, key_prefix=config.stats_prefix, half_life_s=config.stats_half_life_s)
    )
    # Without a measured cost (no proposers, or --spec-gating always) every k costs alike: speculate.
    step_time = step_cost if step_cost is not None else (lambda rows, width: 1.0)
    selection = SelectionConfig(exploration=config.exploration)
    router = Router(stats, lm.name, config.auto_proposers or names, policy, step_time, selection)
    metrics = VerifierMetrics(model=lm.name, proposers=names)
    # One channel per proposer tier; dns:/// names of headless services balance across replicas.
    local = tuple(name for name, addr in config.proposers if inprocess_kind(addr))
    # TLS with --proposer-tls-ca: a proposer whose certificate that CA did not sign never gets a Start.
    peer_tls = config.security.tls.peer(config.proposer_tls_ca)
    options = [("grpc.lb_policy_name", "round_robin"), *RECONNECT_OPTIONS]
    channels = {
        name: open_channel(addr, peer_tls, options, aio=True) for name, addr in config.proposers if name not in local
    }
    stubs = {name: proposer_pb2_grpc.ProposerServiceStub(ch) for name, ch in channels.items()}
    tiers = ProposerTiers(stubs, local, metadata=bearer(config.proposer_token))
    vocab = proposer_pb2.VocabIdentity(
        vocab_size=runner.vocab_size,
        tokenizer_hash=tokenizer_hash(lm.tokenizer),
        eos_token_ids=sorted(eos_token_ids(lm.model, lm.tokenizer)),
    )
    arrived = threading.Condition()  # proposer sessions notify the engine thread when a tree lands
    sessions = SessionOpener(
        tiers, policy, vocab, lm.name, asyncio.get_running_loop(), arrived, limits.max_tree_nodes, runner.vocab_size
    )
    learning = None
    if config.learn_outputs and stubs:
        learning = OutputLearning(LearnConfig(), tiers, lm.name, asyncio.get_running_loop(), metrics)
    engine = Engine(
        runner,
        lm.tokenizer,
        eos_token_ids(lm.model, lm.tokenizer),
        max_context,
        dataclasses.replace(config.engine, kv_budget_tokens=kv_tokens, step_room=step_room),
        step_cost,
        router=router,
        metrics=metrics,
        open_session=sessions.open,
        trees_arrived=arrived,
        learn=learning.finished if learning is not None else None,
        thread=torch_thread,
    )
    metrics.track_queue(engine.counts)
    metrics.track_kv_cache(lambda: runner.cache.allocated_bytes, kv_tokens * runner.cache.bytes_per_token)
    REGISTRY.register(RouterStatsCollector(stats, model=lm.name, tags=config.metrics_tags))
    generation = GenerationServicer(
        engine, lm.tokenizer, limits, router, sessions, metrics, router_caps=step_cost is not None
    )
    engine.start()
    auth = verifier_auth(config)
    server = new_server(auth)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(generation, server)
    dtype = str(lm.dtype).removeprefix("torch.")
    admin = AdminServicer(engine, policy, lm.name, str(lm.device), dtype, stats)
    services = [generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name]
    admin_server = None
    if config.admin_address:  # AdminService on its own (loopback) port only: absent from the client port
        admin_server = await start_admin_server(admin, config, auth)
    else:
        admin_pb2_grpc.add_AdminServiceServicer_to_server(admin, server)
        services.append(ADMIN_SERVICE)

    async def drain() -> None:
        engine.stop_accepting()
        deadline = time.monotonic() + config.grace_s
        while engine.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    try:
        await serve(
            server,
            config.address,
            services,
            on_drain=drain,
            grace_s=config.grace_s,
            ready_message="verifier",
            metrics_port=config.metrics_port,
            metrics_address=config.metrics_address,
            tls=config.security.tls,
            reflection_on=config.security.reflection,
            health_port=config.security.health_port,
        )
    finally:
        if admin_server is not None:
            await admin_server.stop(1.0)
        engine.shutdown()
        stats.close()


ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name


def verifier_auth(config: VerifierConfig) -> TokenAuth | None:
    """The token check of the verifier's ports: client tokens for generation, the admin token for
    AdminService (GetStats, which the gateway reads for /v1/models, takes either); None: no tokens set."""
    auth = TokenAuth(
        client_tokens=config.security.tokens,
        admin_tokens=config.admin_tokens,
        admin_prefixes=[f"/{ADMIN_SERVICE}/"],
        client_methods=[f"/{ADMIN_SERVICE}/GetStats"],
    )
    if auth.active and not config.admin_tokens:
        log.warning("no --admin-token-file: every client token may also call AdminService (SetPolicy …)")
    return auth if auth.active else None


async def start_admin_server(admin: AdminServicer, config: VerifierConfig, auth: TokenAuth | None) -> grpc.aio.Server:
    """AdminService (and health, reflection when on) on ``config.admin_address``, with the same TLS and tokens."""
    from grpc_health.v1 import health_pb2

    server = new_server(auth)
    admin_pb2_grpc.add_AdminServiceServicer_to_server(admin, server)
    health, _ = await start_port(
        server, config.admin_address, [ADMIN_SERVICE], config.security.tls, config.security.reflection
    )
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(ADMIN_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    print(f"verifier admin on {config.admin_address} ({config.security.tls.describe})", flush=True)
    return server


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_args(argv)
    try:
        asyncio.run(run(config))
    except KernelUnavailable as exc:  # a start-up refusal: one line, no traceback
        sys.exit(f"specmesh serve verifier: {exc}")
