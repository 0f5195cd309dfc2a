"""A proposer service process: ``ProposerService.Propose``, one stream per request.

``specmesh serve ngram`` runs the n-gram proposer. Per stream the proposer keeps its own view
of the context (prompt + every accepted token) and answers each Start/Advance with a tree.
Other proposer kinds reuse ``ProposerServicer`` with their own factory, which builds the
per-request state from the Start message (or refuses the stream with ``ProposerStartError``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc

from specmesh.server.metrics import ProposerMetrics
from specmesh.server.ngram import NgramConfig, NgramIndex
from specmesh.server.serving import new_server, serve
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc

log = logging.getLogger(__name__)


class RequestProposer(Protocol):
    """Per-request proposer state: grows with the context, proposes a tree for it."""

    @property
    def context_length(self) -> int: ...

    def extend(self, tokens: list[int]) -> None: ...

    def propose(self, max_nodes: int | None, max_depth: int | None) -> tuple[list[int], list[int]]: ...


class ProposerStartError(Exception):
    """A factory's refusal of a stream: the status code and message the stream is aborted with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


# Builds one request's proposer state from its Start message (prompt not yet added).
ProposerFactory = Callable[[proposer_pb2.ProposeStart], RequestProposer]


def ngram_factory(config: NgramConfig) -> ProposerFactory:
    return lambda start: NgramIndex(config)


class ProposerServicer(proposer_pb2_grpc.ProposerServiceServicer):
    def __init__(self, factory: ProposerFactory, metrics: ProposerMetrics | None = None) -> None:
        self.factory, self.metrics = factory, metrics

    async def Propose(
        self, request_iterator: AsyncIterator[proposer_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[proposer_pb2.ProposeResponse]:
        if self.metrics is None:
            async for resp in self._propose(request_iterator, context):
                yield resp
            return
        self.metrics.session_started()
        outcome = "error"
        try:
            async for resp in self._propose(request_iterator, context):
                yield resp
            outcome = "ok"
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.metrics.session_ended(outcome)

    async def _propose(
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
                try:
                    state = self.factory(msg.start)
                except ProposerStartError as exc:
                    await context.abort(exc.code, exc.message)
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
            t0 = time.perf_counter()
            tokens, parents = state.propose(budget.max_nodes or None, budget.max_depth or None)
            if self.metrics is not None:
                self.metrics.proposal(len(tokens), time.perf_counter() - t0)
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
    add_metrics_flag(p)
    return p.parse_args(argv)


def add_metrics_flag(p: argparse.ArgumentParser) -> None:
    """``--metrics-port``, shared by every proposer service."""
    default = int(os.environ.get("SPECMESH_METRICS_PORT", "0"))
    p.add_argument("--metrics-port", type=int, default=default, help="Prometheus /metrics port; 0 = off")


async def run(a: argparse.Namespace) -> None:
    config = NgramConfig(min_n=a.min_n, max_n=a.max_n, max_nodes=a.max_nodes, max_depth=a.max_depth)
    server = new_server()
    metrics = ProposerMetrics("ngram")
    proposer_pb2_grpc.add_ProposerServiceServicer_to_server(ProposerServicer(ngram_factory(config), metrics), server)
    name = proposer_pb2.DESCRIPTOR.services_by_name["ProposerService"].full_name
    await serve(server, a.address, [name], grace_s=a.grace, ready_message="ngram proposer", metrics_port=a.metrics_port)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(parse_args(argv)))
