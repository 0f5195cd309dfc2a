"""The verifier's GenerationService: one request from its gRPC stream to the engine and back."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import Message

from specmesh.v1 import generation_pb2, generation_pb2_grpc, params_pb2
from specmesh_server import loop_posts
from verifier_svc.events import EngineFull, EngineStopped, ErrorEvent, Event, FinishEvent, NeverFits
from verifier_svc.grammar import CompilePool, GrammarCompiler, RequestGrammar
from verifier_svc.logprobs import TokenLogprob
from verifier_svc.requests import (
    GenerationRequest,
    InvalidRequest,
    ProposerNotConfigured,
    RequestLimits,
    build_request,
)
from verifier_svc.speculation import ProposerRefused, SpeculationControl
from verifier_svc.tokenization import detokenize, tokenize

if TYPE_CHECKING:
    from specmesh_server.metrics import VerifierMetrics
    from verifier_svc.engine import Engine

_FINISH = {
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "eos": generation_pb2.FINISH_REASON_EOS,
    "stop": generation_pb2.FINISH_REASON_STOP,
}


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """Generate: tokenize, ask the speculation control for the request's speculation, submit it to
    the engine and stream its events back."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: object,
        limits: RequestLimits,
        speculation: SpeculationControl,
        metrics: VerifierMetrics | None = None,
        grammar_threads: int = 8,
        grammar_timeout_s: float = 10.0,
    ) -> None:
        self.engine, self.tokenizer, self.limits = engine, tokenizer, limits
        self.speculation, self.metrics = speculation, metrics
        # One thread: requests tokenize in arrival order, and the fast tokenizer's settings are never
        # touched from two threads at once (its Rust object refuses concurrent mutable borrows).
        self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specmesh-tokenize")
        # A token's text on its own, for logprobs; cached (bounded by the vocabulary) since it repeats.
        self.token_text = functools.lru_cache(maxsize=65536)(
            lambda token_id: tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        )
        # Structured outputs: compiled on threads of their own (``CompilePool``), the compiler made on
        # the tokenizer's thread at the first one.
        self.grammar_threads, self.grammar_timeout_s = grammar_threads, grammar_timeout_s
        self._grammars: GrammarCompiler | None = None
        self._compile_pool: CompilePool | None = None

    def _prepare(self, request: generation_pb2.GenerateRequest) -> GenerationRequest:
        """The validated request (on the tokenizer's thread); the grammar compiler made if it needs one."""
        req = build_request(request, self.tokenizer, self.limits)
        if req.structured_output is not None and self._grammars is None:
            eos = self.engine.eos_token_ids
            self._grammars = GrammarCompiler(self.tokenizer, self.limits.vocab_size, eos, metrics=self.metrics)
            self._compile_pool = CompilePool(self._grammars, self.grammar_threads, self.grammar_timeout_s)
        return req

    async def _grammar(self, req: GenerationRequest) -> RequestGrammar | None:
        """The request's grammar state, compiled (or from the cache); None for free text."""
        if req.structured_output is None:
            return None
        assert self._grammars is not None and self._compile_pool is not None
        return self._grammars.request(await self._compile_pool.compile(req.structured_output))

    def _logprobs_pb(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> list[generation_pb2.TokenLogprob]:
        text = self.token_text
        return [
            generation_pb2.TokenLogprob(
                logprob=lp.logprob,
                token=text(tok),
                rank=lp.rank,
                top_logprobs=[
                    generation_pb2.TopLogprob(token_id=i, logprob=v, token=text(i))
                    for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
                ],
            )
            for tok, lp in zip(token_ids, logprobs, strict=True)
        ]

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:  # tokenizing (and chat templates) off the event loop: other streams keep flowing
            req = await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, self._prepare, request)
            grammar = await self._grammar(req)
        except InvalidRequest as exc:
            if self.metrics is not None:
                self.metrics.request_finished("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except ProposerNotConfigured as exc:
            if self.metrics is not None:
                self.metrics.request_finished("invalid")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        running, _ = self.engine.counts()
        try:
            speculation = await self.speculation.start(req, running + 1)
        except ProposerRefused as exc:
            if self.metrics is not None:
                self.metrics.request_finished("invalid")
            await context.abort(exc.code, str(exc))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        try:
            key = self.engine.submit(req, lambda ev: loop_posts.post(loop, events.put_nowait, ev), speculation, grammar)
        except (EngineFull, NeverFits, EngineStopped) as exc:
            self.speculation.abandon(speculation)
            if self.metrics is not None:
                self.metrics.request_finished("rejected")
            if isinstance(exc, EngineFull):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many concurrent requests: {exc}")
            if isinstance(exc, NeverFits):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finished, first = False, True
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, ErrorEvent):
                    finished = True
                    if self.metrics is not None:
                        self.metrics.request_finished("error")
                    await context.abort(getattr(grpc.StatusCode, ev.code), ev.message)
                if isinstance(ev, FinishEvent):
                    finished = True
                    yield generation_pb2.GenerateResponse(request_id=req.request_id, summary=_summary(ev))
                    return
                chunk = generation_pb2.TokenChunk(token_ids=ev.token_ids, text=ev.text)
                if first:  # usage while the stream runs (the gateway's continuous_usage_stats)
                    chunk.prompt_tokens, first = len(req.prompt_ids), False
                if ev.logprobs is not None:
                    chunk.logprobs.extend(self._logprobs_pb(ev.token_ids, ev.logprobs))
                if ev.prompt_logprobs is not None:
                    ids = req.prompt_ids
                    chunk.prompt.token_ids.extend(ids)
                    chunk.prompt.logprobs.extend(self._logprobs_pb(ids[1:], ev.prompt_logprobs))
                yield generation_pb2.GenerateResponse(request_id=req.request_id, chunk=chunk)
        finally:
            if not finished:  # client cancelled, disconnected or out of time: free the slot now
                self.engine.cancel(key)
                if self.metrics is not None:
                    self.metrics.request_finished(_unfinished_status(context))

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.TokenizeResponse:
        """Text or a chat to token ids, as Generate would tokenize it (``verifier_svc.tokenization``)."""
        return await self._on_tokenizer(tokenize, request, context)

    async def Detokenize(
        self, request: generation_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.DetokenizeResponse:
        """Token ids to text; an id outside the vocabulary is INVALID_ARGUMENT naming ``tokens``."""
        return await self._on_tokenizer(detokenize, request, context)

    async def _on_tokenizer(
        self, fn: Callable[..., Message], request: Message, context: grpc.aio.ServicerContext
    ) -> Message:
        """``fn(request, tokenizer, limits)`` on the tokenizer's one thread (Generate's queue, in order)."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.tokenize_pool, fn, request, self.tokenizer, self.limits
            )
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _unfinished_status(context: grpc.aio.ServicerContext) -> str:
    """Why a stream ended before its last event: the client's deadline passed (gRPC cancels the
    call then; a little slack for the clocks), or the client cancelled or went away."""
    left = context.time_remaining()
    return "deadline_exceeded" if left is not None and left < 0.05 else "cancelled"


def _summary(ev: FinishEvent) -> generation_pb2.GenerationSummary:
    emitted_after_prefill = max(ev.completion_tokens - 1, 0)
    spec = ev.speculation
    per_proposer = {
        name: params_pb2.ProposerMetrics(steps=c.steps, drafted_tokens=c.drafted, accepted_tokens=c.accepted)
        for name, c in spec.per_proposer.items()
    }
    return generation_pb2.GenerationSummary(
        finish_reason=_FINISH[ev.finish_reason],
        usage=generation_pb2.Usage(
            prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens, cached_tokens=ev.cached_tokens
        ),
        speculation=params_pb2.SpeculationMetrics(
            steps=ev.steps,
            drafted_tokens=spec.drafted,
            accepted_tokens=spec.accepted,
            # tokens emitted per verification step (accepted + bonus)
            mean_accepted_length=emitted_after_prefill / ev.steps if ev.steps else 0.0,
            per_proposer=per_proposer,
            proposer_wait_ms=spec.wait_s * 1e3,
            verify_ms=ev.verify_ms,
            fallback_reason=spec.fallback_reason,
            invalid_trees=spec.invalid_trees,
            accepted_length_counts=spec.accepted_hist,
            grammar_pruned_nodes=ev.grammar_pruned_nodes,
        ),
        timing=generation_pb2.Timing(queue_ms=ev.queue_ms, time_to_first_token_ms=ev.ttft_ms, total_ms=ev.total_ms),
        stop_string=ev.stop_string,
    )
