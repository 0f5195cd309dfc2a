"""Per-request speculation control: which tree each running request verifies this step.

The engine asks once per decode step (:meth:`SpeculationControl.collect_trees`) and reports what
each step accepted (:meth:`SpeculationControl.after_step`). In between, per request:

- the proposer stream (a :class:`ProposerSession`: a gRPC stream or an in-process proposer);
- its acceptance estimate per depth (``specmesh_router.estimate.RequestEstimate``), seeded by the
  router's shared statistics and fed by every verified tree and by every skipped tree scored
  against the tokens emitted after it;
- the cost gate: trees are cut to the batch's best width by the measured step cost (maybe to
  nothing: plain decoding this step), from that estimate, or, for trees that carry the proposer's
  path probabilities, from those probabilities scaled by how well they have held for this request
  (``Trust``);
- every ``redecide_steps`` steps the router revisits the proposer and k from the same estimate (a
  new proposer's stream opens with a fresh estimate from the shared statistics).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from specmesh.v1 import proposer_pb2
from specmesh_router.cost_model import CostFn, LiveStepCost, choose_widths
from specmesh_router.estimate import RequestEstimate, expected_accepted, levels_sample
from specmesh_router.stats import AcceptanceStats
from specmesh_server.tree import TokenTree, depths, follow, truncate
from verifier_svc.events import EngineStats, ProposerCounts, SpecCounters
from verifier_svc.proposer_client import ProposerLimits, wait_for_trees
from verifier_svc.requests import GenerationRequest

if TYPE_CHECKING:
    from specmesh_router.selection import Router
    from specmesh_server.metrics import VerifierMetrics
    from verifier_svc.sequence import Sequence

log = logging.getLogger(__name__)
EMPTY_TREE = TokenTree([], [])


class ProposerSession(Protocol):
    """One request's proposer, as the engine thread sees it: trees in, accepted tokens out.

    Implemented by the gRPC stream (``proposer_client.GrpcProposerSession``) and the in-process
    n-gram proposer (``local_proposer.LocalProposerSession``).
    """

    name: str
    limits: ProposerLimits
    failed: str | None  # why the stream failed; None while it works
    invalid_trees: int
    last_response: float  # perf_counter of its last answer (liveness)
    # The dtype the proposer asked its hidden states in (``HiddenStateRequest``); None: it takes none.
    hidden_dtype: int | None
    # The tree as the proposer sent it that the last ``take`` served (before any re-rooting).
    sent: TokenTree | None

    def take(self, context_length: int, recent: list[int] | None = None) -> TokenTree | None: ...

    def has_tree_for(self, context_length: int) -> bool: ...

    def advance(self, tokens: list[int], hidden: proposer_pb2.HiddenStates | None = None) -> None: ...

    def fail(self, reason: str) -> None: ...

    def close(self) -> None: ...


# (request, proposer name, context) → a new stream, or None where that proposer is not configured.
SessionFactory = Callable[[GenerationRequest, str, list[int]], ProposerSession | None]


@dataclass
class Shadow:
    """A tree the gate skipped, walked along the tokens emitted after it."""

    tree: TokenTree
    complete: bool = False  # the tree as the proposer ended it (see ``ended_by_proposer``)
    node: int = 0  # the walk's current node (-1: the root)
    matched: int = 0  # levels matched so far


MAX_TRUST = 1.5  # an underconfident proposer's probabilities are raised at most this much


@dataclass
class Trust:
    """How far a proposer's path probabilities hold for one request: (accepted + 1) / (predicted + 1)
    over its recent trees (each sum decays by ``keep`` per tree), at most ``MAX_TRUST``. An honest,
    calibrated proposer stays near 1; one that claims certainty and misses drops within a tree or
    two, and the gate then cuts its trees as its record says.

    >>> t = Trust()
    >>> t.value
    1.0
    >>> t.observe([1.0] * 8, 0); round(t.value, 2)  # claimed 8 accepted tokens, got none
    0.11
    """

    accepted: float = 0.0
    predicted: float = 0.0
    keep: float = 0.8

    def observe(self, probs: list[float], accepted: int) -> None:
        """A verified (or skipped and walked) tree: its nodes' path probabilities, the levels taken."""
        self.accepted = self.accepted * self.keep + accepted
        self.predicted = self.predicted * self.keep + sum(probs)

    @property
    def value(self) -> float:
        return min(MAX_TRUST, (self.accepted + 1.0) / (self.predicted + 1.0))


@dataclass
class SpecState:
    """One request's speculation: its proposer stream, counters and acceptance estimate."""

    session: ProposerSession | None = None
    counters: SpecCounters = field(default_factory=SpecCounters)
    last_tree: float = 0.0  # perf_counter of the last tree taken (liveness)
    estimate: RequestEstimate = field(default_factory=lambda: RequestEstimate((0.5,)))
    trust: Trust = field(default_factory=Trust)  # for trees with path probabilities
    shadow: Shadow | None = None
    k_cap: int | None = None  # the router's draft tokens per step; None: no cap
    failed_proposers: set[str] = field(default_factory=set)
    # This step's tree as the proposer sent it, where the proposer ended it within the verifier's
    # budget (empty: it had none); None: no tree, or one the budget may have cut.
    offered: TokenTree | None = None
    # This step's tree carried path probabilities and the gate cut all of it: to the router (and
    # the request's estimate), a step the proposer had nothing worth verifying for.
    gated_out: bool = False
    # This step the proposer had a tree for the request (verified, or cut by the gate).
    had_tree: bool = False

    @classmethod
    def start(cls, session: ProposerSession | None, k_cap: int | None, estimate: RequestEstimate | None) -> SpecState:
        """``estimate``: seeded from the proposer's shared statistics (None: α = 0.5 at every depth).
        Where the router says speculation does not pay, it starts low and the cost gate decodes
        plainly until the trees the request skips prove it wrong."""
        state = cls(session=session, counters=SpecCounters(proposer=session.name if session else "none"), k_cap=k_cap)
        if session is not None:
            state.counters.per_proposer[session.name] = ProposerCounts()
        if estimate is not None:
            state.estimate = estimate
        return state

    def observe(self, accepted: int, rejected: bool, ended: bool, tree: TokenTree | None = None) -> None:
        """A verified tree: ``accepted`` levels taken; ``rejected``: the walk stopped at a node that
        had children (a miss), not at a leaf (censored, or an end where the proposer ``ended``)."""
        self.estimate.observe(levels_sample(0, accepted, rejected, ended))
        if tree is not None and tree.probs:
            self.trust.observe(tree.probs, accepted)

    def expected(self, tree: TokenTree) -> list[float]:
        """The gate's expected accepted tokens for each width of ``tree`` (``expected_by_width``): the
        request's α's price a chain-model tree, its Trust one with path probabilities (no α read)."""
        if tree.probs:
            return expected_by_width((), tree.parents, tree.probs, self.trust.value)
        return expected_by_width(self.estimate.alphas(max(depths(tree.parents), default=1)), tree.parents)

    def complete(self, tree: TokenTree) -> bool:
        """Whether ``tree`` (verified or skipped this step) is the proposer's whole tree."""
        return self.offered is not None and len(self.offered) == len(tree)

    def follow_shadow(self, emitted: list[int]) -> AcceptanceStats | None:
        """Walk the skipped tree along the emitted tokens. Each step's matched levels update the
        estimate at once, at the depths they reached (censored while the walk goes on), so a request
        whose skipped trees keep guessing right turns speculation on within a few steps; once
        decided, the whole tree is returned as one sample for the router's statistics.

        A tree with path probabilities feeds its request's ``Trust`` only: the gate prices such
        trees by their probabilities, not by α, and the router counts the step as one without a
        tree worth verifying (``gated_out``), which is what the proposer's steps cost under the gate."""
        shadow = self.shadow
        assert shadow is not None
        node, levels, rejected = follow(shadow.tree, shadow.node, emitted)
        ended = shadow.complete and rejected is False
        priced = bool(shadow.tree.probs)
        if not priced:
            self.estimate.observe(levels_sample(shadow.matched, levels, bool(rejected), ended))
        if rejected is None:
            shadow.node, shadow.matched = node, shadow.matched + levels
            return None
        self.shadow = None
        if priced:
            self.trust.observe(shadow.tree.probs, shadow.matched + levels)
            return None
        return AcceptanceStats.of_step(len(shadow.tree), shadow.matched + levels, rejected, ended=ended)


def ended_by_proposer(tree: TokenTree, limits: ProposerLimits) -> bool:
    """Whether the proposer ended ``tree`` itself: fewer nodes and levels than the verifier's budget
    allowed, so its leaves are where it had nothing more (not where the budget stopped it).

    >>> limits = ProposerLimits(vocab_size=100, max_nodes=4, max_depth=3)
    >>> ended_by_proposer(TokenTree([5, 6], [-1, 0]), limits), ended_by_proposer(TokenTree([], []), limits)
    (True, True)
    >>> ended_by_proposer(TokenTree([5, 6, 7], [-1, 0, 1]), limits)    # as deep as allowed
    False
    """
    return len(tree) < limits.max_nodes and max(depths(tree.parents), default=0) < limits.max_depth


def expected_by_width(
    alphas: Sequence[float], parents: list[int], probs: list[float] | None = None, trust: float = 1.0
) -> list[float]:
    """Expected accepted tokens when a tree is cut to its first w - 1 nodes, for each w
    (``alphas[d - 1]`` = α_d, the request's acceptance at depth d; deeper, the last one repeats).

    Without ``probs``: the chain model Σ_{d=1..r} Π_{j≤d} α_j for the depth r the cut tree reaches
    (siblings add nothing). With the proposer's path probabilities p_i (the probability that node
    i's whole path is accepted): E(w) = Σ_{i<w} min(1, trust · p_i), the expected number of
    accepted nodes, ``trust`` being how far this request's trees have borne them out (``Trust``).
    The α's do not enter: they average confident and hopeless trees alike, where the proposer
    knows which is which (a long match against a one-token guess).

    >>> [round(e, 2) for e in expected_by_width([0.5], [-1, 0, -1])]  # a chain of 2 and a sibling
    [0.0, 0.5, 0.75, 0.75]
    >>> [round(e, 2) for e in expected_by_width([0.8, 0.5], [-1, 0, -1], [0.75, 0.5, 0.25])]
    [0.0, 0.75, 1.25, 1.5]
    >>> [round(e, 2) for e in expected_by_width([0.8, 0.5], [-1, 0, -1], [0.75, 0.5, 0.25], trust=0.5)]
    [0.0, 0.38, 0.62, 0.75]
    """
    if probs is not None:
        out = [0.0]
        for p in probs:
            out.append(out[-1] + min(1.0, trust * p))
        return out
    d = depths(parents)
    reach = max(d, default=0)
    chain = expected_accepted([*alphas[:reach], *[alphas[-1]] * (reach - len(alphas))])
    out, r = [0.0], 0
    for di in d:
        r = max(r, di)
        out.append(chain[r])
    return out


@dataclass(frozen=True)
class SpeculationConfig:
    proposer_wait_ms: float = 5.0  # per step, the longest wait for a request's tree
    proposer_timeout_s: float = 2.0  # no answer for this long → speculation off for the request
    redecide_steps: int = 8  # the router revisits a request's proposer and k this often (steps)
    recent_tokens: int = 32  # how far a late tree may be re-rooted (greedy requests)
    packed_steps: bool = True  # steps hold real tokens only (each row pays for its own tree): the gate sizes rows apart


class SpeculationControl:
    """The engine thread's per-step speculation decisions for every running request."""

    def __init__(
        self,
        config: SpeculationConfig,
        stats: EngineStats,
        trees_arrived: threading.Condition,
        step_cost: LiveStepCost | None = None,
        router: Router | None = None,
        metrics: VerifierMetrics | None = None,
        open_session: SessionFactory | None = None,
    ) -> None:
        self.config, self.stats, self.trees_arrived = config, stats, trees_arrived
        self.step_cost = step_cost  # None: verify every tree; else speculate only where it pays
        self.router, self.metrics, self.open_session = router, metrics, open_session
        self.last_wait = 0.0  # seconds this step waited for trees

    # --- before the forward -----------------------------------------------------------------
    def collect_trees(self, seqs: list[Sequence], max_context: int) -> list[TokenTree]:
        """Each request's tree for its current context; waits at most ``proposer_wait_ms`` for all."""
        for seq in seqs:
            if seq.spec.session is not None and seq.spec.session.failed is not None:
                self.drop_session(seq, seq.spec.session.failed)
        # Wait for trees only where speculation may pay this step (by the cost model); others use
        # a tree only if it is already there (it still feeds the acceptance estimate).
        promising = [s for s in seqs if s.spec.session is not None]
        if self.step_cost is not None and promising:
            chains = [  # as if every live proposer sent a full chain
                expected_accepted(s.spec.estimate.alphas(s.spec.session.limits.max_depth)) if s.spec.session else [0.0]
                for s in seqs
            ]
            if max(choose_widths(chains, self._cost(seqs), self.config.packed_steps)) == 1:
                promising = []
        wanted = [(s.spec.session, s.context_length) for s in promising]
        waited = wait_for_trees(self.trees_arrived, wanted, self.config.proposer_wait_ms / 1e3) if wanted else 0.0
        self.last_wait = waited
        now = time.perf_counter()
        trees = []
        for seq in seqs:
            tree, spec = None, seq.spec
            spec.gated_out = spec.had_tree = False
            if spec.session is not None:
                spec.counters.wait_s += waited
                recent = seq.output[-self.config.recent_tokens :] if seq.req.temperature == 0 else None
                tree = spec.session.take(seq.context_length, recent)
                spec.had_tree = tree is not None and len(tree) > 0
                # A re-rooted tree ends where the tree it was cut from ends: judge that one.
                sent = spec.session.sent
                complete = tree is not None and sent is not None and ended_by_proposer(sent, spec.session.limits)
                spec.offered = tree if complete else None
                if tree is not None:
                    spec.last_tree = now
                    # The router's k caps a tree priced by the chain model; whether to speculate at all
                    # is the cost gate's call, from the request's own acceptance (which skipped trees
                    # keep scoring). A tree with path probabilities is sized by the gate alone: the
                    # router's k is a chain's depth, and would cut the likeliest siblings of a bushy tree.
                    if spec.k_cap is not None and spec.k_cap < len(tree) and not tree.probs:
                        tree = truncate(tree, spec.k_cap)
                elif now - max(spec.last_tree, spec.session.last_response) > self.config.proposer_timeout_s:
                    self.drop_session(
                        seq,
                        f"proposer {spec.counters.proposer!r} answered nothing for {self.config.proposer_timeout_s} s",
                    )
            if tree is None or seq.length + 1 + len(tree) > max_context:
                tree = EMPTY_TREE
            trees.append(tree)
        if self.step_cost is not None and any(trees):
            trees = self._gate(seqs, trees)
        return trees

    def _cost(self, seqs: list[Sequence]) -> CostFn:
        """The step cost after this batch's longest context: attention reads it for every row."""
        assert self.step_cost is not None
        return self.step_cost.at(max(s.length for s in seqs) + 1)

    def _gate(self, seqs: list[Sequence], trees: list[TokenTree]) -> list[TokenTree]:
        """Cut every tree to its row's best step width (maybe 1: no speculation for it this step):
        one width for the batch where steps are padded, one per row where they are packed."""
        expected = [seq.spec.expected(tree) for seq, tree in zip(seqs, trees, strict=True)]
        widths = choose_widths(expected, self._cost(seqs), self.config.packed_steps)
        out = []
        for seq, tree, width in zip(seqs, trees, widths, strict=True):
            if len(tree) > width - 1:
                if width == 1:
                    seq.spec.gated_out = bool(tree.probs)
                    if seq.spec.shadow is None:
                        seq.spec.shadow = Shadow(tree, seq.spec.complete(tree))
                tree = truncate(tree, width - 1)
            out.append(tree)
        return out

    # --- after the forward ------------------------------------------------------------------
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
            spec, tag = seq.spec, seq.req.spec.workload_tag
            if len(tree):
                spec.counters.count_step(len(tree), len(path))
                self.stats.drafted_tokens += len(tree)
                self.stats.accepted_tokens += len(path)
                last = path[-1] if path else -1
                rejected = last in tree.parents
                ended = not rejected and spec.complete(tree)  # a leaf of the proposer's own tree
                spec.observe(len(path), rejected, ended, tree)
                spec.shadow = None
                sample = AcceptanceStats.of_step(len(tree), len(path), rejected, self.last_wait, ended)
                add(samples, (spec.counters.proposer, tag), sample)
                add(verified, spec.counters.proposer, sample)
            elif (spec.offered is not None and not len(spec.offered)) or spec.gated_out:  # nothing (worth it)
                spec.estimate.observe_no_tree()
                add(samples, (spec.counters.proposer, tag), AcceptanceStats.no_tree())
            emitted = [tree.tokens[k] for k in path] + [bonus]
            if spec.session is not None or len(tree):  # the step as the request got it
                served = AcceptanceStats.served(
                    len(emitted), len(tree), seconds + self.last_wait, len(seqs), tree=spec.had_tree
                )
                add(samples, (spec.counters.proposer, tag), served)
                spec.estimate.count_step(spec.had_tree)
            if spec.shadow is not None and not len(tree):
                shadow = spec.follow_shadow(emitted)
                if shadow is not None:
                    add(samples, (spec.counters.proposer, tag), shadow)
            emitted_all.append(emitted)
        if self.router is not None:
            for (proposer, tag), sample in samples.items():
                self.router.record(proposer, tag, sample)
        if self.metrics is not None:
            for proposer, s in verified.items():
                self.metrics.speculation(proposer, int(s.steps), int(s.drafted), int(s.accepted), s.hits, s.trials)
        return emitted_all

    def redecide_due(self, seqs: list[Sequence]) -> None:
        """Every ``redecide_steps`` steps of a request, the router revisits its proposer and k."""
        if self.router is None:
            return
        for seq in seqs:
            if not seq.done and seq.req.spec.proposer != "none" and seq.steps % self.config.redecide_steps == 0:
                self._redecide(seq, len(seqs))

    def _redecide(self, seq: Sequence, batch: int) -> None:
        """A new proposer's stream starts lazily; its prior α comes from the shared statistics."""
        spec, state = seq.req.spec, seq.spec
        current = state.counters.proposer if state.session is not None else None
        d = self.router.decide(
            spec.proposer,
            spec.workload_tag,
            spec.num_speculative_tokens,
            batch,
            current,
            spec.unservable,
            estimate=state.estimate if current is not None else None,
        )
        if self.metrics is not None:
            self.metrics.decision(d.proposer, d.speculate)
        state.k_cap = cap_of(d.k) if self.step_cost is not None else None  # --spec-gating always: no cap
        if d.proposer in ("none", current) or d.proposer in state.failed_proposers or self.open_session is None:
            return
        new = self.open_session(seq.req, d.proposer, [*seq.req.prompt_ids, *seq.output])
        if new is None:
            return
        self.end_session(seq)
        log.info("request %s: proposer %s → %s", seq.req.request_id, current or "none", d.proposer)
        state.session, state.counters.proposer = new, d.proposer
        state.counters.per_proposer.setdefault(d.proposer, ProposerCounts())
        state.last_tree, state.shadow = time.perf_counter(), None
        state.estimate = self.router.estimate(d.proposer, spec.workload_tag)

    # --- session lifecycle ------------------------------------------------------------------
    def drop_session(self, seq: Sequence, reason: str) -> None:
        """The proposer failed the request: plain decoding from now on, and why."""
        state = seq.spec
        state.counters.fallback_reason = reason
        if state.session is not None:
            self.stats.proposer_fallbacks += 1
            state.failed_proposers.add(state.session.name)
            if self.metrics is not None:
                self.metrics.fallback(state.session.name, reason)
        self.end_session(seq, reason)

    def end_session(self, seq: Sequence, failure: str | None = None) -> None:
        """Close (or fail) the request's proposer stream, counting its invalid trees once."""
        state = seq.spec
        session, state.session = state.session, None
        if session is None:
            return
        state.counters.invalid_trees += session.invalid_trees
        self.stats.invalid_trees += session.invalid_trees
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
