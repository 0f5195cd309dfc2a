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
A step that fails fails only the requests it concerns: a prefill its joining requests; a decode
step is retried request by request, and only those whose own step fails get the error. A rank of a
tensor-parallel target that fails (``RankFailure``) fails the engine: every request it holds or will
be given ends UNAVAILABLE, and ``on_fatal`` is told (the server exits for its supervisor to restart it).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from specmesh_server.kv_blocks import BlockManager, namespace
from specmesh_server.model_runner import ModelRunner
from specmesh_server.paged_kv import PagedKVCache
from specmesh_server.tensor_parallel import RankFailure
from specmesh_server.torch_thread import ThreadLoop, TorchThread
from specmesh_server.tree import TokenTree
from verifier_svc import admission
from verifier_svc.detokenizer import StopStringFilter, detokenizer_for
from verifier_svc.events import EngineFull, EngineStats, EngineStopped, ErrorEvent, Event, NeverFits
from verifier_svc.grammar import RequestGrammar, constrain_trees, step_masks
from verifier_svc.logprobs import TokenLogprob
from verifier_svc.model_steps import decode_step, prefill_step
from verifier_svc.request_speculation import RequestSpeculation
from verifier_svc.requests import GenerationRequest
from verifier_svc.sequence import Sequence
from verifier_svc.speculation import SpeculationConfig, SpeculationControl

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
        self.runner, self.tokenizer, self.config, self.metrics = runner, tokenizer, config, metrics
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.stats = EngineStats()
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # running[i].slot == i: prefilled ones first
        self._by_key: dict[int, Sequence] = {}  # every admitted request by its engine-unique key
        self._keys = itertools.count()
        self._admitted = 0  # running + waiting + in the inbox, guarded by _lock
        self._lock = threading.Lock()
        self._accepting = True
        self._stop = threading.Event()
        self.speculation = speculation or SpeculationControl(config.speculation)
        # Packed steps need the runner's own attention (models it cannot serve keep padded steps).
        spec_config = self.speculation.config
        self.speculation.config = replace(spec_config, packed_steps=spec_config.packed_steps and runner.packs)
        if not isinstance(runner.cache, PagedKVCache):
            raise TypeError("the engine runs over a paged KV cache: build its runner with block_size")
        self.cache: PagedKVCache = runner.cache
        self.blocks: BlockManager = runner.cache.manager
        self._evictions_seen = 0  # the pool's evictions already counted in the metrics
        # The next prefill's requests already mid-prefill (keys), and the prompt tokens that joined them whole.
        self._mid_prefill: tuple[set[int], int] = (set(), 0)
        self._thread = ThreadLoop(self._loop, "specmesh-engine", thread)
        self._on_fatal = on_fatal
        self.failed: str | None = None  # why the engine can serve no more (a rank failed)

    @property
    def packed(self) -> bool:
        """Whether decode steps with ragged trees run packed (the flag, where the runner can)."""
        return self.speculation.config.packed_steps

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
        need = min(len(req.prompt_ids) + req.max_tokens, self.max_context) + self.config.step_room
        budget = self.cache.token_budget
        if need > budget:
            raise NeverFits(
                f"the request needs up to {need} KV cache positions (prompt {len(req.prompt_ids)} + max_tokens "
                f"{req.max_tokens} + {self.config.step_room} for a verification step), over this verifier's KV "
                f"budget of {budget} positions (--kv-cache-memory); send a shorter prompt or a lower max_tokens"
            )
        with self._lock:
            if self.failed is not None:
                raise EngineStopped(f"the verifier failed: {self.failed}")
            if not self._accepting:
                raise EngineStopped("server is shutting down")
            limit = self.config.max_running + self.config.max_waiting
            if self._admitted >= limit:
                self.stats.rejected += 1
                raise EngineFull(f"{self._admitted} requests in flight, limit {limit}")
            self._admitted += 1
            key = next(self._keys)
        seq = Sequence(
            key=key,
            req=req,
            sink=sink,
            detok=detokenizer_for(self.tokenizer, req.prompt_ids),
            stopper=StopStringFilter(list(req.stop)),
            arrival=time.perf_counter(),
            speculation=speculation or RequestSpeculation.start(),
            grammar=grammar,
        )
        self._inbox.put(("submit", seq))
        return key

    def cancel(self, key: int) -> None:
        """Stop the request ``submit`` returned ``key`` for (a no-op once it has finished)."""
        self._inbox.put(("cancel", key))

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
            if self.failed is not None:  # every request held, even one that slipped in as it failed
                self._fail_all(self.failed)
            if not (self._running or self._waiting):
                continue
            try:
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
        with self._lock:
            first, self.failed = self.failed is None, self.failed or reason
            self._accepting = False
        if not first:
            return
        log.error("engine failed: %s", reason)
        self._inbox.put(("wake", None))  # the loop fails what it holds (``_serve_forever``)
        if self._on_fatal is not None:
            self._on_fatal(reason)

    def _fail_all(self, reason: str) -> None:
        message = f"the verifier failed and will restart: {reason}"
        for seq in self._running + list(self._waiting):
            self._finish_error(seq, message, code="UNAVAILABLE")
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
                self._by_key[payload.key] = payload
            elif kind == "cancel" and (seq := self._by_key.get(payload)) is not None and not seq.done:
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
        if self.metrics is not None:  # blocks the last step's growth took from the prefix cache
            evicted = self.blocks.pool.counters.evictions
            self.metrics.kv_evictions.inc(evicted - self._evictions_seen)
            self._evictions_seen = evicted
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

    def _need(self, seq: Sequence) -> int:
        """KV positions ``seq``'s row needs for its next step (a joining request: its whole prompt)."""
        return seq.cache_target + self.config.step_room

    def _need_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` must add for its next step, past those it holds."""
        held = len(seq.blocks.blocks) if seq.blocks is not None else 0
        return max(self.blocks.blocks_for(self._need(seq)) - held, 0)

    def _fit_memory(self) -> None:
        """Keep the running requests' next step within the free blocks: the youngest wait again while
        it is not (their full blocks stay cached; the rest of their KV is recomputed on return)."""
        by_age = sorted(self._running, key=lambda s: s.key)
        leaving = []
        while len(by_age) > 1 and sum(self._need_blocks(s) for s in by_age) > self.blocks.pool.free_blocks:
            seq = by_age.pop()
            log.info("KV budget: request %s waits again (its KV is recomputed on return)", seq.req.request_id)
            self._close_blocks(seq)
            leaving.append(seq)
        if leaving:
            for seq in leaving:  # the oldest of them ends up first in the queue
                self._waiting.appendleft(seq)
                self.stats.preempted += 1
                if self.metrics is not None:
                    self.metrics.preemptions.inc()
            self._rearrange([s for s in self._running if s not in leaving])
            for seq in leaving:
                seq.slot, seq.length = -1, 0

    def _cache_tokens(self, seq: Sequence) -> list[int]:
        """The tokens whose KV the request caches before it decodes: its prompt, and after a
        preemption its output but the pending token."""
        return seq.req.prompt_ids + seq.output[: max(len(seq.output) - 1, 0)]

    def _seed(self, seq: Sequence) -> bytes:
        """The hash chain's seed: cached prefixes are shared within one model, ``cache_scope`` (the
        gateway prefixes the scope with its API key's tenant, so tenants never share) and ``cache_salt``."""
        spec = seq.req.spec_params
        return namespace(self.config.cache_namespace, spec.cache_scope, spec.cache_salt)

    def _close_blocks(self, seq: Sequence) -> None:
        if seq.blocks is not None:
            self.blocks.close(seq.blocks)
            seq.blocks = None

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
            seq = self._waiting[0]
            cached, seed = self._cache_tokens(seq), self._seed(seq)
            hit = self.blocks.peek(seed, self._readable(seq, cached))
            # Hit blocks nobody holds are free now and would not be once taken.
            free = pool.free_blocks - sum(1 for b in hit if pool.refs[b] == 0)
            need = max(self.blocks.blocks_for(self._need(seq)) - len(hit), 0)
            if not admission.admits(free, [self._need_blocks(s) for s in self._running], need, margin):
                break
            uncached = seq.cache_target - len(hit) * self.blocks.block_size
            if joining and tokens + uncached > budget:
                break  # would overflow this forward's budget: it joins with the next one
            self._waiting.popleft()
            seq.blocks = self.blocks.open(seed, self._readable(seq, cached))
            seq.length = seq.blocks.cached_tokens
            seq.slot = len(self._running)
            if self.metrics is not None:
                self.metrics.prefix_queries.inc(len(cached))
                self.metrics.prefix_hits.inc(seq.length)
            if not seq.prefill_start:
                seq.prefill_start = time.perf_counter()
                seq.cached_tokens = seq.length
                if self.metrics is not None:
                    self.metrics.queued(seq.prefill_start - seq.arrival)
            self._running.append(seq)
            joining.append(seq)
            tokens += uncached
        self._mid_prefill = (mid, tokens if mid else 0)
        return joining

    @staticmethod
    def _readable(seq: Sequence, cached: list[int]) -> list[int]:
        """The tokens whose cached KV ``seq`` may read: a request that asks for prompt logprobs reads
        none of the prompt it has not scored yet (every row it needs is computed), as vLLM."""
        if seq.req.prompt_logprobs is None or seq.output:
            return cached
        return cached[: len(seq.prompt_logprobs) + 1]

    def _prefill(self, joining: list[Sequence]) -> None:
        """One forward over the next prompt chunk of each joining request (a prompt mid-prefill gives
        up the work of the prompts that joined it whole, ``_admit``)."""
        cfg, kpt = self.config, self.runner.keys_per_token
        mid, beside = self._mid_prefill
        budgets = [cfg.prefill_chunk_tokens - (beside if s.key in mid else 0) for s in joining]
        chunks = [s.uncached(admission.chunk_tokens(b, s.length, kpt)) for s, b in zip(joining, budgets, strict=True)]
        ends = [s.length + len(c) for s, c in zip(joining, chunks, strict=True)]
        for seq, end in zip(joining, ends, strict=True):
            self.blocks.grow(seq.blocks, end)
        rows = self.cache.rows([s.blocks for s in joining], max(ends))
        step = prefill_step(self.runner, joining, chunks, rows, self.packed, self.eos_token_ids)
        for i, scored in step.prompt_logprobs.items():
            joining[i].prompt_logprobs += scored
        for seq in joining:
            self.blocks.commit(seq.blocks, self._cache_tokens(seq)[: seq.length])
        if self.metrics is not None:
            self.metrics.step("prefill", step.seconds, step.tokens_in, len(joining))
        done = [joining[i] for i in step.finished]
        states = self.speculation.hidden_states(step.hidden, done, lambda j: [step.state_rows[j]])
        for seq, tok, lp, state in zip(done, step.first_tokens, step.logprobs, states, strict=True):
            seq.verify_s += step.seconds
            seq.first_token = time.perf_counter()
            if self.metrics is not None:
                self.metrics.first_token(seq.first_token - seq.arrival)
            self.stats.prompt_tokens += len(seq.req.prompt_ids)
            if seq.req.max_tokens == 0:  # prefill only (to score the prompt): no token
                seq.sink(seq.prefill_only())
                self._finish(seq, "length")
                continue
            self._append(seq, [tok], lp)
            self.speculation.emitted(seq, [tok], state, first=True)

    def _decode(self, seqs: list[Sequence]) -> None:
        """One batched forward over prefilled requests in contiguous slots: each one's pending token
        plus the token tree its proposer sent, if any; then lossless acceptance per request."""
        grammars = [s.grammar for s in seqs]
        constrained = any(g is not None for g in grammars)
        t_mask, pruned = 0.0, 0
        # Speculating requests' trees may gain their grammar's forced continuation, within the step's
        # room and the context.
        room = self.config.step_room - 1
        rooms = [min(room, self.max_context - s.length - 1) if s.speculation.session is not None else 0 for s in seqs]

        def constrain(trees: list[TokenTree]) -> list[TokenTree]:  # the grammars' masks, and their pruning
            nonlocal t_mask, pruned
            t0, before = time.perf_counter(), sum(g.pruned for g in grammars if g is not None)
            out = constrain_trees(grammars, trees, rooms)
            t_mask += time.perf_counter() - t0
            pruned += sum(g.pruned for g in grammars if g is not None) - before
            return out

        trees = self.speculation.collect_trees(seqs, self.max_context, constrain if constrained else None)
        masks = None
        if constrained:
            t0 = time.perf_counter()
            masks = step_masks(grammars, trees)
            if self.metrics is not None:
                self.metrics.grammar_step(t_mask + time.perf_counter() - t0, pruned)
        for seq, tree in zip(seqs, trees, strict=True):  # the pending token and the tree, after the prefix
            self.blocks.grow(seq.blocks, seq.length + 1 + len(tree))
        width = 1 + max(len(t) for t in trees)
        rows = self.cache.rows([s.blocks for s in seqs], max(s.length for s in seqs) + width)
        step = decode_step(
            self.runner, seqs, trees, self.packed, self.config.device_accept, rows, self.eos_token_ids, masks
        )
        self.speculation.observe_step(len(seqs), step.computed / len(seqs), step.seconds, step.width, step.keys)
        self.stats.steps += 1
        if self.metrics is not None:
            self.metrics.step("decode", step.seconds, step.computed, len(seqs), step.path)
        emitted = self.speculation.after_step(seqs, trees, step.results, step.seconds)
        states = self.speculation.hidden_states(step.hidden, seqs, step.state_rows)
        # Keep only the accepted nodes' KV, in path order (node k sits at position length + 1 + k): one copy.
        self.runner.move_positions(
            [
                (s.blocks, [s.length + 1 + k for k in path], s.length + 1)
                for s, (path, _) in zip(seqs, step.results, strict=True)
                if path != list(range(len(path)))
            ]
        )
        for seq, (path, _), tokens, lp, state in zip(seqs, step.results, emitted, step.logprobs, states, strict=True):
            base = seq.length + 1  # cache position of tree node 0
            seq.length = base + len(path)
            self.blocks.shrink(seq.blocks, seq.length)  # the rejected nodes' blocks go back
            seq.steps += 1
            seq.verify_s += step.seconds
            before = len(seq.output)
            self._append(seq, tokens, lp)
            self.speculation.emitted(seq, seq.output[before:], state)
            if not seq.done:  # blocks the accepted tokens filled join the prefix cache
                self.blocks.commit(seq.blocks, self._cache_tokens(seq)[: seq.length])

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Add accepted tokens, stream them, and finish the request when a limit is hit."""
        event, reason = seq.push(tokens, logprobs, self.eos_token_ids, self.max_context)
        self.stats.generated_tokens += len(event.token_ids)
        if self.metrics is not None:  # one observation per chunk: the gap since this request's last one
            now, last = time.perf_counter(), seq.last_chunk
            self.metrics.tokens(len(event.token_ids), None if last is None else now - last)
            seq.last_chunk = now
        seq.sink(event)
        if reason:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        now = time.perf_counter()
        self.speculation.finish(seq)  # the request is done: End the stream now, its proposers learn it
        if self.metrics is not None:
            self.metrics.request_finished(
                "ok", len(seq.req.prompt_ids), generation_tokens=len(seq.output), e2e_s=now - seq.arrival
            )
        seq.sink(seq.finish_event(reason, now))
        seq.done = True
        self.stats.finished += 1

    def _finish_error(self, seq: Sequence, message: str, code: str = "INTERNAL") -> None:
        if not seq.done:
            seq.sink(ErrorEvent(message, code))
            seq.done = True
        if seq.slot < 0:
            self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self._close_blocks(seq)
        self.speculation.release(seq)
        self._by_key.pop(seq.key, None)
        with self._lock:
            self._admitted -= 1

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
