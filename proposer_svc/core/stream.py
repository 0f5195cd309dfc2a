"""The ``ProposerService.Propose`` stream, written once for every proposer (n-gram, rag, draft, the
bench's oracle): what a stream may send and in which order, the budget limits, the vocabulary
check, session metrics and every abort message live here; a proposer supplies only its
``ProposalCore``, one per stream.

A core answers on the event loop (``advance`` returns the tree: n-gram, rag, oracle, through
``inline``) or later from another thread (``StreamConfig.pushed``: ``advance`` only queues the
tokens and the tree arrives through ``deliver``; the draft model's batching loop). Pushed
streams read the client on a task of their own, so a new Advance reaches the core while an
older tree is still being drafted: the core may skip trees for contexts already left behind.

Callers are not trusted: ``StreamLimits`` bound the context and the budgets one stream may ask
for, and a long Start/Advance of an inline core is worked on in a thread, so one stream's
indexing never holds the event loop (every other stream) for its whole length.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import grpc

from specmesh.v1 import proposer_pb2, proposer_pb2_grpc
from specmesh_server.metrics import ProposerMetrics

# Hands a tree to the stream from any thread; None ends the stream (the core gave up on it).
Deliver = Callable[[proposer_pb2.ProposeResponse | None], None]


class StreamRefused(Exception):
    """A stream refused with a status: raised by the framework's checks or by a core (e.g. an
    unknown corpus); the stream is aborted with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class ProposalCore(Protocol):
    """One stream's proposer state. ``start`` and ``advance`` return the tree for the new context,
    or None when it comes later through ``deliver`` (pushed streams)."""

    def start(self, prompt: list[int], budget: proposer_pb2.TreeBudget) -> proposer_pb2.ProposeResponse | None: ...

    def advance(self, tokens: list[int], budget: proposer_pb2.TreeBudget) -> proposer_pb2.ProposeResponse | None: ...

    def close(self) -> None: ...


@runtime_checkable
class StateTaker(Protocol):
    """A core that drafts from the target's hidden states (it asked for them in a response): the
    stream hands it each Advance's ``HiddenStates`` before the Advance itself. ValueError = the
    states do not fit (wrong size or dtype): the stream is refused with INVALID_ARGUMENT."""

    def take_states(self, states: proposer_pb2.HiddenStates, tokens: int) -> None: ...


# Opens a stream's core from its validated Start message (or raises StreamRefused).
Opener = Callable[[proposer_pb2.ProposeStart, Deliver], ProposalCore]


class TreeBuilder(Protocol):
    """A synchronous proposer's per-request state (``NgramIndex``, ``RagRequest``, the oracle's chain)."""

    @property
    def context_length(self) -> int: ...

    def extend(self, tokens: list[int]) -> None: ...

    def propose(self, max_nodes: int | None, max_depth: int | None) -> tuple[list[int], list[int]]: ...


class InlineCore:
    """A ``ProposalCore`` over a ``TreeBuilder``: each tree built at once, on the event loop."""

    __slots__ = ("builder", "metrics")

    def __init__(self, builder: TreeBuilder, metrics: ProposerMetrics | None) -> None:
        self.builder, self.metrics = builder, metrics

    def start(self, prompt: list[int], budget: proposer_pb2.TreeBudget) -> proposer_pb2.ProposeResponse:
        return self.advance(prompt, budget)

    def advance(self, tokens: list[int], budget: proposer_pb2.TreeBudget) -> proposer_pb2.ProposeResponse:
        b = self.builder
        b.extend(tokens)
        t0 = time.perf_counter()
        nodes, parents = b.propose(budget.max_nodes or None, budget.max_depth or None)  # 0: the builder's default
        if self.metrics is not None:
            self.metrics.proposal(len(nodes), time.perf_counter() - t0)
        return proposer_pb2.ProposeResponse(
            context_length=b.context_length, tree=proposer_pb2.TokenTree(tokens=nodes, parents=parents)
        )

    def close(self) -> None:
        pass


def inline(factory: Callable[[proposer_pb2.ProposeStart], TreeBuilder], metrics: ProposerMetrics | None) -> Opener:
    """An ``Opener`` for a synchronous proposer: ``factory`` builds the state (prompt not yet added)."""
    return lambda start, deliver: InlineCore(factory(start), metrics)


@dataclass(frozen=True)
class StreamLimits:
    """What one stream may ask of this proposer, whoever calls; beyond, the stream is refused with
    RESOURCE_EXHAUSTED naming the limit (a verifier then decodes without this proposer). 0 = none."""

    max_stream_tokens: int = 0  # context tokens of a stream: prompt + every accepted token
    max_budget_nodes: int = 0  # a TreeBudget's max_nodes
    max_budget_depth: int = 0  # a TreeBudget's max_depth


# Above the verifier's own bounds (``router.policy.PolicyLimits``: 128 nodes, depth 64).
SERVING_LIMITS = StreamLimits(max_stream_tokens=131_072, max_budget_nodes=1024, max_budget_depth=256)
# Start/Advance token counts worked on in a thread (inline cores): ~1 ms of indexing on the loop at most.
OFFLOAD_TOKENS = 2048


@dataclass(frozen=True)
class StreamConfig:
    proposer: str  # names the proposer in refusals
    limits: StreamLimits = StreamLimits()
    max_nodes: int = 0  # caps every budget (an unset one becomes the cap); 0 = budgets as sent
    max_depth: int = 0
    vocab_size: int = 0  # > 0: targets with another vocabulary are refused, token ids checked against it
    tokenizer_hash: str = ""
    pushed: bool = False  # trees come through ``deliver`` from another thread, not from ``advance``


# The abort messages of every proposer.
START_TWICE = "start: stream already started"
EMPTY_PROMPT = "start.prompt_token_ids: empty"
ADVANCE_FIRST = "advance before start"


def over_limit(what: str, proposer: str, limit: int, flag: str) -> StreamRefused:
    """The refusal of a stream over one of its ``StreamLimits``.

    >>> over_limit("start.budget.max_nodes: 2000", "ngram", 1024, "--max-budget-nodes").message
    "start.budget.max_nodes: 2000, over the ngram proposer's limit of 1024 (--max-budget-nodes)"
    """
    return StreamRefused(
        grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}, over the {proposer} proposer's limit of {limit} ({flag})"
    )


def vocab_mismatch(proposer: str, vocab_size: int, tokenizer_hash: str, target: proposer_pb2.VocabIdentity) -> str:
    """Why this proposer cannot propose for that target ('' when it can); an empty target field is not checked.

    >>> vocab_mismatch("draft", 10, "ab", proposer_pb2.VocabIdentity(vocab_size=10, tokenizer_hash="ab"))
    ''
    >>> vocab_mismatch("draft", 10, "ab", proposer_pb2.VocabIdentity(vocab_size=12, tokenizer_hash="cd"))
    "draft vocabulary size 10 != target's 12; draft tokenizer hash 'ab' != target's 'cd'"
    """
    problems = []
    if target.vocab_size and vocab_size != target.vocab_size:
        problems.append(f"{proposer} vocabulary size {vocab_size} != target's {target.vocab_size}")
    if target.tokenizer_hash and tokenizer_hash != target.tokenizer_hash:
        problems.append(f"{proposer} tokenizer hash {tokenizer_hash!r} != target's {target.tokenizer_hash!r}")
    return "; ".join(problems)


def _clamp(value: int, cap: int) -> int:
    return min(value or cap, cap) if cap else value


def _unpushed(resp: proposer_pb2.ProposeResponse | None) -> None:
    raise RuntimeError("this stream is not pushed (StreamConfig.pushed): return the tree from advance")


def _onto_loop(outbox: asyncio.Queue) -> Deliver:
    """A pushed stream's ``deliver``: from any thread into ``outbox``, on this event loop."""
    loop = asyncio.get_running_loop()
    return lambda resp: loop.call_soon_threadsafe(outbox.put_nowait, resp)


def _advance_of(msg: proposer_pb2.ProposeRequest) -> proposer_pb2.ProposeAdvance | None:
    """A later message's Advance; None at the stream's end; a second Start is refused."""
    kind = msg.WhichOneof("event")
    if kind == "advance":
        return msg.advance
    if kind == "start":
        raise StreamRefused(grpc.StatusCode.FAILED_PRECONDITION, START_TWICE)
    return None


async def _arrivals(
    requests: AsyncIterator[proposer_pb2.ProposeRequest], outbox: asyncio.Queue
) -> AsyncIterator[proposer_pb2.ProposeRequest | proposer_pb2.ProposeResponse]:
    """A pushed stream's client messages and delivered trees, in arrival order: the client is read
    on a task of its own, so an Advance reaches the core while a tree is still on its way."""

    async def read() -> None:
        try:
            async for msg in requests:
                outbox.put_nowait(msg)
        except (asyncio.CancelledError, grpc.RpcError):
            pass
        outbox.put_nowait(None)

    reader = asyncio.ensure_future(read())
    try:
        while (item := await outbox.get()) is not None:  # None: the client is done, or the core gave up
            yield item
    finally:
        reader.cancel()


@dataclass
class _Stream:
    core: ProposalCore
    budget: proposer_pb2.TreeBudget
    context: int  # tokens sent so far: prompt + accepted


class ProposeStream(proposer_pb2_grpc.ProposerServiceServicer):
    """The ``ProposerService`` servicer: one ``ProposalCore`` per stream, opened by ``open``."""

    def __init__(self, config: StreamConfig, open: Opener, metrics: ProposerMetrics | None = None) -> None:
        self.config, self.open, self.metrics = config, open, metrics

    async def Propose(
        self, request_iterator: AsyncIterator[proposer_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[proposer_pb2.ProposeResponse]:
        if self.metrics is not None:
            self.metrics.session_started()
        outcome = "error"
        try:
            async with aclosing(self._stream(request_iterator)) as responses:
                async for resp in responses:
                    yield resp
            outcome = "ok"
        except StreamRefused as exc:
            outcome = "rejected"
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if self.metrics is not None:
                self.metrics.session_ended(outcome)

    async def Learn(
        self, request: proposer_pb2.LearnRequest, context: grpc.aio.ServicerContext
    ) -> proposer_pb2.LearnResponse:
        """Proposers that learn from past outputs (suffix) override this; the others say so, and the
        verifier stops sending them outputs. (The generated base is synchronous: an asyncio server
        would never answer it.)"""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.config.proposer} does not learn from outputs")

    async def _stream(
        self, requests: AsyncIterator[proposer_pb2.ProposeRequest]
    ) -> AsyncIterator[proposer_pb2.ProposeResponse]:
        it = requests.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        kind = first.WhichOneof("event")
        if kind == "advance":
            raise StreamRefused(grpc.StatusCode.FAILED_PRECONDITION, ADVANCE_FIRST)
        if kind != "start":  # End (or nothing) before Start: nothing was opened
            return
        start = first.start
        prompt = self._checked_start(start)
        outbox: asyncio.Queue | None = asyncio.Queue() if self.config.pushed else None
        deliver = _unpushed if outbox is None else _onto_loop(outbox)
        budget = self._budget("start.budget", start.budget)  # refused before a core is opened
        s = _Stream(self.open(start, deliver), budget, len(prompt))
        arrivals = None if outbox is None else _arrivals(it, outbox)
        try:
            resp = await self._work(s.core.start, prompt, s.budget)
            if resp is not None:
                yield resp
            async for item in arrivals or it:
                if isinstance(item, proposer_pb2.ProposeResponse):  # delivered (pushed streams)
                    yield item
                    continue
                advance = _advance_of(item)
                if advance is None:
                    return
                resp = await self._advance(s, advance)
                if resp is not None:
                    yield resp
        finally:
            s.core.close()
            if arrivals is not None:
                await arrivals.aclose()

    def _checked_start(self, start: proposer_pb2.ProposeStart) -> list[int]:
        cfg = self.config
        problem = cfg.vocab_size and vocab_mismatch(cfg.proposer, cfg.vocab_size, cfg.tokenizer_hash, start.vocab)
        if problem:
            raise StreamRefused(grpc.StatusCode.FAILED_PRECONDITION, f"{cfg.proposer} refused: {problem}")
        prompt = list(start.prompt_token_ids)
        if not prompt:
            raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, EMPTY_PROMPT)
        self._check_context(f"start.prompt_token_ids: {len(prompt)} tokens", len(prompt))
        self._check_tokens("start.prompt_token_ids", prompt)
        return prompt

    async def _advance(self, s: _Stream, advance: proposer_pb2.ProposeAdvance) -> proposer_pb2.ProposeResponse | None:
        tokens = list(advance.accepted_token_ids)
        s.context += len(tokens)
        self._check_context(f"advance: the stream's context would be {s.context} tokens", s.context)
        self._check_tokens("advance", tokens)
        if advance.HasField("budget"):
            s.budget = self._budget("advance.budget", advance.budget)
        if advance.HasField("hidden_states") and isinstance(s.core, StateTaker):
            try:
                s.core.take_states(advance.hidden_states, len(tokens))
            except ValueError as exc:
                raise StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, f"advance.{exc}") from None
        return await self._work(s.core.advance, tokens, s.budget)

    async def _work(
        self,
        step: Callable[[list[int], proposer_pb2.TreeBudget], proposer_pb2.ProposeResponse | None],
        tokens: list[int],
        budget: proposer_pb2.TreeBudget,
    ) -> proposer_pb2.ProposeResponse | None:
        """A core's ``start``/``advance``; a long one of an inline core in a thread, the loop serving
        the other streams meanwhile (a pushed core only queues the tokens)."""
        if self.config.pushed or len(tokens) <= OFFLOAD_TOKENS:
            return step(tokens, budget)
        return await asyncio.to_thread(step, tokens, budget)

    def _check_context(self, what: str, tokens: int) -> None:
        cfg = self.config
        if cfg.limits.max_stream_tokens and tokens > cfg.limits.max_stream_tokens:
            raise over_limit(what, cfg.proposer, cfg.limits.max_stream_tokens, "--max-stream-tokens")

    def _check_tokens(self, where: str, tokens: list[int]) -> None:
        n = self.config.vocab_size
        if n and tokens and (min(tokens) < 0 or max(tokens) >= n):  # C-speed scan; the id only when bad
            bad = next(t for t in tokens if not 0 <= t < n)
            raise StreamRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{where}: token id {bad} outside the {self.config.proposer} vocabulary [0, {n})",
            )

    def _budget(self, where: str, budget: proposer_pb2.TreeBudget) -> proposer_pb2.TreeBudget:
        cfg, limits = self.config, self.config.limits
        if limits.max_budget_nodes and budget.max_nodes > limits.max_budget_nodes:
            what = f"{where}.max_nodes: {budget.max_nodes}"
            raise over_limit(what, cfg.proposer, limits.max_budget_nodes, "--max-budget-nodes")
        if limits.max_budget_depth and budget.max_depth > limits.max_budget_depth:
            what = f"{where}.max_depth: {budget.max_depth}"
            raise over_limit(what, cfg.proposer, limits.max_budget_depth, "--max-budget-depth")
        if not (cfg.max_nodes or cfg.max_depth):
            return budget
        return proposer_pb2.TreeBudget(
            max_nodes=_clamp(budget.max_nodes, cfg.max_nodes), max_depth=_clamp(budget.max_depth, cfg.max_depth)
        )
