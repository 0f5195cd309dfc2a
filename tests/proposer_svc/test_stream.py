"""The Propose-stream framework on a real in-process grpc.aio server with trivial cores: stream
orders and bad values refused with their status, budgets capped, session outcomes counted, and
a pushed core's trees delivered from another thread while Advances keep arriving."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable

import grpc
import pytest
from prometheus_client import CollectorRegistry
from support import served_proposer as served

from proposer_svc.core.stream import (
    OFFLOAD_TOKENS,
    Deliver,
    ProposeStream,
    StreamConfig,
    StreamLimits,
    StreamRefused,
    inline,
)
from specmesh.v1 import proposer_pb2
from specmesh_server.metrics import ProposerMetrics


class LastToken:
    """A TreeBuilder proposing the context's last token once; records the budgets it was given."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.budgets: list[tuple[int | None, int | None]] = []

    @property
    def context_length(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def propose(self, max_nodes: int | None, max_depth: int | None) -> tuple[list[int], list[int]]:
        self.budgets.append((max_nodes, max_depth))
        return [self.tokens[-1]], [-1]


def start(prompt: list[int], nodes: int = 0, depth: int = 0, vocab_size: int = 0) -> proposer_pb2.ProposeRequest:
    return proposer_pb2.ProposeRequest(
        start=proposer_pb2.ProposeStart(
            request_id="r",
            prompt_token_ids=prompt,
            budget=proposer_pb2.TreeBudget(max_nodes=nodes, max_depth=depth),
            vocab=proposer_pb2.VocabIdentity(vocab_size=vocab_size),
        )
    )


def advance(tokens: list[int], nodes: int | None = None) -> proposer_pb2.ProposeRequest:
    msg = proposer_pb2.ProposeAdvance(accepted_token_ids=tokens)
    if nodes is not None:
        msg.budget.max_nodes = nodes
    return proposer_pb2.ProposeRequest(advance=msg)


END = proposer_pb2.ProposeRequest(end=proposer_pb2.ProposeEnd())


def exchange(servicer: ProposeStream, messages: Iterable[proposer_pb2.ProposeRequest]):
    """The responses to ``messages`` (sent, then the stream half-closed), or the RPC's error."""

    async def run():
        async with served(servicer) as stub:
            try:
                return [r async for r in stub.Propose(iter(list(messages)), timeout=10)]
            except grpc.aio.AioRpcError as err:
                return err

    return asyncio.run(run())


def last_token_stream(config: StreamConfig, metrics: ProposerMetrics | None = None):
    builders: list[LastToken] = []

    def factory(start: proposer_pb2.ProposeStart) -> LastToken:
        builders.append(LastToken())
        return builders[-1]

    return ProposeStream(config, inline(factory, metrics), metrics), builders


def test_each_start_and_advance_is_answered_with_a_tree_for_the_new_context():
    servicer, _ = last_token_stream(StreamConfig(proposer="test"))
    replies = exchange(servicer, [start([1, 2, 3]), advance([4, 5]), advance([6]), END, advance([7])])
    assert [(r.context_length, list(r.tree.tokens)) for r in replies] == [(3, [3]), (5, [5]), (6, [6])]


def test_budgets_are_capped_by_the_proposer_and_kept_until_an_advance_replaces_them():
    servicer, builders = last_token_stream(StreamConfig(proposer="test", max_nodes=8, max_depth=4))
    exchange(servicer, [start([1], nodes=0, depth=9), advance([2]), advance([3], nodes=5), advance([4], nodes=99)])
    assert builders[0].budgets == [(8, 4), (8, 4), (5, 4), (8, 4)]  # an unset field is the cap


def test_without_limits_an_unset_budget_is_left_to_the_builder():
    servicer, builders = last_token_stream(StreamConfig(proposer="test"))
    exchange(servicer, [start([1], nodes=3), advance([2])])
    assert builders[0].budgets == [(3, None), (3, None)]


@pytest.mark.parametrize(
    ("messages", "code", "details"),
    [
        ([advance([1])], grpc.StatusCode.FAILED_PRECONDITION, "advance before start"),
        ([start([1]), start([1])], grpc.StatusCode.FAILED_PRECONDITION, "start: stream already started"),
        ([start([])], grpc.StatusCode.INVALID_ARGUMENT, "start.prompt_token_ids: empty"),
        (
            [start([1, 12])],
            grpc.StatusCode.INVALID_ARGUMENT,
            "start.prompt_token_ids: token id 12 outside the test vocabulary [0, 10)",
        ),
        ([start([1]), advance([-1])], grpc.StatusCode.INVALID_ARGUMENT, "advance: token id -1 outside the test"),
        (
            [start([1], vocab_size=11)],
            grpc.StatusCode.FAILED_PRECONDITION,
            "test refused: test vocabulary size 10 != target's 11",
        ),
    ],
    ids=["advance-first", "start-twice", "empty-prompt", "prompt-token", "advance-token", "other-vocabulary"],
)
def test_bad_streams_are_aborted_with_their_status(messages, code, details):
    servicer, _ = last_token_stream(StreamConfig(proposer="test", vocab_size=10))
    err = exchange(servicer, messages)
    assert isinstance(err, grpc.aio.AioRpcError), err
    assert err.code() == code and err.details().startswith(details), (err.code(), err.details())


@pytest.mark.parametrize(
    ("messages", "details"),
    [
        (
            [start([1] * 11)],
            "start.prompt_token_ids: 11 tokens, over the test proposer's limit of 10 (--max-stream-tokens)",
        ),
        (
            [start([1] * 6), advance([2] * 5)],
            "advance: the stream's context would be 11 tokens, over the test proposer's limit of 10",
        ),
        ([start([1], nodes=10**9)], "start.budget.max_nodes: 1000000000, over the test proposer's limit of 64"),
        ([start([1], depth=9)], "start.budget.max_depth: 9, over the test proposer's limit of 8 (--max-budget-depth)"),
        ([start([1]), advance([2], nodes=65)], "advance.budget.max_nodes: 65, over the test proposer's limit of 64"),
    ],
    ids=["prompt", "context", "nodes", "depth", "advance-nodes"],
)
def test_a_stream_over_the_proposers_limits_is_refused_naming_the_limit(messages, details):
    limits = StreamLimits(max_stream_tokens=10, max_budget_nodes=64, max_budget_depth=8)
    servicer, _ = last_token_stream(StreamConfig(proposer="test", limits=limits))
    err = exchange(servicer, messages)
    assert isinstance(err, grpc.aio.AioRpcError), err
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details().startswith(details), err.details()


class SlowOnLong(LastToken):
    """Indexing a long input takes a while (holding the GIL, like the n-gram index would)."""

    def extend(self, tokens: list[int]) -> None:
        if len(tokens) > OFFLOAD_TOKENS:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                pass
        super().extend(tokens)


def test_a_long_prompt_is_indexed_off_the_loop_while_other_streams_get_their_trees():
    servicer = ProposeStream(StreamConfig(proposer="test"), inline(lambda start: SlowOnLong(), None))

    async def run() -> tuple[float, bool]:
        async with served(servicer) as stub:
            t0 = time.monotonic()
            long = stub.Propose(iter([start([1] * (OFFLOAD_TOKENS + 1))]), timeout=10)
            long_reply = asyncio.ensure_future(long.read())
            await asyncio.sleep(0.1)  # the long Start is being indexed (this test shares the server's loop)
            call = stub.Propose(timeout=10)
            for msg in [start([1, 2]), *(advance([i]) for i in range(5))]:
                await call.write(msg)
                await call.read()
            answered_in, still_indexing = time.monotonic() - t0, not long_reply.done()
            await long_reply
            await call.done_writing()
            return answered_in, still_indexing

    answered_in, still_indexing = asyncio.run(run())
    assert still_indexing and answered_in < 0.6, (answered_in, still_indexing)


def test_a_core_refusing_the_start_aborts_with_its_own_status():
    def refuse(start: proposer_pb2.ProposeStart) -> LastToken:
        raise StreamRefused(grpc.StatusCode.NOT_FOUND, "corpus: nope")

    err = exchange(ProposeStream(StreamConfig(proposer="test"), inline(refuse, None)), [start([1])])
    assert err.code() == grpc.StatusCode.NOT_FOUND and err.details() == "corpus: nope"


def test_a_stream_ended_before_its_start_is_fine_and_empty():
    servicer, builders = last_token_stream(StreamConfig(proposer="test"))
    assert exchange(servicer, [END]) == [] and exchange(servicer, []) == [] and builders == []


def test_session_outcomes_and_proposals_are_counted():
    registry = CollectorRegistry()
    metrics = ProposerMetrics("test", registry)
    servicer, _ = last_token_stream(StreamConfig(proposer="test"), metrics)
    exchange(servicer, [start([1]), advance([2])])
    exchange(servicer, [advance([2])])

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"proposer": "test", **labels})

    assert sample("specmesh_proposer_sessions_total", outcome="ok") == 1
    assert sample("specmesh_proposer_sessions_total", outcome="rejected") == 1
    assert sample("specmesh_proposer_open_sessions") == 0
    assert sample("specmesh_proposals_total") == 2


class Pushed:
    """A pushed core: records its events; the test thread delivers trees whenever it likes."""

    def __init__(self, deliver: Deliver) -> None:
        self.deliver = deliver
        self.events: list[tuple[str, list[int]]] = []

    def start(self, prompt: list[int], budget: proposer_pb2.TreeBudget) -> None:
        self.events.append(("start", prompt))

    def advance(self, tokens: list[int], budget: proposer_pb2.TreeBudget) -> None:
        self.events.append(("advance", tokens))

    def close(self) -> None:
        self.events.append(("close", []))


def test_a_pushed_core_gets_advances_while_its_trees_come_from_another_thread():
    cores: list[Pushed] = []

    def open_pushed(start: proposer_pb2.ProposeStart, deliver: Deliver) -> Pushed:
        cores.append(Pushed(deliver))
        return cores[-1]

    servicer = ProposeStream(StreamConfig(proposer="test", pushed=True), open_pushed)

    def from_thread(fn) -> None:
        threading.Thread(target=fn).start()

    async def run() -> list[proposer_pb2.ProposeResponse]:
        async with served(servicer) as stub:
            call = stub.Propose(timeout=10)
            await call.write(start([1, 2]))
            await call.write(advance([3]))
            await call.write(advance([4]))  # no tree was owed an answer yet: the core sees both
            while len(cores) < 1 or len(cores[0].events) < 3:
                await asyncio.sleep(0.01)
            tree = proposer_pb2.TokenTree(tokens=[5], parents=[-1])
            from_thread(lambda: cores[0].deliver(proposer_pb2.ProposeResponse(context_length=4, tree=tree)))
            first = await call.read()
            from_thread(lambda: cores[0].deliver(None))  # the core gives up: the stream ends
            assert await call.read() == grpc.aio.EOF and await call.code() == grpc.StatusCode.OK
            return [first]

    replies = asyncio.run(run())
    assert [(r.context_length, list(r.tree.tokens)) for r in replies] == [(4, [5])]
    assert cores[0].events == [("start", [1, 2]), ("advance", [3]), ("advance", [4]), ("close", [])]


class TakesStates:
    """A ``StateTaker`` core: records the hidden states handed to it before each Advance."""

    def __init__(self, log: list) -> None:
        self.log, self.context = log, 0

    def start(self, prompt, budget):
        self.context = len(prompt)
        return proposer_pb2.ProposeResponse(context_length=self.context)

    def take_states(self, states, tokens):
        from specmesh_server.hidden import decode

        self.log.append(decode(states, tokens, 2).tolist())  # ValueError when the rows do not fit

    def advance(self, tokens, budget):
        self.context += len(tokens)
        return proposer_pb2.ProposeResponse(context_length=self.context)

    def close(self):
        pass


def test_hidden_states_reach_a_state_taking_core_and_ill_fitting_ones_are_refused_as_invalid_argument():
    import torch

    from specmesh_server.hidden import encode

    log: list = []
    servicer = ProposeStream(StreamConfig(proposer="test"), lambda start, deliver: TakesStates(log))
    with_states = advance([4, 5])
    with_states.advance.hidden_states.CopyFrom(encode(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 0))
    replies = exchange(servicer, [start([1, 2, 3]), with_states, advance([6])])
    assert [r.context_length for r in replies] == [3, 5, 6]
    assert log == [[[1.0, 2.0], [3.0, 4.0]]]  # an Advance without states hands none over
    one_row_for_two_tokens = advance([4, 5])
    one_row_for_two_tokens.advance.hidden_states.CopyFrom(encode(torch.ones(1, 2), 0))
    err = exchange(servicer, [start([1, 2, 3]), one_row_for_two_tokens])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "hidden_states.data" in err.details()
