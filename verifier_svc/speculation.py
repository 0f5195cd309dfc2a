"""Speculation control: the one owner of every speculation decision of every request.

The gRPC front asks it once per request (:meth:`SpeculationControl.start`: the router's first
choice, the proposer stream, its first estimate), then only submits; the engine asks it once per
decode step which tree each running request verifies (:meth:`~SpeculationControl.collect_trees`),
tells it what each step emitted (:meth:`~SpeculationControl.after_step`,
:meth:`~SpeculationControl.emitted`) and when a request ends (:meth:`~SpeculationControl.finish`),
and never reads into a request's state (``request_speculation.RequestSpeculation``). In between,
per request:

- the proposer stream (a ``ProposerSession``: a gRPC stream or an in-process proposer);
- its acceptance estimate per depth, seeded by the router's shared statistics and fed by every
  verified tree and by every skipped tree scored against the tokens emitted after it;
- the cost gate: trees are cut to the batch's best width by the measured step cost (maybe to
  nothing: plain decoding this step), from that estimate, or, for trees that carry the proposer's
  path probabilities, from those probabilities scaled by how well they have held for this request
  (``Trust``);
- the router's k, chosen at the start, caps the request's chain-model trees.

A request keeps the proposer it started with: re-deciding mid-request (switching proposers, or
refreshing k) measurably paid nothing (``docs/bench/router-ablation``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import grpc
import torch

from specmesh.v1 import proposer_pb2
from specmesh_router.cost_model import CostFn, LiveStepCost, choose_widths
from specmesh_router.estimate import expected_accepted
from specmesh_router.stats import AcceptanceStats
from specmesh_server import hidden as hidden_states
from specmesh_server.tree import TokenTree, truncate
from verifier_svc.proposer_client import GrpcProposerSession, wait_for_trees
from verifier_svc.request_speculation import RequestSpeculation, SessionFactory, Shadow, ended_by_proposer
from verifier_svc.requests import GenerationRequest

if TYPE_CHECKING:
    from specmesh_router.selection import Router
    from specmesh_server.metrics import VerifierMetrics
    from verifier_svc.sequence import Sequence

log = logging.getLogger(__name__)
EMPTY_TREE = TokenTree([], [])
# (request, its whole output, the proposers it had streams with): called once per finished request
OutputHook = Callable[[GenerationRequest, list[int], Collection[str]], None]


def silent_reason(proposer: str, timeout_s: float) -> str:
    """The fallback reason of a proposer that sent nothing for ``timeout_s`` (``/metrics`` counts it as a
    timeout: ``metrics.fallback_category``).

    >>> silent_reason("draft", 2.0)
    "proposer 'draft' answered nothing for 2.0 s"
    """
    return f"proposer {proposer!r} answered nothing for {timeout_s} s"


@dataclass(frozen=True)
class SpeculationConfig:
    proposer_wait_ms: float = 5.0  # per step, the longest wait for a request's tree
    proposer_timeout_s: float = 2.0  # no answer for this long → speculation off for the request
    recent_tokens: int = 32  # how far a late tree may be re-rooted (greedy requests)
    packed_steps: bool = True  # steps hold real tokens only (each row pays for its own tree): the gate sizes rows apart
    k_cap: bool = True  # the router's k caps chain-model trees (off: the gate alone sizes them; an ablation's knob)


class ProposerRefused(Exception):
    """The proposer the client named refused the request itself (a bad corpus, a foreign tokenizer)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class SpeculationControl:
    """Every request's speculation, from its first decision to its last session advance.

    ``router``: picks the proposer and k (None: requests run plain unless given a state).
    ``step_cost``: None verifies every tree, else trees are cut where they do not pay.
    ``open_session``: opens a request's proposer stream.
    ``trees_arrived``: the condition proposer sessions notify when a tree lands.
    ``learn``: told every finished request's output (``learning.OutputLearning.finished``).
    ``clock``: seconds, for proposer liveness and the wait for trees (a replay gives a modelled one).
    """

    def __init__(
        self,
        config: SpeculationConfig,
        router: Router | None = None,
        step_cost: LiveStepCost | None = None,
        metrics: VerifierMetrics | None = None,
        open_session: SessionFactory | None = None,
        trees_arrived: threading.Condition | None = None,
        learn: OutputHook | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config, self.router, self.step_cost = config, router, step_cost
        self.metrics, self.open_session, self.learn = metrics, open_session, learn
        self.trees_arrived = trees_arrived or threading.Condition()
        self.last_wait = 0.0  # seconds this step waited for trees
        self.clock = clock  # the sessions' ``last_response`` is on this clock too

    # --- the engine's questions -----------------------------------------------------------------
    def fit_runner(self, packs: bool) -> None:
        """The engine's runner is known: packed steps need its own attention (``packs``), so a model
        it cannot pack keeps padded steps."""
        self.config = replace(self.config, packed_steps=self.config.packed_steps and packs)

    @property
    def packed(self) -> bool:
        """Whether decode steps with ragged trees run packed (each row pays for its own tree)."""
        return self.config.packed_steps

    def speculating(self, seq: Sequence) -> bool:
        """Whether the request has a live proposer stream now (its trees may gain nodes this step)."""
        return seq.speculation.session is not None

    # --- the gRPC front, on the event loop ------------------------------------------------------
    async def start(self, req: GenerationRequest, batch: int) -> RequestSpeculation:
        """The router's first decision for ``req`` in a batch of ``batch`` rows and its proposer
        stream. Where the client named the proposer, waits up to 0.5 s for its first reply (one
        round trip, ~1 ms) so that a refusal reaches the client: :class:`ProposerRefused`."""
        params = req.spec_params
        if self.router is None:
            return RequestSpeculation.start()
        d = self.router.decide(
            params.proposer, params.workload_tag, params.num_speculative_tokens, batch, exclude=params.unservable
        )
        if self.metrics is not None:
            self.metrics.decision(d.proposer, d.speculate)
        # Why this request runs without speculation, unless the client asked for exactly that.
        why_plain = d.reason if d.proposer == "none" and params.proposer != "none" else ""
        session = self.open_session(req, d.proposer) if self.open_session else None
        if isinstance(session, GrpcProposerSession) and params.proposer == d.proposer:  # named by the client
            try:
                with contextlib.suppress(TimeoutError):  # slow → no wait
                    await asyncio.wait_for(asyncio.shield(session.first_reply), timeout=0.5)
            except asyncio.CancelledError:  # the client left while we waited: its stream must not outlive it
                session.close()
                raise
            if session.refused is not None:
                code, details = session.refused
                session.close()
                raise ProposerRefused(code, f"spec_decode.proposer {d.proposer!r} refused the request: {details}")
        estimate = self.router.estimate(d.proposer, params.workload_tag) if session is not None else None
        # --spec-gating always: the gate never cuts, nor does k
        k_cap = cap_of(d.k) if self.step_cost is not None and self.config.k_cap else None
        return RequestSpeculation.start(session, k_cap, estimate, why_plain)

    def abandon(self, state: RequestSpeculation) -> None:
        """A request that never reached the engine: close its stream."""
        self._end(state)

    # --- the engine thread: before the forward --------------------------------------------------
    def collect_trees(
        self,
        seqs: list[Sequence],
        max_context: int,
        constrain: Callable[[list[TokenTree]], list[TokenTree]] | None = None,
    ) -> list[TokenTree]:
        """Each request's tree for its current context; waits at most ``proposer_wait_ms`` for all.
        ``constrain``: cuts what the requests' grammars forbid from the trees (``grammar``), before
        the gate prices them; a tree so cut still counts as its proposer's whole tree."""
        for seq in seqs:
            if seq.speculation.session is not None and seq.speculation.session.failed is not None:
                self._drop(seq.speculation, seq.speculation.session.failed)
        # Wait for trees only where speculation may pay this step (by the cost model); others use
        # a tree only if it is already there (it still feeds the acceptance estimate).
        promising = [s for s in seqs if s.speculation.session is not None]
        if self.step_cost is not None and promising:
            chains = [  # as if every live proposer sent a full chain
                expected_accepted(s.speculation.estimate.alphas(s.speculation.session.limits.max_depth))
                if s.speculation.session
                else [0.0]
                for s in seqs
            ]
            if max(choose_widths(chains, self._cost(seqs), self.config.packed_steps)) == 1:
                promising = []
        wanted = [(s.speculation.session, s.context_length) for s in promising]
        t0 = self.clock()  # the wait as this control's clock sees it (a replay's stands still)
        if wanted:
            wait_for_trees(self.trees_arrived, wanted, self.config.proposer_wait_ms / 1e3)
        waited = self.clock() - t0 if wanted else 0.0
        self.last_wait = waited
        trees = []
        for seq in seqs:
            tree = self._take(seq, waited)
            trees.append(EMPTY_TREE if tree is None or seq.length + 1 + len(tree) > max_context else tree)
        if constrain is not None:
            cut = constrain(trees)
            for seq, before, after in zip(seqs, trees, cut, strict=True):
                if after is not before and seq.speculation.offered is before:
                    seq.speculation.offered = after
            trees = cut
        if self.step_cost is not None and any(trees):
            trees = self._gate(seqs, trees)
        return trees

    def _take(self, seq: Sequence, waited: float) -> TokenTree | None:
        """The request's tree for this step, if its proposer has one (capped by the router's k)."""
        state = seq.speculation
        state.gated_out = state.had_tree = False
        if state.session is None:
            return None
        state.counters.wait_s += waited
        recent = seq.output[-self.config.recent_tokens :] if seq.req.temperature == 0 else None
        tree = state.session.take(seq.context_length, recent)
        state.had_tree = tree is not None and len(tree) > 0
        # A re-rooted tree ends where the tree it was cut from ends: judge that one.
        sent = state.session.sent
        complete = tree is not None and sent is not None and ended_by_proposer(sent, state.session.limits)
        state.offered = tree if complete else None
        now = self.clock()
        if tree is not None:
            state.last_tree = now
            # The router's k caps a tree priced by the chain model; whether to speculate at all is
            # the cost gate's call, from the request's own acceptance (which skipped trees keep
            # scoring). A tree with path probabilities is sized by the gate alone: the router's k is
            # a chain's depth, and would cut the likeliest siblings of a bushy tree.
            if state.k_cap is not None and state.k_cap < len(tree) and not tree.probs:
                tree = truncate(tree, state.k_cap)
        elif now - max(state.last_tree, state.session.last_response) > self.config.proposer_timeout_s:
            timeout = self.config.proposer_timeout_s
            self._drop(state, silent_reason(state.counters.proposer, timeout))
        return tree

    def _cost(self, seqs: list[Sequence]) -> CostFn:
        """The step cost after this batch's longest context: attention reads it for every row."""
        assert self.step_cost is not None
        return self.step_cost.at(max(s.length for s in seqs) + 1)

    def _gate(self, seqs: list[Sequence], trees: list[TokenTree]) -> list[TokenTree]:
        """Cut every tree to its row's best step width (maybe 1: no speculation for it this step):
        one width for the batch where steps are padded, one per row where they are packed."""
        expected = [seq.speculation.expected(tree) for seq, tree in zip(seqs, trees, strict=True)]
        widths = choose_widths(expected, self._cost(seqs), self.config.packed_steps)
        out = []
        for seq, tree, width in zip(seqs, trees, widths, strict=True):
            state = seq.speculation
            if len(tree) > width - 1:
                if width == 1:
                    state.gated_out = bool(tree.probs)
                    if state.shadow is None:
                        state.shadow = Shadow(tree, state.complete(tree))
                tree = truncate(tree, width - 1)
            out.append(tree)
        return out

    # --- the engine thread: after the forward ---------------------------------------------------
    def observe_step(self, rows: int, width: float, seconds: float, widest: int, keys: int) -> None:
        """A decode step's measured time: the cost model follows what steps really take here."""
        if self.step_cost is not None:
            self.step_cost.observe(rows, width, seconds, widest, keys)

    def after_step(
        self, seqs: list[Sequence], trees: list[TokenTree], results: list[tuple[list[int], int]], seconds: float
    ) -> list[list[int]]:
        """Count and learn from what each request accepted; returns each request's emitted tokens
        (accepted nodes + bonus). Records the step's acceptance once per (proposer, tag), and what
        the step gave each request for ``seconds`` (the forward and acceptance) + the wait for trees."""
        samples: dict[tuple[str, str], AcceptanceStats] = {}  # per (proposer, tag): one record per step
        verified: dict[str, AcceptanceStats] = {}

        def add(into: dict[Any, AcceptanceStats], key: Any, sample: AcceptanceStats) -> None:
            into[key] = into[key] + sample if key in into else sample

        emitted_all = []
        for seq, tree, (path, bonus) in zip(seqs, trees, results, strict=True):
            state, tag = seq.speculation, seq.req.spec_params.workload_tag
            key = (state.counters.proposer, tag)
            if len(tree):
                state.counters.count_step(len(tree), len(path))
                last = path[-1] if path else -1
                rejected = last in tree.parents
                ended = not rejected and state.complete(tree)  # a leaf of the proposer's own tree
                state.observe(len(path), rejected, ended, tree)
                state.shadow = None
                sample = AcceptanceStats.of_step(len(tree), len(path), rejected, self.last_wait, ended)
                add(samples, key, sample)
                add(verified, state.counters.proposer, sample)
            elif (state.offered is not None and not len(state.offered)) or state.gated_out:  # nothing (worth it)
                state.estimate.observe_no_tree()
                add(samples, key, AcceptanceStats.no_tree())
            emitted = [tree.tokens[k] for k in path] + [bonus]
            if state.session is not None or len(tree):  # the step as the request got it
                served = AcceptanceStats.served(
                    len(emitted), len(tree), seconds + self.last_wait, len(seqs), tree=state.had_tree
                )
                add(samples, key, served)
            if state.shadow is not None and not len(tree):
                shadow = state.follow_shadow(emitted)
                if shadow is not None:
                    add(samples, key, shadow)
            emitted_all.append(emitted)
        if self.router is not None:
            for (proposer, tag), sample in samples.items():
                self.router.record(proposer, tag, sample)
        if self.metrics is not None:
            for proposer, s in verified.items():
                self.metrics.speculation(proposer, int(s.steps), int(s.drafted), int(s.accepted), s.hits, s.trials)
        return emitted_all

    def hidden_states(
        self, hidden: torch.Tensor, seqs: list[Sequence], rows: Callable[[int], list[int]]
    ) -> list[proposer_pb2.HiddenStates | None]:
        """Per request i, rows ``rows(i)`` of the step's real tokens' hidden states [sum(n_i + 1), h],
        encoded for its proposer where it asked for them (else None): one gather and one host copy
        for the whole batch."""
        sessions = [s.speculation.session for s in seqs]
        dtypes = [s.hidden_dtype if s is not None else None for s in sessions]
        takers = [i for i, d in enumerate(dtypes) if d is not None]
        out: list[proposer_pb2.HiddenStates | None] = [None] * len(seqs)
        if not takers:
            return out
        wire = {hidden_states.TORCH_DTYPES[dtypes[i]] for i in takers}
        wire_dtype = wire.pop() if len(wire) == 1 else torch.float32
        host = hidden_states.gather_rows(hidden, [rows(i) for i in takers], wire_dtype)
        if self.metrics is not None:
            self.metrics.hidden_copies.inc()
            self.metrics.hidden_rows.inc(sum(len(h) for h in host))
        for i, states in zip(takers, host, strict=True):
            out[i] = hidden_states.encode(states, dtypes[i])
        return out

    def emitted(
        self, seq: Sequence, tokens: list[int], hidden: proposer_pb2.HiddenStates | None, first: bool = False
    ) -> None:
        """The request's new tokens (``first``: its first, after the prompt) go to its proposer, whose
        context must include them; its liveness clock starts at the first."""
        state = seq.speculation
        if first:
            state.last_tree = self.clock()
        if state.session is not None and not seq.done and tokens:
            state.session.advance(tokens, hidden)

    # --- session lifecycle ----------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """The request finished: End its stream, and the proposers it had streams with learn its output."""
        self._end(seq.speculation)
        if self.learn is not None:
            self.learn(seq.req, seq.output, seq.speculation.counters.per_proposer.keys())

    def release(self, seq: Sequence) -> None:
        """The request left the engine (failed or cancelled): close its stream, if still open."""
        self._end(seq.speculation)

    def _drop(self, state: RequestSpeculation, reason: str) -> None:
        """The proposer failed the request: plain decoding from now on, and why."""
        state.counters.fallback_reason = reason
        if state.session is not None and self.metrics is not None:
            self.metrics.fallback(state.session.name, reason)
        self._end(state, reason)

    def _end(self, state: RequestSpeculation, failure: str | None = None) -> None:
        """Close (or fail) the request's proposer stream, counting its invalid trees once."""
        session, state.session = state.session, None
        if session is None:
            return
        state.counters.invalid_trees += session.invalid_trees
        if self.metrics is not None:
            self.metrics.invalid_tree(session.name, session.invalid_trees)
        if failure is None:
            session.close()
        else:
            session.fail(failure)


def cap_of(k: int) -> int | None:
    """The router's k as a tree cap: ≤ 0 is no cap (its "off" acts through the prior α instead).

    >>> cap_of(8), cap_of(0)
    (8, None)
    """
    return k if k > 0 else None
