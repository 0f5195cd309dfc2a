"""The verifier process: the target model, the engine, the speculation control and the gRPC
services over them (``generation_service``, ``admin_service``), wired from one frozen config."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
import time

from specmesh.client import RECONNECT_OPTIONS
from specmesh.credentials import bearer
from specmesh.credentials import channel as open_channel
from specmesh.v1 import admin_pb2_grpc, generation_pb2, generation_pb2_grpc, proposer_pb2, proposer_pb2_grpc
from specmesh_router.policy import PolicyStore
from specmesh_router.selection import Router, SelectionConfig
from specmesh_router.stats import StatsConfig, open_stats
from specmesh_server.metrics import REGISTRY, RouterStatsCollector, VerifierMetrics
from specmesh_server.model_loading import tokenizer_hash
from specmesh_server.serving import new_server, serve
from specmesh_server.tensor_parallel import TensorParallelConfigError
from specmesh_server.torch_thread import TorchThread
from verifier_svc.admin_service import ADMIN_SERVICE, AdminServicer, start_admin_server, verifier_auth
from verifier_svc.config import VerifierConfig, parse_args
from verifier_svc.engine import Engine
from verifier_svc.generation_service import GenerationServicer
from verifier_svc.kernel_paths import KernelUnavailable
from verifier_svc.learning import LearnConfig, OutputLearning
from verifier_svc.local_proposer import inprocess_kind
from verifier_svc.ranks import Placement, follow_main, placement, spawn
from verifier_svc.requests import RequestLimits, max_prompt_bytes
from verifier_svc.sessions import ProposerTiers, SessionOpener
from verifier_svc.speculation import SpeculationControl
from verifier_svc.target_model import check_shardable, eos_token_ids, load_target


async def run(config: VerifierConfig, where: Placement | None = None, spawned: list | None = None) -> str | None:
    """Serve until stopped; returns why the verifier failed (a rank), None after a clean stop."""
    torch_thread = TorchThread("specmesh-engine")  # loads the model, then runs the engine loop
    target = await torch_thread.run(load_target, config, where, spawned)
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
    router = Router(stats, lm.name, config.auto_proposers or names, policy, step_time, SelectionConfig())
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
    speculation = SpeculationControl(
        config.engine.speculation,
        router,
        step_cost,
        metrics,
        open_session=sessions.open,
        trees_arrived=arrived,
        learn=learning.finished if learning is not None else None,
    )
    engine = Engine(
        runner,
        lm.tokenizer,
        eos_token_ids(lm.model, lm.tokenizer),
        max_context,
        dataclasses.replace(config.engine, step_room=step_room, cache_namespace=str(lm.path)),
        speculation,
        metrics=metrics,
        thread=torch_thread,
        on_fatal=lambda reason: fatal(reason),
    )

    def fatal(reason: str) -> None:
        """A failed rank: drain as on SIGTERM (health NOT_SERVING first), then exit non-zero (main)."""
        if target.group is not None:
            target.group.leader.fail(reason)  # however the engine learnt it: no more sends, no pending wait
        os.kill(os.getpid(), signal.SIGTERM)

    if target.group is not None:
        target.group.leader.on_failure = engine.fail  # at once, if a rank already failed
    metrics.track_queue(engine.counts)
    pool = runner.cache.pool
    metrics.track_kv_cache(
        lambda: runner.cache.allocated_bytes,
        kv_tokens * runner.cache.bytes_per_token,
        lambda: pool.used_blocks / pool.num_blocks,
    )
    REGISTRY.register(RouterStatsCollector(stats, model=lm.name, tags=config.metrics_tags))
    generation = GenerationServicer(
        engine,
        lm.tokenizer,
        limits,
        speculation,
        metrics,
        grammar_threads=config.grammar_threads,
        grammar_timeout_s=config.grammar_compile_timeout_s,
    )
    engine.start()
    auth = verifier_auth(config)
    server = new_server(auth)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(generation, server)
    dtype = str(lm.dtype).removeprefix("torch.")
    if config.weights == "gguf":  # what a client's ServerInfo (and bench's machine line) says runs
        dtype += " with GGUF blocks"
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
        if target.group is not None:
            target.group.close()
        stats.close()
    return engine.failed


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    config = parse_args(argv)
    spawned: list = []
    try:
        where = placement(config)
        if where.world > 1:
            check_shardable(config, where)
        if where.rank > 0:  # a follower rank: no port, rank 0's forwards until it stops or is gone
            sys.exit(follow_main(config, where))
        if where.spawned:
            spawned = spawn(config, where, argv)
        failed = asyncio.run(run(config, where, spawned))
    except (KernelUnavailable, TensorParallelConfigError) as exc:  # a start-up refusal: one line, no traceback
        sys.exit(f"specmesh serve verifier: {exc}")
    finally:
        for proc in spawned:  # rank 0 leaves no rank behind
            if proc.poll() is None:
                proc.kill()
    if failed is not None:  # no interpreter teardown: a failed process group's may hang (NCCL)
        print(f"specmesh serve verifier: exiting for a restart: {failed}", file=sys.stderr, flush=True)
        os._exit(1)
