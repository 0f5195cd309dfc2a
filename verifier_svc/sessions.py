"""Opening one request's proposer: a gRPC ``Propose`` stream to a proposer tier, or the in-process
n-gram proposer. :meth:`SessionOpener.open` is the speculation control's
``request_speculation.SessionFactory``."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from specmesh.v1 import proposer_pb2, proposer_pb2_grpc
from specmesh_router.policy import PolicyStore
from verifier_svc.local_proposer import LocalProposerSession
from verifier_svc.proposer_client import GrpcProposerSession, ProposerLimits
from verifier_svc.requests import GenerationRequest

DEFAULT_TREE_NODES = 32
DEFAULT_TREE_DEPTH = 24


@dataclass(frozen=True)
class ProposerTiers:
    """How the verifier reaches each configured proposer."""

    stubs: dict[str, proposer_pb2_grpc.ProposerServiceStub]  # gRPC services (dns:/// balances replicas)
    local: tuple[str, ...] = ()  # served in this process (verifier_svc/local_proposer.py)
    metadata: tuple[tuple[str, str], ...] = ()  # sent with every Propose call (the tier token)

    def __contains__(self, name: str) -> bool:
        return name in self.stubs or name in self.local


class SessionOpener:
    def __init__(
        self,
        tiers: ProposerTiers,
        policy: PolicyStore,
        vocab: proposer_pb2.VocabIdentity,
        model_name: str,
        loop: asyncio.AbstractEventLoop,
        arrived: threading.Condition,
        max_tree_nodes: int,
        vocab_size: int,
    ) -> None:
        self.tiers, self.policy, self.vocab, self.model_name = tiers, policy, vocab, model_name
        self.loop, self.arrived = loop, arrived  # arrived: notified whenever a tree lands
        self.max_tree_nodes, self.vocab_size = max_tree_nodes, vocab_size

    def open(self, req: GenerationRequest, proposer: str) -> GrpcProposerSession | LocalProposerSession | None:
        """A proposer stream for ``req`` from its prompt, or None where ``proposer`` is not configured."""
        if proposer not in self.tiers:
            return None
        policy = self.policy.get()
        nodes = req.spec_params.max_tree_nodes or policy.max_tree_nodes or DEFAULT_TREE_NODES
        depth = req.spec_params.num_speculative_tokens or policy.num_speculative_tokens or DEFAULT_TREE_DEPTH
        if policy.num_speculative_tokens:
            depth = min(depth, policy.num_speculative_tokens)
        nodes = min(nodes, self.max_tree_nodes)
        context = list(req.prompt_ids)
        limits = ProposerLimits(vocab_size=self.vocab_size, max_nodes=nodes, max_depth=depth)
        if proposer in self.tiers.local:
            return LocalProposerSession(proposer, context, limits, self.arrived)
        start = proposer_pb2.ProposeStart(
            request_id=req.request_id,
            prompt_token_ids=context,
            budget=proposer_pb2.TreeBudget(max_nodes=nodes, max_depth=depth),
            sampling=proposer_pb2.ProposalSampling(
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed
            ),
            vocab=self.vocab,
            target_model=self.model_name,
            workload_tag=req.spec_params.workload_tag,
            corpus=req.spec_params.corpus,
            cache_scope=req.spec_params.cache_scope,
        )
        stub = self.tiers.stubs[proposer]
        session = GrpcProposerSession(
            proposer, stub, self.loop, start, limits, self.arrived, metadata=self.tiers.metadata
        )
        self.loop.call_soon_threadsafe(session.open)
        return session
