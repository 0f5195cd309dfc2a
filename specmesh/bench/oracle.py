"""The oracle proposer: proposes the target's own greedy continuation, known in advance.

It bounds what any proposer can gain on this verifier and hardware: every drafted token is
accepted, so its speed-up is the verifier's cost ceiling. The benchmark fills in each prompt's
continuation from the same run's plain greedy output, then serves it over the ordinary
``ProposerService.Propose`` stream (a chain of as many tokens as the budget allows).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from specmesh.v1 import proposer_pb2, proposer_pb2_grpc


def oracle_chain(continuation: list[int], done: int, max_nodes: int, max_depth: int) -> tuple[list[int], list[int]]:
    """The next tokens of the known continuation after ``done`` accepted ones, as a chain.

    >>> oracle_chain([5, 6, 7, 8], 1, max_nodes=2, max_depth=12)
    ([6, 7], [-1, 0])
    """
    n = max(min(max_nodes or len(continuation), max_depth or len(continuation)), 0)
    tokens = continuation[done : done + n]
    return tokens, list(range(-1, len(tokens) - 1))


class OracleServicer(proposer_pb2_grpc.ProposerServiceServicer):
    def __init__(self) -> None:
        self._continuations: dict[tuple[int, ...], list[int]] = {}
        self._lock = threading.Lock()

    def set_continuation(self, prompt_ids: tuple[int, ...], continuation: list[int]) -> None:
        with self._lock:
            self._continuations[tuple(prompt_ids)] = list(continuation)

    def Propose(
        self, request_iterator: Iterator[proposer_pb2.ProposeRequest], context: grpc.ServicerContext
    ) -> Iterator[proposer_pb2.ProposeResponse]:
        continuation: list[int] = []
        prompt_len, done = 0, 0
        budget = proposer_pb2.TreeBudget()
        for msg in request_iterator:
            kind = msg.WhichOneof("event")
            if kind == "start":
                with self._lock:
                    continuation = self._continuations.get(tuple(msg.start.prompt_token_ids), [])
                prompt_len, budget = len(msg.start.prompt_token_ids), msg.start.budget
            elif kind == "advance":
                accepted = list(msg.advance.accepted_token_ids)
                if continuation[done : done + len(accepted)] != accepted:
                    continuation = []  # the output left the known path: nothing more to offer
                done += len(accepted)
                if msg.advance.HasField("budget"):
                    budget = msg.advance.budget
            else:
                return
            tokens, parents = oracle_chain(continuation, done, budget.max_nodes, budget.max_depth)
            yield proposer_pb2.ProposeResponse(
                context_length=prompt_len + done, tree=proposer_pb2.TokenTree(tokens=tokens, parents=parents)
            )


class OracleServer:
    """A loopback proposer server in this process; ``address`` is what the verifier dials."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.servicer = OracleServicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=128))
        proposer_pb2_grpc.add_ProposerServiceServicer_to_server(self.servicer, self._server)
        port = self._server.add_insecure_port(f"{host}:0")
        self.address = f"{host}:{port}"

    def __enter__(self) -> OracleServer:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)
