"""A request inside the engine, and how its new tokens become stream events."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specmesh_server.kv_blocks import BlockTable
from verifier_svc.detokenizer import Detokenizer, StopStringFilter
from verifier_svc.events import Event, FinishEvent, TokenEvent
from verifier_svc.logprobs import TokenLogprob
from verifier_svc.request_speculation import RequestSpeculation
from verifier_svc.requests import GenerationRequest

if TYPE_CHECKING:
    from verifier_svc.grammar import RequestGrammar


@dataclass
class Sequence:
    """One request in the engine: its place in the batch, KV blocks, cached length, output and streaming state."""

    key: int  # unique in the engine (the client's request_id is a label only)
    req: GenerationRequest
    sink: Callable[[Event], None]
    detok: Detokenizer
    stopper: StopStringFilter
    arrival: float
    slot: int = -1  # its index in the running batch; -1 while it waits
    blocks: BlockTable | None = None  # its KV blocks while it runs (``engine``)
    length: int = 0  # tokens whose KV is cached
    cached_tokens: int = 0  # prompt tokens a prefix-cache hit brought when it first joined
    output: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1… scored so far (if asked)
    done: bool = False
    steps: int = 0
    verify_s: float = 0.0
    prefill_start: float = 0.0
    first_token: float = 0.0
    last_chunk: float | None = None  # perf_counter of its last streamed tokens (the inter-token metric)
    speculation: RequestSpeculation = field(default_factory=RequestSpeculation)  # owned by SpeculationControl
    grammar: RequestGrammar | None = None  # structured output: the matcher has accepted the whole output

    @property
    def context_length(self) -> int:
        return len(self.req.prompt_ids) + len(self.output)

    @property
    def cache_target(self) -> int:
        """Tokens whose KV must be cached before the request decodes: its prompt, and after a
        preemption also its output but the pending token."""
        return len(self.req.prompt_ids) + max(len(self.output) - 1, 0)

    def uncached(self, n: int) -> list[int]:
        """The next ``n`` tokens to prefill: from the prompt, then the output a preemption dropped."""
        p, end = len(self.req.prompt_ids), min(self.length + n, self.cache_target)
        return self.req.prompt_ids[self.length : min(end, p)] + self.output[max(self.length - p, 0) : max(end - p, 0)]

    @property
    def pending(self) -> int:
        """The newest token, not yet in the KV cache (fed at the next decode step)."""
        return self.output[-1]

    @property
    def prefilled(self) -> bool:
        return bool(self.output) and self.length >= self.cache_target

    def push(
        self, tokens: list[int], logprobs: list[TokenLogprob] | None, eos_ids: set[int], max_context: int
    ) -> tuple[TokenEvent, str]:
        """Append tokens up to the first limit (EOS or a stop token id, ``max_tokens``, the context)
        and detokenize them through the stop-string filter: the event to stream, and why the
        request finished ("eos" | "length" | "stop"; "" while it goes on). Stop strings end nothing
        before ``min_tokens`` tokens (vLLM: they are looked for once the output is longer). The first
        event carries the prompt's logprobs, where asked."""
        req, reason, emitted = self.req, "", []
        first = not self.output
        for tok in tokens:
            self.output.append(tok)
            emitted.append(tok)
            if (tok in eos_ids and not req.ignore_eos) or tok in req.stop_token_ids:
                reason = "eos"
            elif len(self.output) >= req.max_tokens or len(req.prompt_ids) + len(self.output) >= max_context:
                reason = "length"
            if reason:
                break
        if self.grammar is not None:
            self.grammar.advance(emitted)
        # The tokens that leave the output at most min_tokens long are not searched for stop strings.
        quiet = max(min(req.min_tokens - (len(self.output) - len(emitted)), len(emitted)), 0)
        text = self.stopper.push(self.detok.push(emitted[:quiet]), armed=False) if quiet else ""
        text += self.stopper.push(self.detok.push(emitted[quiet:]))
        if self.stopper.matched is not None:
            reason = "stop"
        if reason:
            text += self.stopper.push(self.detok.flush()) + self.stopper.flush()
        lps = logprobs[: len(emitted)] if logprobs is not None else None
        return TokenEvent(emitted, text, lps, self._scored_prompt() if first else None), reason

    def prefill_only(self) -> TokenEvent:
        """The one event of a request with ``max_tokens`` 0: no tokens, its prompt's logprobs where asked."""
        return TokenEvent([], "", prompt_logprobs=self._scored_prompt())

    def _scored_prompt(self) -> list[TokenLogprob] | None:
        """The prompt's logprobs for the request's first event (None where it did not ask)."""
        return self.prompt_logprobs if self.req.prompt_logprobs is not None else None

    def finish_event(self, reason: str, now: float) -> FinishEvent:
        return FinishEvent(
            finish_reason=reason,
            prompt_tokens=len(self.req.prompt_ids),
            completion_tokens=len(self.output),
            steps=self.steps,
            verify_ms=self.verify_s * 1e3,
            queue_ms=(self.prefill_start - self.arrival) * 1e3,
            ttft_ms=(self.first_token - self.arrival) * 1e3,
            total_ms=(now - self.arrival) * 1e3,
            stop_string=self.stopper.matched or "",
            speculation=self.speculation.counters,
            cached_tokens=self.cached_tokens,
            grammar_pruned_nodes=self.grammar.pruned if self.grammar is not None else 0,
        )
