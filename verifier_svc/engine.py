"""Continuous-batching generation engine (runs in its own thread).

Requests join and leave the running batch between steps. One iteration of the loop:
  1. apply new submissions and cancellations;
  2. memory: if the running requests' next step needs more KV blocks than are free, the youngest go
     back to wait (``admission``); waiting requests join, from their longest cached prompt prefix,
     while the free blocks hold them;
  3. prefill: one forward over the next chunk of the oldest joining request, or over several
     short joining prompts together (``prefill_chunk_tokens``' worth of work: chunks shorten
     deeper into a long prompt, so the running requests' next token is never far away); short
     prompts that arrive behind a long one join its forwards whole, within half that work, and
     its chunk shortens by theirs;
  4. decode: one batched forward over every running request's pending token (and trees);
  5. stream the new tokens of each request, retire finished requests and release their blocks
     (full ones stay cached for later requests with the same prefix).

A running request's gap between tokens is thus at most one decode step plus one prefill chunk.
The engine schedules; each of the rest has its owner: ``intake`` (the door any thread uses: limits,
submissions, cancellations), ``admission`` (what fits the KV budget), ``prefix_cache`` and
``kv_bookkeeping`` (a request's blocks), ``grammar_step`` (structured output in a decode step),
``SpeculationControl`` (the trees), ``streaming`` (what reaches a request's client and proposer) and
``engine_observer`` (metrics).
A step that fails fails only the requests it concerns: a prefill its joining requests; a decode
step is retried request by request, and only those whose own step fails get the error. A rank of a
tensor-parallel target that fails (``RankFailure``) fails the engine: every request it holds or will
be given ends UNAVAILABLE, and ``on_fatal`` is told (the server exits for its supervisor to restart it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specmesh_server import loop_posts
from specmesh_server.kv_blocks import BlockManager
from specmesh_server.model_runner import ModelRunner
from specmesh_server.paged_kv import PagedKVCache
from specmesh_server.tensor_parallel import RankFailure
from specmesh_server.torch_thread import ThreadLoop, TorchThread
from verifier_svc import admission, kv_bookkeeping, prefix_cache
from verifier_svc.engine_observer import observer_for
from verifier_svc.events import EngineStats, Event
from verifier_svc.grammar import RequestGrammar
from verifier_svc.grammar_step import GrammarStep
from verifier_svc.intake import Intake
from verifier_svc.model_steps import decode_step, prefill_step
from verifier_svc.request_speculation import RequestSpeculation
from verifier_svc.requests import GenerationRequest
from verifier_svc.sequence import Sequence
from verifier_svc.speculation import SpeculationConfig, SpeculationControl
from verifier_svc.streaming import Streams

if TYPE_CHECKING:
    from specmesh_server.metrics import VerifierMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 32  # requests decoded together (batch slots)
    max_waiting: int = 64  # admitted but not yet running; beyond running + waiting → rejected
    prefill_chunk_tokens: int = 512  # a prefill forward's work, in tokens at a prompt's start
    kv_margin: int = 256  # positions per row left to grow into when a waiting request joins
    cache_namespace: str = ""  # the model's name: cached prefixes are shared within it (and a tenant)
    step_room: int = 129  # positions one decode step writes per row at most: pending token + tree
    # Acceptance through the batched Triton kernel (``batch_accept.accept_batch``): None = for CUDA
    # logits, True = wherever the trees fit it (CPU tensors: Triton's interpreter), False = the host walk.
    device_accept: bool | None = None
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        eos_token_ids: set[int],
        max_context: int,
        config: EngineConfig,
        speculation: SpeculationControl | None = None,
        metrics: VerifierMetrics | None = None,
        thread: TorchThread | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        """``speculation``: the owner of every request's speculation (default: one without a router,
        so requests speculate only with the state they are submitted with, every tree verified).
        ``thread``: where the engine loop runs: the thread that loaded ``runner``'s model, so the
        process has one OpenMP team (``specmesh_server.torch_thread``); default a new one."""
        self.runner, self.tokenizer, self.config, self.observer = runner, tokenizer, config, observer_for(metrics)
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.stats = EngineStats()
        self._intake = Intake(config.max_running + config.max_waiting, self.stats, tokenizer)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # running[i].slot == i: prefilled ones first
        self._by_key: dict[int, Sequence] = {}  # every admitted request by its engine-unique key
        self._stop = threading.Event()
        self.speculation = speculation or SpeculationControl(config.speculation)
        self.speculation.fit_runner(runner.packs)
        self._streams = Streams(eos_token_ids, max_context, self.stats, self.observer, self.speculation)
        if not isinstance(runner.cache, PagedKVCache):
            raise TypeError("the engine runs over a paged KV cache: build its runner with block_size")
        self.cache: PagedKVCache = runner.cache
        self.blocks: BlockManager = runner.cache.manager
        # The next prefill's requests already mid-prefill (keys), and the prompt tokens that joined them whole.
        self._mid_prefill: tuple[set[int], int] = (set(), 0)
        self._thread = ThreadLoop(self._loop, "specmesh-engine", thread)
        self._on_fatal = on_fatal

    @property
    def packed(self) -> bool:
        """Whether decode steps with ragged trees run packed (the flag, where the runner can)."""
        return self.speculation.packed

    @property
    def failed(self) -> str | None:
        """Why the engine can serve no more (a rank failed); None while it serves."""
        return self._intake.failed

    # --- public, any thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(
        self,
        req: GenerationRequest,
        sink: Callable[[Event], None],
        speculation: RequestSpeculation | None = None,
        grammar: RequestGrammar | None = None,
    ) -> int:
        """Queue a request; its events go to ``sink`` (called from the engine thread). Returns the
        request's key, unique in this engine: what :meth:`cancel` takes. The client's ``request_id``
        is only a label (two clients may send the same one). ``speculation``: the request's
        speculation as ``SpeculationControl.start`` opened it (None: plain decoding). ``grammar``:
        its structured output's state (``req.structured_output`` compiled), which every row it draws from obeys."""
        budget, room = self.cache.token_budget, self.config.step_room
        admission.check_fits(len(req.prompt_ids), req.max_tokens, self.max_context, room, budget)
        return self._intake.submit(req, sink, speculation, grammar)

    def cancel(self, key: int) -> None:
        """Stop the request ``submit`` returned ``key`` for (a no-op once it has finished)."""
        self._intake.cancel(key)

    def stop_accepting(self) -> None:
        self._intake.stop_accepting()

    def in_flight(self) -> int:
        return self._intake.in_flight()

    def counts(self) -> tuple[int, int]:
        """(running, waiting), approximately: read without stopping the engine."""
        running = len(self._running)
        return running, max(self._intake.in_flight() - running, 0)

    def shutdown(self) -> None:
        self._stop.set()
        self._intake.wake()
        self._thread.join(timeout=10)

    # --- engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():  # cache buffers are inference tensors; keep every update inside
            self._serve_forever()

    def _serve_forever(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox(block=not (self._running or self._waiting))
            if self.failed is not None:  # every request held, even one that slipped in as it failed
                self._fail_all(self.failed)
            if not (self._running or self._waiting):
                continue
            try:  # a step's stream events and proposer advances wake the event loop once (``loop_posts``)
                with loop_posts.batched():
                    self._step()
            except RankFailure as exc:  # the model is gone: nothing can be served any more
                self.fail(str(exc))
            except Exception as exc:  # a failed forward must not take the server down
                log.exception("engine step failed; failing the running requests")
                for seq in self._running + list(self._waiting):
                    self._finish_error(seq, f"engine step failed: {exc}")
                self._waiting.clear()
                self._retire()

    def fail(self, reason: str) -> None:
        """End the engine for good (engine thread, or any thread while the engine loop is idle): every
        request it holds or will be given ends UNAVAILABLE, and ``on_fatal`` gets ``reason``."""
        if self._intake.fail(reason) and self._on_fatal is not None:  # the loop fails what it holds
            self._on_fatal(reason)

    def _fail_all(self, reason: str) -> None:
        message = f"the verifier failed and will restart: {reason}"
        for seq in self._running + list(self._waiting):
            self._finish_error(seq, message, code="UNAVAILABLE")
        self._waiting.clear()
        self._retire()

    def _drain_inbox(self, block: bool) -> None:
        arrived = False
        for kind, payload in self._intake.drain(block):
            arrived = True
            if kind == "submit":
                self._waiting.append(payload)
                self._by_key[payload.key] = payload
            elif kind == "cancel" and (seq := self._by_key.get(payload)) is not None and not seq.done:
                seq.done = True
                self.stats.cancelled += 1
                if seq in self._waiting:
                    self._waiting.remove(seq)
                    self._release(seq)
        if arrived:
            self._retire()

    def _step(self) -> None:
        self.observer.step_started(self.blocks.pool.counters.evictions)
        self._fit_memory()
        joining = self._admit()
        if joining:
            try:
                self._prefill(joining)
            except RankFailure:
                raise
            except Exception as exc:  # only the requests in this forward are concerned
                log.exception("prefill failed; failing its %d request(s)", len(joining))
                for seq in joining:
                    self._finish_error(seq, f"prefill failed: {exc}")
            loop_posts.flush()  # first tokens out before the decode forward
        self._retire()
        self._rearrange(self._running)  # requests whose prefill just ended move up with the decoding ones
        ready = [s for s in self._running if s.prefilled]
        if ready:
            try:
                self._decode(ready)
            except RankFailure:
                raise
            except Exception:
                log.exception("decode step over %d requests failed; retrying them one by one", len(ready))
                for seq in ready:
                    if seq.done:
                        continue
                    try:
                        self._decode([seq])
                    except RankFailure:
                        raise
                    except Exception as exc:
                        self._finish_error(seq, f"decode step failed: {exc}")
        self._retire()

    def _need_blocks(self, seq: Sequence) -> int:
        return admission.need_blocks(self.blocks, seq, self.config.step_room)

    def _fit_memory(self) -> None:
        """Keep the running requests' next step within the free blocks: the youngest wait again while
        it is not (their full blocks stay cached; the rest of their KV is recomputed on return)."""
        by_age = sorted(self._running, key=lambda s: s.key)
        leaving = []
        while len(by_age) > 1 and sum(self._need_blocks(s) for s in by_age) > self.blocks.pool.free_blocks:
            seq = by_age.pop()
            log.info("KV budget: request %s waits again (its KV is recomputed on return)", seq.req.request_id)
            kv_bookkeeping.close(self.blocks, seq)
            leaving.append(seq)
        if leaving:
            for seq in leaving:  # the oldest of them ends up first in the queue
                self._waiting.appendleft(seq)
                self.stats.preempted += 1
                self.observer.preempted(seq)
            self._rearrange([s for s in self._running if s not in leaving])
            for seq in leaving:
                seq.slot, seq.length = -1, 0

    def _admit(self) -> list[Sequence]:
        """The requests whose prompts the next prefill forward feeds: those mid-prefill, and waiting
        requests joining (first come, first served) while slots, the chunk and the free blocks hold
        them. A joining request starts from its longest cached prompt prefix (``kv_blocks``).

        Beside a prompt mid-prefill, waiting prompts join only whole, within half the forward's work
        budget, and the long prompt's chunk gives up what they take (``_prefill``): a short request
        that arrives behind a long prompt gets its first token one forward later, not after all of
        the long prompt's chunks (vLLM's ``long_prefill_token_threshold`` serves the same end)."""
        joining = [s for s in self._running if not s.prefilled]
        cfg, tokens, pool = self.config, 0, self.blocks.pool
        budget = cfg.prefill_chunk_tokens // 2 if joining else cfg.prefill_chunk_tokens
        mid = {s.key for s in joining}
        margin = self.blocks.blocks_for(cfg.kv_margin)
        while self._waiting and len(self._running) < cfg.max_running and tokens < budget:
            seq = self._waiting[0]  # it holds no blocks while it waits
            seed, readable = prefix_cache.seed(cfg.cache_namespace, seq), prefix_cache.readable(seq)
            hit = self.blocks.peek(seed, readable)
            # Hit blocks nobody holds are free now and would not be once taken.
            free = pool.free_blocks - sum(1 for b in hit if pool.refs[b] == 0)
            need = max(self._need_blocks(seq) - len(hit), 0)
            if not admission.admits(free, [self._need_blocks(s) for s in self._running], need, margin):
                break
            uncached = seq.cache_target - len(hit) * self.blocks.block_size
            if joining and tokens + uncached > budget:
                break  # would overflow this forward's budget: it joins with the next one
            self._waiting.popleft()
            seq.blocks = self.blocks.open(seed, readable)
            seq.length = seq.blocks.cached_tokens
            seq.slot = len(self._running)
            first = not seq.prefill_start
            if first:
                seq.prefill_start = time.perf_counter()
                seq.cached_tokens = seq.length
            self.observer.joined(seq, first)
            self._running.append(seq)
            joining.append(seq)
            tokens += uncached
        self._mid_prefill = (mid, tokens if mid else 0)
        return joining

    def _prefill(self, joining: list[Sequence]) -> None:
        """One forward over the next prompt chunk of each joining request (a prompt mid-prefill gives
        up the work of the prompts that joined it whole, ``_admit``)."""
        cfg, kpt = self.config, self.runner.keys_per_token
        mid, beside = self._mid_prefill
        budgets = [cfg.prefill_chunk_tokens - (beside if s.key in mid else 0) for s in joining]
        chunks = [s.uncached(admission.chunk_tokens(b, s.length, kpt)) for s, b in zip(joining, budgets, strict=True)]
        rows = kv_bookkeeping.grow_for_prefill(self.cache, joining, chunks)
        step = prefill_step(self.runner, joining, chunks, rows, self.packed, self.eos_token_ids)
        for i, scored in step.prompt_logprobs.items():
            joining[i].prompt_logprobs += scored
        for seq in joining:
            kv_bookkeeping.commit(self.blocks, seq)
        self.observer.step("prefill", step.seconds, step.tokens_in, len(joining))
        done = [joining[i] for i in step.finished]
        states = self.speculation.hidden_states(step.hidden, done, lambda j: [step.state_rows[j]])
        for seq, tok, lp, state in zip(done, step.first_tokens, step.logprobs, states, strict=True):
            seq.verify_s += step.seconds
            seq.first_token = time.perf_counter()
            self.observer.first_token(seq)
            self.stats.prompt_tokens += len(seq.req.prompt_ids)
            if seq.req.max_tokens == 0:  # prefill only (to score the prompt): no token
                seq.sink(seq.prefill_only())
                self._streams.finish(seq, "length")
                continue
            self._streams.append(seq, [tok], lp, state, first=True)

    def _decode(self, seqs: list[Sequence]) -> None:
        """One batched forward over prefilled requests in contiguous slots: each one's pending token
        plus the token tree its proposer sent, if any; then lossless acceptance per request."""
        room = self.config.step_room - 1  # speculating requests' trees may gain their grammar's forced text
        rooms = [min(room, self.max_context - s.length - 1) if self.speculation.speculating(s) else 0 for s in seqs]
        grammar = GrammarStep.of([s.grammar for s in seqs], rooms, self.observer)
        trees = self.speculation.collect_trees(seqs, self.max_context, grammar.constrain if grammar else None)
        masks = grammar.masks(trees) if grammar else None
        rows = kv_bookkeeping.grow_for_trees(self.cache, seqs, trees)
        step = decode_step(
            self.runner, seqs, trees, self.packed, self.config.device_accept, rows, self.eos_token_ids, masks
        )
        self.speculation.observe_step(len(seqs), step.computed / len(seqs), step.seconds, step.width, step.keys)
        self.stats.steps += 1
        self.observer.step("decode", step.seconds, step.computed, len(seqs), step.path)
        emitted = self.speculation.after_step(seqs, trees, step.results, step.seconds)
        states = self.speculation.hidden_states(step.hidden, seqs, step.state_rows)
        kv_bookkeeping.keep_accepted(self.runner, seqs, [path for path, _ in step.results])
        for seq, (path, _), tokens, lp, state in zip(seqs, step.results, emitted, step.logprobs, states, strict=True):
            kv_bookkeeping.settle(self.blocks, seq, path)
            seq.steps += 1
            seq.verify_s += step.seconds
            self._streams.append(seq, tokens, lp, state)
            if not seq.done:
                kv_bookkeeping.commit(self.blocks, seq)

    def _finish_error(self, seq: Sequence, message: str, code: str = "INTERNAL") -> None:
        Streams.fail(seq, message, code)
        if seq.slot < 0:  # not in the batch: nothing will retire it
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        kv_bookkeeping.close(self.blocks, seq)
        self.speculation.release(seq)
        self._by_key.pop(seq.key, None)
        self._intake.left()

    def _retire(self) -> None:
        """Drop finished requests, compact the rest, and give KV memory back once they need much less."""
        if not any(s.done for s in self._running):
            return
        leaving = [s for s in self._running if s.done]
        self._rearrange([s for s in self._running if not s.done])
        for seq in leaving:
            self._release(seq)

    def _rearrange(self, staying: list[Sequence]) -> None:
        """Make ``staying`` the running requests: prefilled ones first (in their order), requests still
        in prefill after them. No KV moves: a request's blocks are where its table says."""
        ready = sorted((s for s in staying if s.prefilled), key=lambda s: s.slot)
        joining = sorted((s for s in staying if not s.prefilled), key=lambda s: s.slot)
        self._running = ready + joining
        for i, seq in enumerate(self._running):
            seq.slot = i
