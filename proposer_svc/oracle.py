"""The oracle proposer: proposes the target's own greedy continuation, known in advance.

It bounds what any proposer can gain on this verifier and hardware: every drafted token is
accepted, so its speed-up is the verifier's cost ceiling. The benchmark fills in each prompt's
continuation from the same run's plain greedy output, then serves it over the ordinary
``ProposerService.Propose`` stream (``proposer_svc/core/stream.py``; a chain of as many tokens as the
budget allows) from an asyncio loop on a thread of the benchmark's process.
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from proposer_svc.core.stream import ProposeStream, StreamConfig, inline
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc


def oracle_chain(continuation: list[int], done: int, max_nodes: int, max_depth: int) -> tuple[list[int], list[int]]:
    """The next tokens of the known continuation after ``done`` accepted ones, as a chain.

    >>> oracle_chain([5, 6, 7, 8], 1, max_nodes=2, max_depth=12)
    ([6, 7], [-1, 0])
    """
    n = max(min(max_nodes or len(continuation), max_depth or len(continuation)), 0)
    tokens = continuation[done : done + n]
    return tokens, list(range(-1, len(tokens) - 1))


class OracleChain:
    """One stream's state (a ``TreeBuilder``): the continuation, while the accepted tokens follow it."""

    def __init__(self, continuation: list[int], prompt_length: int) -> None:
        self.continuation, self.prompt_length = continuation, prompt_length
        self.context_length = 0

    def extend(self, tokens: list[int]) -> None:
        done = self.context_length - self.prompt_length  # < 0 while the prompt itself is added
        if done >= 0 and self.continuation[done : done + len(tokens)] != tokens:
            self.continuation = []  # the output left the known path: nothing more to offer
        self.context_length += len(tokens)

    def propose(self, max_nodes: int | None, max_depth: int | None) -> tuple[list[int], list[int]]:
        done = self.context_length - self.prompt_length
        return oracle_chain(self.continuation, done, max_nodes or 0, max_depth or 0)


class OracleServicer(ProposeStream):
    """The Propose stream over the continuations the benchmark sets (from any thread)."""

    def __init__(self) -> None:
        super().__init__(StreamConfig(proposer="oracle"), inline(self._chain, None))
        self._continuations: dict[tuple[int, ...], list[int]] = {}
        self._lock = threading.Lock()

    def set_continuation(self, prompt_ids: tuple[int, ...], continuation: list[int]) -> None:
        with self._lock:
            self._continuations[tuple(prompt_ids)] = list(continuation)

    def _chain(self, start: proposer_pb2.ProposeStart) -> OracleChain:
        with self._lock:
            continuation = self._continuations.get(tuple(start.prompt_token_ids), [])
        return OracleChain(continuation, len(start.prompt_token_ids))


class OracleServer:
    """A loopback proposer server in this process; ``address`` (set on entry) is what the verifier dials."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.servicer = OracleServicer()
        self.host, self.address = host, ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="oracle-proposer", daemon=True)
        self._server: grpc.aio.Server | None = None

    def __enter__(self) -> OracleServer:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        self.address = f"{self.host}:{port}"
        return self

    async def _start(self) -> int:
        self._server = grpc.aio.server()
        proposer_pb2_grpc.add_ProposerServiceServicer_to_server(self.servicer, self._server)
        port = self._server.add_insecure_port(f"{self.host}:0")
        await self._server.start()
        return port

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
