"""The verifier's AdminService (statistics, the speculation policy) and the token check of its ports."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from specmesh.v1 import admin_pb2, admin_pb2_grpc
from specmesh_router.policy import PolicyStore, SpeculationPolicy
from specmesh_router.stats import StatsBackend
from specmesh_server.auth import TokenAuth
from specmesh_server.serving import new_server, start_port
from verifier_svc.config import VerifierConfig

if TYPE_CHECKING:
    from verifier_svc.engine import Engine

log = logging.getLogger(__name__)

_MODE_TO_PB = {
    "auto": admin_pb2.POLICY_MODE_AUTO,
    "fixed": admin_pb2.POLICY_MODE_FIXED,
    "off": admin_pb2.POLICY_MODE_OFF,
}
_PB_TO_MODE = {v: k for k, v in _MODE_TO_PB.items()}
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name


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
        pool = self.engine.blocks.pool  # read without stopping the engine: figures of about now
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
            preempted_requests=s.preempted,
            kv_blocks=pool.num_blocks,
            kv_block_size=pool.block_size,
            kv_blocks_in_use=pool.used_blocks,
            kv_blocks_cached=len(pool.cached),
            prefix_cache_queries=pool.counters.queries,
            prefix_cache_hits=pool.counters.hits,
            kv_evictions=pool.counters.evictions,
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
