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
from specmesh.server.sampling import filter_logits, sample_next
from specmesh.server.tree import TokenTree, depths, follow, truncate, verification_layout
from specmesh_router.cost_model import LiveStepCost, choose_width
from specmesh_router.stats import AcceptanceStats
from verifier_svc.acceptance import acceptance_uniforms, greedy_accept, sample_accept, walk_shape
from verifier_svc.detokenizer import IncrementalDetokenizer, StopStringFilter
from verifier_svc.logprobs import TokenLogprob, token_logprobs
from verifier_svc.proposer_client import ProposerSession, wait_for_trees
from verifier_svc.requests import GenerationRequest

if TYPE_CHECKING:
    from specmesh.server.metrics import VerifierMetrics
    from specmesh_router.selection import Router

log = logging.getLogger(__name__)
_EMPTY_TREE = TokenTree([], [])
_EWMA = 0.3  # weight of the newest step in a request's acceptance estimate
_KERNEL_MAX_NODES = 63  # the device acceptance / tree-attention kernels' ancestor bitmask: 64 rows


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 32  # requests decoded together (batch slots)
    max_waiting: int = 64  # admitted but not yet running; beyond running + waiting → rejected
    prefill_chunk_tokens: int = 512  # tokens per prefill forward (long prompts are chunked)
    proposer_wait_ms: float = 5.0  # per step, the longest wait for a request's tree
    proposer_timeout_s: float = 2.0  # no answer for this long → speculation off for the request
    redecide_steps: int = 16  # the router revisits a request's proposer and k this often (steps)
    recent_tokens: int = 32  # how far a late tree may be re-rooted (greedy requests)


def _repeat(values: list, repeats: list[int], device: torch.device) -> torch.Tensor:
    """``values[i]`` repeated ``repeats[i]`` times, as one tensor: a request's setting for each of
    its logits rows.

    >>> _repeat([0.5, 1.0], [2, 1], torch.device("cpu")).tolist()
    [0.5, 0.5, 1.0]
    """
    return torch.repeat_interleave(torch.tensor(values, device=device), torch.tensor(repeats, device=device))


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
    per_proposer: dict[str, list[int]] = field(default_factory=dict)  # name → [steps, drafted, accepted]

    def count_step(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        c = self.per_proposer.setdefault(self.proposer, [0, 0, 0])
        c[0], c[1], c[2] = c[0] + 1, c[1] + drafted, c[2] + accepted
        if len(self.accepted_hist) <= accepted:
            self.accepted_hist.extend([0] * (accepted + 1 - len(self.accepted_hist)))
        self.accepted_hist[accepted] += 1


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
    session: ProposerSession | None = None
    spec: SpecCounters = field(default_factory=SpecCounters)
    last_tree: float = 0.0
    # Per-token acceptance rate α = successes / trials (both EWMAs): a drafted level counts a
    # success when accepted, a trial also when the path stopped there; a path accepted to the end
    # of a cut tree is censored (no failure counted), so cutting trees never biases α down.
    # Fed by verified trees and by skipped trees scored against the tokens emitted after them.
    accept_s: float = 1.0  # prior α = 0.5
    accept_t: float = 2.0
    shadow: tuple[TokenTree, int, int] | None = None  # (skipped tree, current index, matched)
    k_cap: int = -1  # the router's draft tokens per step; ≤ 0: no cap (its "off" acts through the prior α)
    failed_proposers: set[str] = field(default_factory=set)

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
        open_session: Callable[[GenerationRequest, str, list[int]], ProposerSession | None] | None = None,
    ) -> None:
        self.runner, self.tokenizer, self.config = runner, tokenizer, config
        self.step_cost = step_cost  # None: verify every tree; else speculate only where it pays
        self.router, self.metrics = router, metrics
        self.open_session = open_session  # (request, proposer, context) → a new stream, for mid-request switches
        self._last_wait = 0.0
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
        self.trees_arrived = threading.Condition()  # proposer sessions notify it
        self._thread = threading.Thread(target=self._loop, name="specmesh-engine", daemon=True)

    # --- public, any thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(
        self,
        req: GenerationRequest,
        sink: Callable[[Event], None],
        session: ProposerSession | None = None,
        k_cap: int = -1,
        prior_alpha: float | None = None,
    ) -> None:
        """Queue a request; its events go to ``sink`` (called from the engine thread).

        ``session``: the request's open proposer stream, or None for plain decoding. ``k_cap``: the
        router's draft tokens per step, a cap on every tree (≤ 0: none). ``prior_alpha``: the proposer's
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
            session=session,
            spec=SpecCounters(proposer=session.name if session else "none"),
            k_cap=k_cap,
        )
        if session is not None:
            seq.spec.per_proposer[session.name] = [0, 0, 0]
        if prior_alpha is not None:
            seq.accept_s, seq.accept_t = 2.0 * prior_alpha, 2.0
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
            seq.first_token = seq.last_tree = time.perf_counter()
            self.stats.prompt_tokens += len(seq.req.prompt_ids)
            self._append(seq, [tok], lp)
            if seq.session is not None and not seq.done:
                seq.session.advance([tok])  # the proposer's context must include the first token

    def _decode(self) -> None:
        """One batched forward over every prefilled request (slots 0..b-1): its pending token plus
        the token tree its proposer sent, if any; then lossless acceptance per request."""
        seqs = [s for s in self._running if s.prefilled]
        trees = self._collect_trees(seqs)
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
        results = self._accept(seqs, trees, logits, counts)

        def drawn(i: int) -> tuple[list[int], list[int]]:
            """Emitted token j of request i was drawn at its parent's row: the root (the pending token's
            row) for the first, accepted node path[j - 1] for the rest; the bonus after the last."""
            (path, bonus), start = results[i], sum(counts[:i])
            return [start, *(start + 1 + k for k in path)], [*(trees[i].tokens[k] for k in path), bonus]

        logprobs = self._logprobs(seqs, logits, drawn)
        elapsed = time.perf_counter() - t0
        if self.step_cost is not None:  # the cost model follows what steps really take here
            self.step_cost.observe(len(seqs), width, elapsed)
        self.stats.steps += 1
        if self.metrics is not None:
            self.metrics.step("decode", elapsed, len(seqs) * width)
        samples: dict[tuple[str, str], AcceptanceStats] = {}  # per (proposer, tag): one record per step
        verified: dict[str, AcceptanceStats] = {}

        def add(into: dict, key: Any, sample: AcceptanceStats) -> None:
            into[key] = into[key] + sample if key in into else sample

        for seq, tree, (path, bonus), lp in zip(seqs, trees, results, logprobs, strict=True):
            base = seq.length + 1  # cache slot of tree node 0
            if path != list(range(len(path))):  # keep only the accepted nodes' KV, in path order
                self.runner.cache.gather_positions(seq.slot, torch.tensor(path, device=dev) + base, base)
            seq.length = base + len(path)
            seq.steps += 1
            seq.verify_s += elapsed
            if len(tree):
                seq.spec.count_step(len(tree), len(path))
                self.stats.drafted_tokens += len(tree)
                self.stats.accepted_tokens += len(path)
                last = path[-1] if path else -1
                rejected = last in tree.parents
                self._observe(seq, len(path), rejected)
                seq.shadow = None
                sample = AcceptanceStats.of_step(len(tree), len(path), rejected, self._last_wait)
                add(samples, (seq.spec.proposer, seq.req.spec.workload_tag), sample)
                add(verified, seq.spec.proposer, sample)
            before = len(seq.output)
            emitted = [tree.tokens[k] for k in path] + [bonus]
            if seq.shadow is not None and not len(tree):
                shadow = self._follow_shadow(seq, emitted)
                if shadow is not None:
                    add(samples, (seq.spec.proposer, seq.req.spec.workload_tag), shadow)
            self._append(seq, emitted, lp)
            if seq.session is not None and not seq.done:
                seq.session.advance(seq.output[before:])
        self._record(samples, verified)
        if self.router is not None:
            for seq in seqs:
                if not seq.done and seq.req.spec.proposer != "none" and seq.steps % self.config.redecide_steps == 0:
                    self._redecide(seq, len(seqs))

    def _record(self, samples: dict[tuple[str, str], AcceptanceStats], verified: dict[str, AcceptanceStats]) -> None:
        """This step's acceptance into the router's statistics (buffered locally, flushed in the
        background) and the Prometheus counters: one call per proposer, never per token."""
        if self.router is not None:
            for (proposer, tag), sample in samples.items():
                self.router.record(proposer, tag, sample)
        if self.metrics is not None:
            for proposer, s in verified.items():
                self.metrics.speculation(proposer, int(s.steps), int(s.drafted), int(s.accepted), s.hits, s.trials)

    def _redecide(self, seq: _Sequence, batch: int) -> None:
        """The router revisits the request's proposer and k; a new proposer's stream starts lazily."""
        spec = seq.req.spec
        current = seq.spec.proposer if seq.session is not None else None
        d = self.router.decide(
            spec.proposer, spec.workload_tag, spec.num_speculative_tokens, batch, current, spec.unservable
        )
        if self.metrics is not None:
            self.metrics.decision(d.proposer, d.speculate)
        seq.k_cap = d.k if self.step_cost is not None else -1  # --spec-gating always: no cap
        if d.proposer in ("none", current) or d.proposer in seq.failed_proposers or self.open_session is None:
            return
        new = self.open_session(seq.req, d.proposer, [*seq.req.prompt_ids, *seq.output])
        if new is None:
            return
        self._end_session(seq)
        log.info("request %s: proposer %s → %s", seq.req.request_id, current or "none", d.proposer)
        seq.session, seq.spec.proposer = new, d.proposer
        seq.spec.per_proposer.setdefault(d.proposer, [0, 0, 0])
        seq.last_tree, seq.shadow = time.perf_counter(), None
        seq.accept_s, seq.accept_t = 2.0 * self.router.mean_alpha(d.proposer, spec.workload_tag), 2.0

    def _collect_trees(self, seqs: list[_Sequence]) -> list[TokenTree]:
        """Each request's tree for its current context; waits at most ``proposer_wait_ms`` for all."""
        live = [s for s in seqs if s.session is not None]
        for seq in live:
            if seq.session.failed is not None:
                self._drop_session(seq, seq.session.failed)
        # Wait for trees only where speculation may pay this step (by the cost model); others use
        # a tree only if it is already there (it still feeds the acceptance estimate).
        promising = [s for s in seqs if s.session is not None]
        if self.step_cost is not None and promising:
            chains = [  # as if every live proposer sent a full chain
                self._expected_by_width(s, list(range(-1, s.session.limits.max_depth - 1))) if s.session else [0.0]
                for s in seqs
            ]
            if choose_width(chains, self.step_cost) == 1:
                promising = []
        wanted = [(s.session, s.context_length) for s in promising]
        waited = wait_for_trees(self.trees_arrived, wanted, self.config.proposer_wait_ms / 1e3) if wanted else 0.0
        self._last_wait = waited
        now = time.perf_counter()
        trees = []
        for seq in seqs:
            tree = None
            if seq.session is not None:
                seq.spec.wait_s += waited
                recent = seq.output[-self.config.recent_tokens :] if seq.req.temperature == 0 else None
                tree = seq.session.take(seq.context_length, recent)
                if tree is not None:
                    seq.last_tree = now
                    # The router's k caps the tree; whether to speculate at all is the cost gate's call,
                    # from the request's own acceptance (which skipped trees keep scoring).
                    if 0 < seq.k_cap < len(tree):
                        tree = truncate(tree, seq.k_cap)
                elif now - max(seq.last_tree, seq.session.last_response) > self.config.proposer_timeout_s:
                    self._drop_session(
                        seq, f"proposer {seq.spec.proposer!r} answered nothing for {self.config.proposer_timeout_s} s"
                    )
            if tree is None or seq.length + 1 + len(tree) > self.max_context:
                tree = _EMPTY_TREE
            trees.append(tree)
        if self.step_cost is not None and any(trees):
            trees = self._gate(seqs, trees)
        return trees

    def _gate(self, seqs: list[_Sequence], trees: list[TokenTree]) -> list[TokenTree]:
        """Cut every tree to the batch's best step width (maybe 1: no speculation this step).

        Expected acceptance per row: a geometric model whose per-token rate α matches the
        request's accepted-per-step EWMA a (a = α / (1 − α)), over the depth the cut tree reaches.
        """
        expected = [self._expected_by_width(seq, tree.parents) for seq, tree in zip(seqs, trees, strict=True)]
        width = choose_width(expected, self.step_cost)
        out = []
        for seq, tree in zip(seqs, trees, strict=True):
            if len(tree) > width - 1:
                if width == 1 and seq.shadow is None:
                    seq.shadow = (tree, 0, 0)
                tree = truncate(tree, width - 1)
            out.append(tree)
        return out

    @staticmethod
    def _expected_by_width(seq: _Sequence, parents: list[int]) -> list[float]:
        """Expected accepted tokens when the tree is cut to its first w - 1 nodes, for each w:
        α(1 − α^depth) / (1 − α) for the depth the cut tree reaches."""
        alpha = min(seq.accept_s / seq.accept_t, 0.99)
        reach, e = 0, [0.0]
        for d in depths(parents):
            reach = max(reach, d)
            e.append(alpha * (1 - alpha**reach) / (1 - alpha))
        return e

    @staticmethod
    def _observe(seq: _Sequence, accepted: int, rejected: bool) -> None:
        """``accepted`` levels were (or would have been) taken; ``rejected``: the walk stopped at a
        node that had children (a failure), not at a leaf (censored)."""
        seq.accept_s += _EWMA * (accepted - seq.accept_s)
        seq.accept_t += _EWMA * (accepted + rejected - seq.accept_t)

    def _follow_shadow(self, seq: _Sequence, emitted: list[int]) -> AcceptanceStats | None:
        """Walk a skipped tree along the emitted tokens. Each step's matched levels update the
        request's acceptance estimate at once (censored while the walk goes on), so a request whose
        skipped trees keep guessing right turns speculation on within a few steps; once decided, the
        whole tree is returned as one sample for the router's statistics."""
        tree, node, matched = seq.shadow
        node, levels, rejected = follow(tree, node, emitted)
        self._observe(seq, levels, bool(rejected))
        if rejected is None:
            seq.shadow = (tree, node, matched + levels)
            return None
        seq.shadow = None
        return AcceptanceStats.of_step(len(tree), matched + levels, rejected)

    def _drop_session(self, seq: _Sequence, reason: str) -> None:
        seq.spec.fallback_reason = reason
        if seq.session is not None:
            self.stats.proposer_fallbacks += 1
            seq.failed_proposers.add(seq.session.name)
            if self.metrics is not None:
                self.metrics.fallback(seq.session.name, reason)
        self._end_session(seq, reason)

    def _end_session(self, seq: _Sequence, failure: str | None = None) -> None:
        """Close (or fail) the request's proposer stream, counting its invalid trees once."""
        session, seq.session = seq.session, None
        if session is None:
            return
        seq.spec.invalid_trees += session.invalid_trees
        self.stats.invalid_trees += session.invalid_trees
        if self.metrics is not None:
            self.metrics.invalid_tree(session.name, session.invalid_trees)
        if failure is None:
            session.close()
        else:
            session.fail(failure)

    def _accept(
        self, seqs: list[_Sequence], trees: list[TokenTree], logits: torch.Tensor, counts: list[int]
    ) -> list[tuple[list[int], int]]:
        """(accepted node path, bonus token) per request, losslessly (see ``acceptance``).

        On CUDA the whole batch is walked on the device (``kernels.tree_accept``, same uniforms and
        rules as the host walk) with one device-to-host copy; elsewhere on the host.
        """
        if logits.device.type == "cuda" and max(len(t) for t in trees) <= _KERNEL_MAX_NODES:
            return self._accept_on_device(seqs, trees, logits)
        argmax = logits.argmax(dim=-1).tolist()  # one host copy for every greedy decision
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        results: list[tuple[list[int], int] | None] = [None] * len(seqs)
        sampled = [i for i, s in enumerate(seqs) if s.req.temperature > 0]
        for i, tree in enumerate(trees):
            if seqs[i].req.temperature == 0:
                results[i] = greedy_accept(tree, argmax[starts[i] : starts[i + 1]])
        if sampled:
            dev = logits.device
            idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in sampled]).to(dev)
            per_row = [counts[i] for i in sampled]
            req = [seqs[i].req for i in sampled]
            filtered = filter_logits(
                logits[idx],
                _repeat([r.temperature for r in req], per_row, dev),
                _repeat([r.top_p for r in req], per_row, dev),
                _repeat([r.top_k for r in req], per_row, dev),
            )
            probs = torch.softmax(filtered, dim=-1)  # [sum over sampled rows, vocab]
            shapes = [walk_shape(trees[i]) for i in sampled]
            u = acceptance_uniforms(
                torch.tensor([r.seed for r in req]),
                torch.tensor([seqs[i].context_length for i in sampled]),
                max(d for d, _ in shapes),
                max(k for _, k in shapes),
            )
            offset = 0
            for j, i in enumerate(sampled):
                results[i] = sample_accept(trees[i], probs[offset : offset + counts[i]], u[j])
                offset += counts[i]
        return results  # type: ignore[return-value]

    @staticmethod
    def _accept_on_device(
        seqs: list[_Sequence], trees: list[TokenTree], logits: torch.Tensor
    ) -> list[tuple[list[int], int]]:
        from specmesh_kernels.tree_accept import PackedTrees, tree_accept, unpack_result

        dev, req = logits.device, [s.req for s in seqs]
        packed = PackedTrees.from_lists(
            [t.tokens for t in trees], [t.parents for t in trees], [t.dists for t in trees], device=dev
        )
        out = tree_accept(
            logits,
            packed,
            torch.tensor([r.temperature for r in req], device=dev),
            torch.tensor([r.top_p for r in req], device=dev),
            torch.tensor([r.top_k for r in req], device=dev),
            torch.tensor([r.seed for r in req], device=dev),
            torch.tensor([s.context_length for s in seqs], device=dev),  # the host walk's uniform counters
            max_nodes=max(len(t) for t in trees),
        )
        return unpack_result(out.cpu())  # the step's one device-to-host copy

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
            _repeat([r.temperature for r in req], per_row, dev),
            _repeat([r.top_p for r in req], per_row, dev),
            _repeat([r.top_k for r in req], per_row, dev),
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
        self._end_session(seq)  # the request is done: End the stream now
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
                spec=seq.spec,
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
        self._end_session(seq)
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
