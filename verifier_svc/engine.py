"""Continuous-batching generation engine (runs in its own thread).

Requests join and leave the running batch between steps. One iteration of the loop:
  1. apply new submissions and cancellations;
  2. prefill: one forward over the next chunk of the oldest joining request, or over several
     short joining prompts together (bounded by ``prefill_chunk_tokens``);
  3. decode: one batched forward over every running request's pending token;
  4. stream the new tokens of each request, retire finished requests and free their slots.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specmesh.server.model_runner import ModelRunner, causal_mask
from specmesh.server.sampling import sample_next
from specmesh.server.tree import verification_layout
from specmesh_router.cost_model import LiveStepCost
from verifier_svc.batch_accept import accept_batch, repeat_rows
from verifier_svc.detokenizer import IncrementalDetokenizer, StopStringFilter
from verifier_svc.logprobs import TokenLogprob, token_logprobs
from verifier_svc.requests import GenerationRequest
from verifier_svc.speculation import (
    ProposerSession,
    SessionFactory,
    SpecCounters,
    SpecState,
    SpeculationConfig,
    SpeculationControl,
)

if TYPE_CHECKING:
    from specmesh.server.metrics import VerifierMetrics
    from specmesh_router.selection import Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 32  # requests decoded together (batch slots)
    max_waiting: int = 64  # admitted but not yet running; beyond running + waiting → rejected
    prefill_chunk_tokens: int = 512  # tokens per prefill forward (long prompts are chunked)
    proposer_wait_ms: float = 5.0  # per step, the longest wait for a request's tree
    proposer_timeout_s: float = 2.0  # no answer for this long → speculation off for the request
    redecide_steps: int = 16  # the router revisits a request's proposer and k this often (steps)
    recent_tokens: int = 32  # how far a late tree may be re-rooted (greedy requests)


class EngineFull(Exception):
    """More concurrent requests than the engine admits."""


class EngineStopped(Exception):
    """The engine is draining or stopped and takes no new requests."""


@dataclass
class TokenEvent:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token, for requests that asked


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
    spec: SpecCounters = field(default_factory=SpecCounters)


@dataclass
class ErrorEvent:
    message: str


Event = TokenEvent | FinishEvent | ErrorEvent


@dataclass
class _Sequence:
    req: GenerationRequest
    sink: Callable[[Event], None]
    detok: IncrementalDetokenizer
    stopper: StopStringFilter
    arrival: float
    slot: int = -1
    length: int = 0  # tokens whose KV is cached
    output: list[int] = field(default_factory=list)
    done: bool = False
    steps: int = 0
    verify_s: float = 0.0
    prefill_start: float = 0.0
    first_token: float = 0.0
    spec: SpecState = field(default_factory=SpecState)

    @property
    def context_length(self) -> int:
        return len(self.req.prompt_ids) + len(self.output)

    @property
    def pending(self) -> int:
        """The newest token, not yet in the KV cache (fed at the next decode step)."""
        return self.output[-1]

    @property
    def prefilled(self) -> bool:
        return bool(self.output)


@dataclass
class EngineStats:
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    invalid_trees: int = 0
    proposer_fallbacks: int = 0


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
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # running[i].slot == i
        self._by_id: dict[str, _Sequence] = {}
        self._admitted = 0  # running + waiting + in the inbox, guarded by _lock
        self._lock = threading.Lock()
        self._accepting = True
        self._stop = threading.Event()
        self.trees_arrived = trees_arrived or threading.Condition()
        self.speculation = SpeculationControl(
            SpeculationConfig(
                proposer_wait_ms=config.proposer_wait_ms,
                proposer_timeout_s=config.proposer_timeout_s,
                redecide_steps=config.redecide_steps,
                recent_tokens=config.recent_tokens,
            ),
            self.stats,
            self.trees_arrived,
            step_cost,
            router,
            metrics,
            open_session,
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
        prior_alpha: float | None = None,
    ) -> None:
        """Queue a request; its events go to ``sink`` (called from the engine thread).

        ``session``: the request's open proposer stream, or None for plain decoding. ``k_cap``: the
        router's draft tokens per step, a cap on every tree (None: none). ``prior_alpha``: the proposer's
        per-token acceptance from the shared statistics, the start of this request's own estimate
        (2 pseudo-trials): where the router says speculation does not pay, it starts low and the cost
        gate decodes plainly until the trees the request skips prove it wrong.
        """
        with self._lock:
            if not self._accepting:
                raise EngineStopped("server is shutting down")
            limit = self.config.max_running + self.config.max_waiting
            if self._admitted >= limit:
                self.stats.rejected += 1
                raise EngineFull(f"{self._admitted} requests in flight, limit {limit}")
            self._admitted += 1
        seq = _Sequence(
            req=req,
            sink=sink,
            detok=IncrementalDetokenizer.for_prompt(self.tokenizer, req.prompt_ids),
            stopper=StopStringFilter(list(req.stop)),
            arrival=time.perf_counter(),
            spec=SpecState.start(session, k_cap, prior_alpha),
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
        n = max(len(c) for c in chunks)
        dev = self.runner.device
        input_ids = torch.zeros(len(joining), n, dtype=torch.long)
        for i, chunk in enumerate(chunks):
            input_ids[i, : len(chunk)] = torch.tensor(chunk)
        starts = torch.tensor([s.length for s in joining])  # [b]
        positions = (starts[:, None] + torch.arange(n)[None, :]).to(dev)  # [b, n]
        kv_len = int(positions.max()) + 1
        rows = slice(joining[0].slot, joining[-1].slot + 1)
        t0 = time.perf_counter()
        hidden = self.runner.forward(rows, input_ids.to(dev), positions, causal_mask(positions, kv_len))  # [b, n, h]
        for seq, chunk in zip(joining, chunks, strict=True):
            seq.length += len(chunk)
        finished = [i for i, s in enumerate(joining) if s.length == len(s.req.prompt_ids)]
        if not finished:
            return
        last = torch.tensor([len(chunks[i]) - 1 for i in finished], device=dev)
        logits = self.runner.logits(hidden[torch.tensor(finished, device=dev), last])  # [f, vocab]
        done = [joining[i] for i in finished]
        tokens = self._sample(done, logits)
        logprobs = self._logprobs(done, logits, lambda j: ([j], [tokens[j]]))
        elapsed = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.step("prefill", elapsed, int(input_ids.numel()))
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
        width = 1 + max(len(t) for t in trees)
        lengths = [s.length for s in seqs]
        kv_len = max(lengths) + width
        if width == 1:  # nobody speculates: the plain decode layout
            input_ids = torch.tensor([[s.pending] for s in seqs], device=dev)  # [b, 1]
            positions = torch.tensor([[n] for n in lengths], device=dev)  # [b, 1]
            mask = causal_mask(positions, kv_len)
            write_pos = positions
        else:
            input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
            offsets = torch.arange(width)
            write_pos = torch.tensor(lengths)[:, None] + offsets[None, :]  # [b, width]: contiguous after the prefix
            positions = write_pos.clone()
            mask = torch.zeros(len(seqs), width, kv_len, dtype=torch.bool)
            mask[:, :, 0] = True  # padding queries see one key (no all-masked rows)
            for i, (seq, tree) in enumerate(zip(seqs, trees, strict=True)):
                n = len(tree) + 1
                pos, m = verification_layout(tree.parents, seq.length)
                input_ids[i, :n] = torch.tensor([seq.pending, *tree.tokens])
                positions[i, :n] = pos
                mask[i, :n, : m.shape[1]] = m
            input_ids, positions, write_pos, mask = (x.to(dev) for x in (input_ids, positions, write_pos, mask))
        t0 = time.perf_counter()
        hidden = self.runner.forward(slice(0, len(seqs)), input_ids, positions, mask, write_pos)  # [b, width, h]
        counts = [len(t) + 1 for t in trees]
        rows = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(counts)).to(dev)
        cols = torch.cat([torch.arange(c) for c in counts]).to(dev)
        logits = self.runner.logits(hidden[rows, cols])  # [sum(n_i + 1), vocab]: padding skipped
        results = accept_batch([s.req for s in seqs], [s.context_length for s in seqs], trees, logits, counts)

        def drawn(i: int) -> tuple[list[int], list[int]]:
            """Emitted token j of request i was drawn at its parent's row: the root (the pending token's
            row) for the first, accepted node path[j - 1] for the rest; the bonus after the last."""
            (path, bonus), start = results[i], sum(counts[:i])
            return [start, *(start + 1 + k for k in path)], [*(trees[i].tokens[k] for k in path), bonus]

        logprobs = self._logprobs(seqs, logits, drawn)
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

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor) -> list[int]:
        dev = logits.device
        temperature = torch.tensor([s.req.temperature for s in seqs], device=dev)
        top_p = torch.tensor([s.req.top_p for s in seqs], device=dev)
        top_k = torch.tensor([s.req.top_k for s in seqs], device=dev)
        seeds = torch.tensor([s.req.seed for s in seqs], device=dev)
        positions = torch.tensor([len(s.req.prompt_ids) + len(s.output) for s in seqs], device=dev)
        return sample_next(logits, temperature, top_p, top_k, seeds, positions).tolist()  # one host copy

    @staticmethod
    def _logprobs(
        seqs: list[_Sequence], logits: torch.Tensor, drawn: Callable[[int], tuple[list[int], list[int]]]
    ) -> list[list[TokenLogprob] | None]:
        """Per request, its emitted tokens' logprobs (None where it did not ask). ``drawn(i)``: the
        logits rows and the tokens request i emitted from them, asked only of requests that want
        logprobs. One computation and one host copy for the whole step."""
        want = [i for i, s in enumerate(seqs) if s.req.logprobs is not None]
        out: list[list[TokenLogprob] | None] = [None] * len(seqs)
        if not want:
            return out
        dev = logits.device
        draws = [drawn(i) for i in want]
        req = [seqs[i].req for i in want]
        per_row = [len(rows) for rows, _ in draws]
        flat = token_logprobs(
            logits[torch.tensor([r for rows, _ in draws for r in rows], device=dev)],
            torch.tensor([t for _, tokens in draws for t in tokens], device=dev),
            repeat_rows([r.temperature for r in req], per_row, dev),
            repeat_rows([r.top_p for r in req], per_row, dev),
            repeat_rows([r.top_k for r in req], per_row, dev),
            [r.logprobs for r, n in zip(req, per_row, strict=True) for _ in range(n)],
        )
        offset = 0
        for i, n in zip(want, per_row, strict=True):
            out[i], offset = flat[offset : offset + n], offset + n
        return out

    def _append(self, seq: _Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Add accepted tokens, stream them, and finish the request when a limit is hit."""
        req = seq.req
        reason = ""
        emitted: list[int] = []
        for tok in tokens:
            seq.output.append(tok)
            emitted.append(tok)
            if (tok in self.eos_token_ids and not req.ignore_eos) or tok in req.stop_token_ids:
                reason = "eos"
            elif len(seq.output) >= req.max_tokens or len(req.prompt_ids) + len(seq.output) >= self.max_context:
                reason = "length"
            if reason:
                break
        self.stats.generated_tokens += len(emitted)
        if self.metrics is not None:
            self.metrics.tokens(len(emitted))
        text = seq.stopper.push(seq.detok.push(emitted))
        if seq.stopper.matched is not None:
            reason = "stop"
        if reason:
            text += seq.stopper.push(seq.detok.flush()) + seq.stopper.flush()
        seq.sink(TokenEvent(emitted, text, logprobs[: len(emitted)] if logprobs is not None else None))
        if reason:
            self._finish(seq, reason)

    def _finish(self, seq: _Sequence, reason: str) -> None:
        now = time.perf_counter()
        self.speculation.end_session(seq)  # the request is done: End the stream now
        if self.metrics is not None:
            self.metrics.request_finished("ok", len(seq.req.prompt_ids), ttft_s=seq.first_token - seq.arrival)
        seq.sink(
            FinishEvent(
                finish_reason=reason,
                prompt_tokens=len(seq.req.prompt_ids),
                completion_tokens=len(seq.output),
                steps=seq.steps,
                verify_ms=seq.verify_s * 1e3,
                queue_ms=(seq.prefill_start - seq.arrival) * 1e3,
                ttft_ms=(seq.first_token - seq.arrival) * 1e3,
                total_ms=(now - seq.arrival) * 1e3,
                stop_string=seq.stopper.matched or "",
                spec=seq.spec.counters,
            )
        )
        seq.done = True
        self.stats.finished += 1

    def _finish_error(self, seq: _Sequence, message: str) -> None:
        if not seq.done:
            seq.sink(ErrorEvent(message))
            seq.done = True
        if seq.slot < 0:
            self._release(seq)

    def _release(self, seq: _Sequence) -> None:
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
