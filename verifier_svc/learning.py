"""Finished outputs to the proposer tiers that learn from past outputs (``ProposerService.Learn``).

A tier that followed a request (had its ``Propose`` stream) already learnt its output from the
stream; every other gRPC tier gets it once the request finishes, so a proposer that learns (suffix)
sees all traffic, whichever proposer served a request or none. Under ``auto`` this is what keeps a
cold suffix cache from staying cold: without it, the suffix tier would learn only from the
requests the router already sends it. A tier that answers UNIMPLEMENTED learns nothing and is not
asked again. Calls run on the asyncio loop, never on the engine thread; at most
``max_in_flight`` at once (beyond, outputs are dropped and counted), each with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection
from dataclasses import dataclass

import grpc

from specmesh.v1 import proposer_pb2
from specmesh_server import loop_posts
from specmesh_server.log_limit import RateLimitedLog
from specmesh_server.metrics import VerifierMetrics
from verifier_svc.requests import GenerationRequest
from verifier_svc.sessions import ProposerTiers

log = logging.getLogger(__name__)
warn = RateLimitedLog(log)


@dataclass(frozen=True)
class LearnConfig:
    timeout_s: float = 5.0  # per Learn call
    max_in_flight: int = 64  # Learn calls outstanding at once, every tier together


class OutputLearning:
    """Sends each finished request's output to the tiers that did not follow it (``finished``)."""

    def __init__(
        self,
        config: LearnConfig,
        tiers: ProposerTiers,
        model_name: str,
        loop: asyncio.AbstractEventLoop,
        metrics: VerifierMetrics | None = None,
    ) -> None:
        self.config, self.tiers, self.model_name, self.loop = config, tiers, model_name, loop
        self.metrics = metrics
        self.not_learning: set[str] = set()  # tiers that answered UNIMPLEMENTED (loop thread only)
        self._in_flight: set[asyncio.Task] = set()

    def finished(self, req: GenerationRequest, output: list[int], followed: Collection[str]) -> None:
        """Engine thread: the request ended with ``output``; ``followed``: the proposers it had streams with."""
        if not output:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: the server is shutting down
            loop_posts.post(self.loop, self._send_all, req, output, frozenset(followed))

    def _send_all(self, req: GenerationRequest, output: list[int], followed: frozenset[str]) -> None:
        targets = [name for name in self.tiers.stubs if name not in followed and name not in self.not_learning]
        if not targets:
            return
        msg = proposer_pb2.LearnRequest(
            request_id=req.request_id,
            cache_scope=req.spec_params.cache_scope,
            prompt_token_ids=req.prompt_ids,
            output_token_ids=output,
            target_model=self.model_name,
        )
        for name in targets:
            if len(self._in_flight) >= self.config.max_in_flight:
                self._count(name, "dropped")
                warn.warning(
                    "learn", "Learn: %d calls outstanding; an output for %s dropped", len(self._in_flight), name
                )
                continue
            task = asyncio.ensure_future(self._send(name, msg))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _send(self, name: str, msg: proposer_pb2.LearnRequest) -> None:
        try:
            await self.tiers.stubs[name].Learn(msg, timeout=self.config.timeout_s, metadata=self.tiers.metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.not_learning.add(name)
                log.info("proposer %s does not learn from outputs (Learn unimplemented): not asked again", name)
                self._count(name, "unimplemented")
            else:
                warn.warning(f"learn-{name}", "Learn to %s failed: %s %s", name, exc.code().name, exc.details())
                self._count(name, "error")
            return
        self._count(name, "ok")

    def _count(self, proposer: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.learned(proposer, outcome)
