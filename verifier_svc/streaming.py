"""What leaves the engine for a request as it runs: its accepted tokens, to its client (one event per
step that emitted) and to its proposer, and its end (finished, or failed).

A request finishes at its first limit (``Sequence.push``: EOS or a stop token, a stop string,
``max_tokens``, the context): its proposer stream ends and learns its output
(``SpeculationControl.finish``), and its client gets the finish event with its counters. The engine
retires a finished request from the batch afterwards.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from verifier_svc.events import EngineStats, ErrorEvent

if TYPE_CHECKING:
    from specmesh.v1 import proposer_pb2
    from verifier_svc.engine_observer import EngineObserver
    from verifier_svc.logprobs import TokenLogprob
    from verifier_svc.sequence import Sequence
    from verifier_svc.speculation import SpeculationControl


class Streams:
    """The engine's requests' streams: ``eos_token_ids`` and ``max_context`` end them; ``stats`` and
    ``observer`` count what they carry; ``speculation`` is told each request's new tokens and end."""

    def __init__(
        self,
        eos_token_ids: set[int],
        max_context: int,
        stats: EngineStats,
        observer: EngineObserver,
        speculation: SpeculationControl,
    ) -> None:
        self.eos_token_ids, self.max_context = eos_token_ids, max_context
        self.stats, self.observer, self.speculation = stats, observer, speculation

    def append(
        self,
        seq: Sequence,
        tokens: list[int],
        logprobs: list[TokenLogprob] | None,
        hidden: proposer_pb2.HiddenStates | None,
        first: bool = False,
    ) -> None:
        """Add a step's emitted tokens up to the request's first limit, stream them, finish the request
        at that limit, and send the added ones (with their ``hidden`` states) to its proposer
        (``first``: the request's first token, after its prompt)."""
        before = len(seq.output)
        event, reason = seq.push(tokens, logprobs, self.eos_token_ids, self.max_context)
        self.stats.generated_tokens += len(event.token_ids)
        self.observer.streamed(seq, len(event.token_ids))
        seq.sink(event)
        # the proposer's context gets the step's tokens before its stream ends: a proposer that learns
        # from the stream (suffix) learns the whole output, the final step's tokens included
        self.speculation.emitted(seq, seq.output[before:], hidden, first)
        if reason:
            self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: str) -> None:
        """The request ended at a limit (``reason``: "eos" | "length" | "stop")."""
        now = time.perf_counter()
        self.speculation.finish(seq)  # the request is done: End the stream now, its proposers learn it
        self.observer.finished(seq, now)
        seq.sink(seq.finish_event(reason, now))
        seq.done = True
        self.stats.finished += 1

    @staticmethod
    def fail(seq: Sequence, message: str, code: str = "INTERNAL") -> None:
        """The request ends with an error (a no-op for a request already ended)."""
        if not seq.done:
            seq.sink(ErrorEvent(message, code))
            seq.done = True
