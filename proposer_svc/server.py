"""A proposer service process: ``ProposerService.Propose``, one stream per request.

``specmesh serve ngram`` runs the n-gram proposer. Per stream the proposer keeps its own view
of the context (prompt + every accepted token) and answers each Start/Advance with a tree.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from proposer_svc.ngram import NgramConfig, NgramIndex
from specmesh.serving import new_server, serve
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc

log = logging.getLogger(__name__)


class RequestProposer(Protocol):
    """Per-request proposer state: grows with the context, proposes a tree for it."""

    @property
    def context_length(self) -> int: ...

    def extend(self, tokens: list[int]) -> None: ...

    def propose(self, max_nodes: int | None, max_depth: int | None) -> tuple[list[int], list[int]]: ...


class ProposerServicer(proposer_pb2_grpc.ProposerServiceServicer):
    def __init__(self, config: NgramConfig) -> None:
        self.config = config

    async def Propose(
        self, request_iterator: AsyncIterator[proposer_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[proposer_pb2.ProposeResponse]:
        state: RequestProposer | None = None
        budget = proposer_pb2.TreeBudget()
        async for msg in request_iterator:
            kind = msg.WhichOneof("event")
            if kind == "start":
                if state is not None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "start: stream already started")
                if not msg.start.prompt_token_ids:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start.prompt_token_ids: empty")
                state = NgramIndex(self.config)  # one module per proposer kind behind RequestProposer
                state.extend(list(msg.start.prompt_token_ids))
                budget = msg.start.budget
            elif kind == "advance":
                if state is None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "advance before start")
                state.extend(list(msg.advance.accepted_token_ids))
                if msg.advance.HasField("budget"):
                    budget = msg.advance.budget
            else:
                return
            tokens, parents = state.propose(budget.max_nodes or None, budget.max_depth or None)
            yield proposer_pb2.ProposeResponse(
                context_length=state.context_length, tree=proposer_pb2.TokenTree(tokens=tokens, parents=parents)
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="specmesh serve ngram", description="SpecMesh n-gram (prompt lookup) proposer.")
    p.add_argument("--address", default=env("SPECMESH_NGRAM_ADDRESS", "127.0.0.1:50061"), help="host:port")
    p.add_argument("--min-n", type=int, default=int(env("SPECMESH_NGRAM_MIN_N", "2")))
    p.add_argument("--max-n", type=int, default=int(env("SPECMESH_NGRAM_MAX_N", "5")))
    p.add_argument("--max-nodes", type=int, default=int(env("SPECMESH_NGRAM_MAX_NODES", "16")))
    p.add_argument("--max-depth", type=int, default=int(env("SPECMESH_NGRAM_MAX_DEPTH", "12")))
    p.add_argument("--grace", type=float, default=float(env("SPECMESH_GRACE_S", "30")))
    return p.parse_args(argv)


async def run(a: argparse.Namespace) -> None:
    config = NgramConfig(min_n=a.min_n, max_n=a.max_n, max_nodes=a.max_nodes, max_depth=a.max_depth)
    server = new_server()
    proposer_pb2_grpc.add_ProposerServiceServicer_to_server(ProposerServicer(config), server)
    name = proposer_pb2.DESCRIPTOR.services_by_name["ProposerService"].full_name
    await serve(server, a.address, [name], grace_s=a.grace, ready_message="ngram proposer")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(parse_args(argv)))
