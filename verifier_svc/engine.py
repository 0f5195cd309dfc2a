"""Continuous-batching generation engine (runs in its own thread).

Requests join and leave the running batch between steps. One iteration of the loop:
  1. apply new submissions and cancellations;
  2. prefill: one forward over the next chunk of the oldest joining request, or over several
     short joining prompts together (bounded by ``prefill_chunk_tokens``);
  3. decode: one batched forward over every running request's pending token;
  4. stream the new tokens of each request, retire finished requests and free their slots.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specmesh.server.model_runner import ModelRunner
from specmesh_router.cost_model import LiveStepCost
from verifier_svc.batch_accept import accept_batch, sample_tokens
from verifier_svc.detokenizer import StopStringFilter, detokenizer_for
from verifier_svc.events import EngineFull, EngineStats, EngineStopped, ErrorEvent, Event
from verifier_svc.logprobs import TokenLogprob, step_logprobs
from verifier_svc.requests import GenerationRequest
from verifier_svc.sequence import Sequence
from verifier_svc.speculation import (
    ProposerSession,
    SessionFactory,
    SpecState,
    SpeculationConfig,
    SpeculationControl,
)
from verifier_svc.step_inputs import decode_inputs, prefill_inputs, unpadded

if TYPE_CHECKING:
    from specmesh.server.metrics import VerifierMetrics
    from specmesh_router.estimate import RequestEstimate
    from specmesh_router.selection import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 32  # requests decoded together (batch slots)
    max_waiting: int = 64  # admitted but not yet running; beyond running + waiting → rejected
    prefill_chunk_tokens: int = 512  # tokens per prefill forward (long prompts are chunked)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        eos_token_ids: set[int],
        max_context: int,
        config: EngineConfig,
        step_cost: LiveStepCost | None = None,
        router: Router | None = None,
        metrics: VerifierMetrics | None = None,
        open_session: SessionFactory | None = None,
        trees_arrived: threading.Condition | None = None,
    ) -> None:
        """``step_cost``: None verifies every tree, else trees are cut where they do not pay.
        ``open_session``: opens a proposer stream when the router switches a request's proposer.
        ``trees_arrived``: the condition proposer sessions notify when a tree lands."""
        self.runner, self.tokenizer, self.config = runner, tokenizer, config
        self.metrics = metrics
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.stats = EngineStats()
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # running[i].slot == i
        self._by_id: dict[str, Sequence] = {}
        self._admitted = 0  # running + waiting + in the inbox, guarded by _lock
        self._lock = threading.Lock()
        self._accepting = True
        self._stop = threading.Event()
        self.trees_arrived = trees_arrived or threading.Condition()
        self.speculation = SpeculationControl(
            config.speculation, self.stats, self.trees_arrived, step_cost, router, metrics, open_session
        )
        self._thread = threading.Thread(target=self._loop, name="specmesh-engine", daemon=True)

    # --- public, any thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(
        self,
        req: GenerationRequest,
        sink: Callable[[Event], None],
        session: ProposerSession | None = None,
        k_cap: int | None = None,
        estimate: RequestEstimate | None = None,
    ) -> None:
        """Queue a request; its events go to ``sink`` (called from the engine thread).

        ``session``: the request's open proposer stream, or None for plain decoding. ``k_cap``: the
        router's draft tokens per step, a cap on every tree (None: none). ``estimate``: the request's
        acceptance per depth, seeded from the proposer's shared statistics
        (``Router.estimate``): where the router says speculation does not pay, it starts low and the
        cost gate decodes plainly until the trees the request skips prove it wrong.
        """
        with self._lock:
            if not self._accepting:
                raise EngineStopped("server is shutting down")
            limit = self.config.max_running + self.config.max_waiting
            if self._admitted >= limit:
                self.stats.rejected += 1
                raise EngineFull(f"{self._admitted} requests in flight, limit {limit}")
            self._admitted += 1
        seq = Sequence(
            req=req,
            sink=sink,
            detok=detokenizer_for(self.tokenizer, req.prompt_ids),
            stopper=StopStringFilter(list(req.stop)),
            arrival=time.perf_counter(),
            spec=SpecState.start(session, k_cap, estimate),
        )
        self._inbox.put(("submit", seq))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def in_flight(self) -> int:
        with self._lock:
            return self._admitted

    def counts(self) -> tuple[int, int]:
        """(running, waiting), approximately: read without stopping the engine."""
        running = len(self._running)
        with self._lock:
            return running, max(self._admitted - running, 0)

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=10)

    # --- engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():  # cache buffers are inference tensors; keep every update inside
            self._serve_forever()

    def _serve_forever(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox(block=not (self._running or self._waiting))
            if not (self._running or self._waiting):
                continue
            try:
                self._step()
            except Exception as exc:  # a failed forward must not take the server down
                log.exception("engine step failed; failing the running requests")
                for seq in self._running + list(self._waiting):
                    self._finish_error(seq, f"engine step failed: {exc}")
                self._waiting.clear()
                self._retire()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self._waiting.append(payload)
                self._by_id[payload.req.request_id] = payload
            elif kind == "cancel" and (seq := self._by_id.get(payload)) is not None and not seq.done:
                seq.done = True
                self.stats.cancelled += 1
                if seq in self._waiting:
                    self._waiting.remove(seq)
                    self._release(seq)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._retire()

    def _step(self) -> None:
        self._prefill()
        self._retire()
        if any(s.prefilled for s in self._running):
            self._decode()
        self._retire()

    def _prefill(self) -> None:
        """One forward over the next prompt chunk(s) of joining requests."""
        budget = self.config.prefill_chunk_tokens
        joining = [s for s in self._running if not s.prefilled]
        if not joining:
            while self._waiting and len(self._running) < self.config.max_running:
                seq = self._waiting.popleft()
                seq.slot = len(self._running)
                seq.prefill_start = time.perf_counter()
                self._running.append(seq)
                joining.append(seq)
                if sum(len(s.req.prompt_ids) for s in joining) >= budget:
                    break
            if not joining:
                return
        if len(joining) > 1 and sum(len(s.req.prompt_ids) for s in joining) > budget:
            # The last admitted prompt overflowed the budget: it waits for the next iteration.
            *joining, late = joining
            self._running.remove(late)
            late.slot = -1
            self._waiting.appendleft(late)
        # Each row feeds the next chunk of its prompt: tokens [length, length + n).
        chunks = [s.req.prompt_ids[s.length : s.length + budget] for s in joining]
        dev = self.runner.device
        step = prefill_inputs(chunks, [s.length for s in joining], dev)
        rows = slice(joining[0].slot, joining[-1].slot + 1)
        t0 = time.perf_counter()
        hidden = self.runner.forward(rows, step.input_ids, step.positions, step.mask)  # [b, n, h]
        for seq, chunk in zip(joining, chunks, strict=True):
            seq.length += len(chunk)
        finished = [i for i, s in enumerate(joining) if s.length == len(s.req.prompt_ids)]
        if not finished:
            return
        last = torch.tensor([len(chunks[i]) - 1 for i in finished], device=dev)
        logits = self.runner.logits(hidden[torch.tensor(finished, device=dev), last])  # [f, vocab]
        done = [joining[i] for i in finished]
        tokens = sample_tokens([s.req for s in done], [s.context_length for s in done], logits)
        logprobs = step_logprobs([s.req for s in done], logits, lambda j: ([j], [tokens[j]]))
        elapsed = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.step("prefill", elapsed, int(step.input_ids.numel()))
        for seq, tok, lp in zip(done, tokens, logprobs, strict=True):
            seq.verify_s += elapsed
            seq.first_token = seq.spec.last_tree = time.perf_counter()
            self.stats.prompt_tokens += len(seq.req.prompt_ids)
            self._append(seq, [tok], lp)
            if seq.spec.session is not None and not seq.done:
                seq.spec.session.advance([tok])  # the proposer's context must include the first token

    def _decode(self) -> None:
        """One batched forward over every prefilled request (slots 0..b-1): its pending token plus
        the token tree its proposer sent, if any; then lossless acceptance per request."""
        seqs = [s for s in self._running if s.prefilled]
        trees = self.speculation.collect_trees(seqs, self.max_context)
        dev = self.runner.device
        step = decode_inputs([s.pending for s in seqs], [s.length for s in seqs], trees, dev)
        width = step.input_ids.shape[1]
        t0 = time.perf_counter()
        hidden = self.runner.forward(slice(0, len(seqs)), step.input_ids, step.positions, step.mask, step.write_pos)
        counts = [len(t) + 1 for t in trees]
        logits = self.runner.logits(hidden[unpadded(counts, dev)])  # [sum(n_i + 1), vocab]
        results = accept_batch([s.req for s in seqs], [s.context_length for s in seqs], trees, logits, counts)
        starts = [0, *itertools.accumulate(counts)]  # request i's first logits row

        def drawn(i: int) -> tuple[list[int], list[int]]:
            """Emitted token j of request i was drawn at its parent's row: the root (the pending token's
            row) for the first, accepted node path[j - 1] for the rest; the bonus after the last."""
            (path, bonus), start = results[i], starts[i]
            return [start, *(start + 1 + k for k in path)], [*(trees[i].tokens[k] for k in path), bonus]

        logprobs = step_logprobs([s.req for s in seqs], logits, drawn)
        elapsed = time.perf_counter() - t0
        if self.speculation.step_cost is not None:  # the cost model follows what steps really take here
            self.speculation.step_cost.observe(len(seqs), width, elapsed)
        self.stats.steps += 1
        if self.metrics is not None:
            self.metrics.step("decode", elapsed, len(seqs) * width)
        emitted = self.speculation.after_step(seqs, trees, results)
        for seq, (path, _), tokens, lp in zip(seqs, results, emitted, logprobs, strict=True):
            base = seq.length + 1  # cache slot of tree node 0
            if path != list(range(len(path))):  # keep only the accepted nodes' KV, in path order
                self.runner.cache.gather_positions(seq.slot, torch.tensor(path, device=dev) + base, base)
            seq.length = base + len(path)
            seq.steps += 1
            seq.verify_s += elapsed
            before = len(seq.output)
            self._append(seq, tokens, lp)
            if seq.spec.session is not None and not seq.done:
                seq.spec.session.advance(seq.output[before:])
        self.speculation.redecide_due(seqs)

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Add accepted tokens, stream them, and finish the request when a limit is hit."""
        event, reason = seq.push(tokens, logprobs, self.eos_token_ids, self.max_context)
        self.stats.generated_tokens += len(event.token_ids)
        if self.metrics is not None:
            self.metrics.tokens(len(event.token_ids))
        seq.sink(event)
        if reason:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        now = time.perf_counter()
        self.speculation.end_session(seq)  # the request is done: End the stream now
        if self.metrics is not None:
            self.metrics.request_finished("ok", len(seq.req.prompt_ids), ttft_s=seq.first_token - seq.arrival)
        seq.sink(seq.finish_event(reason, now))
        seq.done = True
        self.stats.finished += 1

    def _finish_error(self, seq: Sequence, message: str) -> None:
        if not seq.done:
            seq.sink(ErrorEvent(message))
            seq.done = True
        if seq.slot < 0:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.speculation.end_session(seq)
        self._by_id.pop(seq.req.request_id, None)
        with self._lock:
            self._admitted -= 1

    def _retire(self) -> None:
        """Drop finished requests and compact the rest: prefilled ones in slots 0..p-1 (so a decode
        forward takes a view of the cache), requests still in prefill right after them.

        A finished request's slot is refilled from the end (one request's KV copied), not by
        shifting every later slot down.
        """
        if not any(s.done for s in self._running):
            return
        alive = [s for s in self._running if not s.done]
        ready = [s for s in alive if s.prefilled]
        joining = sorted((s for s in alive if not s.prefilled), key=lambda s: s.slot)
        p = len(ready)
        holes = sorted(set(range(p)) - {s.slot for s in ready})
        movers = sorted((s for s in ready if s.slot >= p), key=lambda s: s.slot)
        for hole, seq in zip(holes, movers, strict=True):
            self.runner.cache.move_slot(seq.slot, hole, seq.length)
            seq.slot = hole
        for rank, seq in enumerate(joining):  # joining requests sit after every prefilled one
            self.runner.cache.move_slot(seq.slot, p + rank, seq.length)
            seq.slot = p + rank
        for seq in self._running:
            if seq.done:
                self._release(seq)
        self._running = sorted(ready, key=lambda s: s.slot) + joining
