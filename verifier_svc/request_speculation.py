"""One request's speculation state: its proposer stream, its acceptance estimate and the
bookkeeping the cost gate prices its trees with.

- :class:`ProposerSession`: the proposer as the engine thread sees it (a gRPC stream or an
  in-process proposer): trees in, accepted tokens out;
- :class:`RequestSpeculation`: per request, that session, its counters, its acceptance estimate per
  depth (``specmesh_router.estimate.RequestEstimate``), the ``Trust`` its proposer's path
  probabilities have earned, and the ``Shadow`` walk of a tree the gate skipped;
- :func:`expected_by_width`: what the gate expects a tree to give at each width it may be cut to.

Owned and driven by ``speculation.SpeculationControl``; the engine holds one per request
(``Sequence.speculation``) and never reads into it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specmesh.v1 import proposer_pb2
from specmesh_router.estimate import RequestEstimate, expected_accepted, levels_sample
from specmesh_router.stats import AcceptanceStats
from specmesh_server.tree import TokenTree, depths, follow
from verifier_svc.events import ProposerCounts, SpecCounters
from verifier_svc.proposer_client import ProposerLimits
from verifier_svc.requests import GenerationRequest


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


# (request, proposer name) → a new stream, or None where that proposer is not configured.
SessionFactory = Callable[[GenerationRequest, str], ProposerSession | None]


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
class RequestSpeculation:
    """One request's speculation: its proposer stream, counters and acceptance estimate."""

    session: ProposerSession | None = None
    counters: SpecCounters = field(default_factory=SpecCounters)
    last_tree: float = 0.0  # perf_counter of the last tree taken (liveness)
    estimate: RequestEstimate = field(default_factory=lambda: RequestEstimate((0.5,)))
    trust: Trust = field(default_factory=Trust)  # for trees with path probabilities
    shadow: Shadow | None = None
    k_cap: int | None = None  # the router's draft tokens per step; None: no cap
    # This step's tree as the proposer sent it, where the proposer ended it within the verifier's
    # budget (empty: it had none); None: no tree, or one the budget may have cut.
    offered: TokenTree | None = None
    # This step's tree carried path probabilities and the gate cut all of it: to the router (and
    # the request's estimate), a step the proposer had nothing worth verifying for.
    gated_out: bool = False
    # This step the proposer had a tree for the request (verified, or cut by the gate).
    had_tree: bool = False

    @classmethod
    def start(
        cls,
        session: ProposerSession | None = None,
        k_cap: int | None = None,
        estimate: RequestEstimate | None = None,
        why_plain: str = "",
    ) -> RequestSpeculation:
        """``session``: the request's proposer stream (None: plain decoding). ``k_cap``: the router's
        draft tokens per step, a cap on every chain-model tree (None: none). ``estimate``: seeded
        from the proposer's shared statistics (None: α = 0.5 at every depth); where the router says
        speculation does not pay, it starts low and the cost gate decodes plainly until the trees
        the request skips prove it wrong. ``why_plain``: why the request has no proposer, where
        the client asked for one."""
        counters = SpecCounters(proposer=session.name if session else "none", fallback_reason=why_plain)
        state = cls(session=session, counters=counters, k_cap=k_cap)
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
