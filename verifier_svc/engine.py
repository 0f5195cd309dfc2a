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
from typing import Any

import torch

from verifier_svc.detokenizer import IncrementalDetokenizer, StopStringFilter
from verifier_svc.model_runner import ModelRunner, causal_mask
from verifier_svc.requests import GenerationRequest
from verifier_svc.sampling import sample_next

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 32  # requests decoded together (batch slots)
    max_waiting: int = 64  # admitted but not yet running; beyond running + waiting → rejected
    prefill_chunk_tokens: int = 512  # tokens per prefill forward (long prompts are chunked)


class EngineFull(Exception):
    """More concurrent requests than the engine admits."""


class EngineStopped(Exception):
    """The engine is draining or stopped and takes no new requests."""


@dataclass
class TokenEvent:
    token_ids: list[int]
    text: str


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


class Engine:
    def __init__(
        self, runner: ModelRunner, tokenizer: Any, eos_token_ids: set[int], max_context: int, config: EngineConfig
    ) -> None:
        self.runner, self.tokenizer, self.config = runner, tokenizer, config
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
        self._thread = threading.Thread(target=self._loop, name="specmesh-engine", daemon=True)

    # --- public, any thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, req: GenerationRequest, sink: Callable[[Event], None]) -> None:
        """Queue a request; its events go to ``sink`` (called from the engine thread)."""
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
        tokens = self._sample([joining[i] for i in finished], logits)
        elapsed = time.perf_counter() - t0
        for i, tok in zip(finished, tokens, strict=True):
            seq = joining[i]
            seq.verify_s += elapsed
            seq.first_token = time.perf_counter()
            self.stats.prompt_tokens += len(seq.req.prompt_ids)
            self._append(seq, [tok])

    def _decode(self) -> None:
        """One batched forward over the pending token of every prefilled request (slots 0..b-1)."""
        seqs = [s for s in self._running if s.prefilled]
        dev = self.runner.device
        input_ids = torch.tensor([[s.pending] for s in seqs], device=dev)  # [b, 1]
        positions = torch.tensor([[s.length] for s in seqs], device=dev)  # [b, 1]
        kv_len = int(positions.max()) + 1
        t0 = time.perf_counter()
        hidden = self.runner.forward(slice(0, len(seqs)), input_ids, positions, causal_mask(positions, kv_len))
        logits = self.runner.logits(hidden[:, -1])  # [b, vocab]
        tokens = self._sample(seqs, logits)
        elapsed = time.perf_counter() - t0
        self.stats.steps += 1
        for seq, tok in zip(seqs, tokens, strict=True):
            seq.length += 1
            seq.steps += 1
            seq.verify_s += elapsed
            self._append(seq, [tok])

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor) -> list[int]:
        dev = logits.device
        temperature = torch.tensor([s.req.temperature for s in seqs], device=dev)
        top_p = torch.tensor([s.req.top_p for s in seqs], device=dev)
        top_k = torch.tensor([s.req.top_k for s in seqs], device=dev)
        seeds = torch.tensor([s.req.seed for s in seqs], device=dev)
        positions = torch.tensor([len(s.req.prompt_ids) + len(s.output) for s in seqs], device=dev)
        return sample_next(logits, temperature, top_p, top_k, seeds, positions).tolist()  # one host copy

    def _append(self, seq: _Sequence, tokens: list[int]) -> None:
        """Add accepted tokens, stream them, and finish the request when a limit is hit."""
        req = seq.req
        reason = ""
        emitted: list[int] = []
        for tok in tokens:
            seq.output.append(tok)
            emitted.append(tok)
            if tok in self.eos_token_ids and not req.ignore_eos:
                reason = "eos"
            elif len(seq.output) >= req.max_tokens or len(req.prompt_ids) + len(seq.output) >= self.max_context:
                reason = "length"
            if reason:
                break
        self.stats.generated_tokens += len(emitted)
        text = seq.stopper.push(seq.detok.push(emitted))
        if seq.stopper.matched is not None:
            reason = "stop"
        if reason:
            text += seq.stopper.push(seq.detok.flush()) + seq.stopper.flush()
        seq.sink(TokenEvent(emitted, text))
        if reason:
            self._finish(seq, reason)

    def _finish(self, seq: _Sequence, reason: str) -> None:
        now = time.perf_counter()
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
