"""What the engine reports: events streamed to a request's sink, admission errors, counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from verifier_svc.logprobs import TokenLogprob


@dataclass
class ProposerCounts:
    steps: int = 0  # verification steps that carried this proposer's tree
    drafted: int = 0
    accepted: int = 0


@dataclass
class SpecCounters:
    """Speculation counters of one request (live on the sequence, final in FinishEvent)."""

    proposer: str = "none"
    steps: int = 0  # verification steps that carried a tree
    drafted: int = 0
    accepted: int = 0
    wait_s: float = 0.0  # waiting for proposals
    invalid_trees: int = 0
    fallback_reason: str = ""
    accepted_hist: list[int] = field(default_factory=list)  # [k] = steps that accepted k draft tokens
    per_proposer: dict[str, ProposerCounts] = field(default_factory=dict)

    def count_step(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        c = self.per_proposer.setdefault(self.proposer, ProposerCounts())
        c.steps, c.drafted, c.accepted = c.steps + 1, c.drafted + drafted, c.accepted + accepted
        if len(self.accepted_hist) <= accepted:
            self.accepted_hist.extend([0] * (accepted + 1 - len(self.accepted_hist)))
        self.accepted_hist[accepted] += 1


class EngineFull(Exception):
    """More concurrent requests than the engine admits."""


class NeverFits(Exception):
    """A request whose KV cache could not fit in the memory budget even running alone."""


class EngineStopped(Exception):
    """The engine is draining or stopped and takes no new requests."""


@dataclass
class TokenEvent:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token, for requests that asked
    # The first event's, for requests that asked for prompt logprobs: prompt_logprobs[i] is prompt token i + 1's.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class FinishEvent:
    finish_reason: str  # "length" | "eos" | "stop"
    prompt_tokens: int
    completion_tokens: int
    steps: int
    verify_ms: float
    queue_ms: float
    ttft_ms: float
    total_ms: float
    stop_string: str = ""
    speculation: SpecCounters = field(default_factory=SpecCounters)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    grammar_pruned_nodes: int = 0  # draft nodes the request's grammar forbade (cut before the forward)


@dataclass
class ErrorEvent:
    message: str
    code: str = "INTERNAL"  # the gRPC status the request ends with (UNAVAILABLE: retry on another verifier)


Event = TokenEvent | FinishEvent | ErrorEvent


@dataclass
class EngineStats:
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0
    preempted: int = 0  # times a running request went back to wait for KV memory
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
