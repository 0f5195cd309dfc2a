"""The proposers ``spec_replay`` runs, behind the verifier's ``ProposerSession`` interface.

The real n-gram index and suffix cache propose; :class:`ReplaySession` hands their trees to
``verifier_svc.speculation.SpeculationControl`` as a proposer stream would, with no latency: a
context's tree is there the moment the control asks for it. :class:`ModelClock` is the modelled
time the control, the sessions and the router's statistics share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from proposer_svc.suffix.cache import SuffixCache
from proposer_svc.suffix.calibration import learn_outcomes
from proposer_svc.suffix.request import SuffixRequest
from proposer_svc.suffix.trees import Proposal, union
from specmesh_server.ngram import NgramConfig, NgramIndex
from specmesh_server.tree import TokenTree, depths
from verifier_svc.proposer_client import ProposerLimits

NODES, DEPTH = 32, 24  # the verifier's default tree budget
LIMITS = ProposerLimits(vocab_size=1 << 20, max_nodes=NODES, max_depth=DEPTH)


@dataclass
class ModelClock:
    """Modelled seconds: moves only when the replay says a step took time.

    >>> clock = ModelClock(10.0)
    >>> clock.advance(0.04); round(clock(), 2)
    10.04
    """

    now: float = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Replayed(Protocol):
    """One request's proposer as the replay drives it."""

    def propose(self) -> TokenTree: ...

    def extend(self, tokens: list[int]) -> None: ...

    def close(self) -> None: ...


class NgramReplay:
    def __init__(self, context: list[int]) -> None:
        self.index = NgramIndex(NgramConfig(max_nodes=NODES, max_depth=DEPTH))
        self.index.extend(context)

    def propose(self) -> TokenTree:
        return TokenTree(*self.index.propose())

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def close(self) -> None:
        pass


class SuffixReplay:
    def __init__(self, context: list[int], cache: SuffixCache, scope: str) -> None:
        self.request = SuffixRequest(cache, scope)
        self.request.extend(context)

    def propose(self) -> TokenTree:
        p = self.request.propose(NODES, DEPTH)
        return TokenTree(p.tokens, p.parents, probs=p.probs)

    def extend(self, tokens: list[int]) -> None:
        self.request.extend(tokens)

    def close(self) -> None:
        self.request.close()


class DepthAcceptance:
    """Acceptance of n-gram nodes per depth given their parent's path was emitted, measured on every
    n-gram tree replayed so far; a node's path probability is the product along its path of
    (hits + prior · 0.5) / (trials + prior) at each depth.

    >>> acc = DepthAcceptance()
    >>> acc.learn(TokenTree([7, 8], [-1, 0]), [7, 5])  # depth 1 right, depth 2 wrong
    >>> [round(p, 3) for p in acc.probs([-1, 0])]  # (1 + 1) / (1 + 2), then (0 + 1) / (1 + 2) below it
    [0.667, 0.222]
    """

    def __init__(self, prior: float = 2.0) -> None:
        self.prior = prior
        self.hits, self.trials = np.zeros(DEPTH + 1), np.zeros(DEPTH + 1)  # [depth]

    def probs(self, parents: list[int]) -> list[float]:
        out: list[float] = []
        for p, d in zip(parents, depths(parents), strict=True):
            cond = float((self.hits[d] + self.prior * 0.5) / (self.trials[d] + self.prior))
            out.append(cond if p < 0 else cond * out[p])
        return out

    def learn(self, tree: TokenTree, emitted: list[int]) -> None:
        bins = np.asarray(depths(tree.parents), np.int64)
        tokens, parents = np.asarray(tree.tokens, np.int64), np.asarray(tree.parents, np.int64)
        learn_outcomes(tokens, parents, bins, np.asarray(emitted, np.int64), self.hits, self.trials)


class MergedReplay:
    """Each step the union of the suffix tree and the n-gram tree, within the same node budget."""

    def __init__(self, context: list[int], cache: SuffixCache, scope: str, ngram_depths: DepthAcceptance) -> None:
        self.suffix, self.ngram = SuffixReplay(context, cache, scope), NgramReplay(context)
        self.ngram_depths = ngram_depths
        self.last = TokenTree([], [])  # the n-gram tree of the step in flight

    def propose(self) -> TokenTree:
        own = self.suffix.request.propose(NODES, DEPTH)
        self.last = self.ngram.propose()
        priced = self.ngram_depths.probs(self.last.parents)
        lookup = Proposal(self.last.tokens, self.last.parents, priced, "ngram", 0, sum(priced))
        u = union(own, lookup, NODES)
        return TokenTree(u.tokens, u.parents, probs=u.probs)

    def extend(self, tokens: list[int]) -> None:
        if len(self.last):
            self.ngram_depths.learn(self.last, tokens)
        self.suffix.extend(tokens)
        self.ngram.extend(tokens)

    def close(self) -> None:
        self.suffix.close()


class ReplaySession:
    """A replayed proposer as a ``verifier_svc.request_speculation.ProposerSession``: the tree for
    the current context is ready at once and proposed when taken (once per context); the accepted
    tokens extend the proposer.

    >>> s = ReplaySession("ngram", NgramReplay([1, 2, 3, 1, 2]), 5, LIMITS, ModelClock())
    >>> s.has_tree_for(5), s.take(5).tokens, s.take(5)    # consumed
    (True, [3, 1, 2], None)
    >>> s.advance([3]); s.take(6).tokens
    [1, 2, 3]
    """

    hidden_dtype: int | None = None  # it takes no hidden states

    def __init__(
        self, name: str, proposer: Replayed, context_length: int, limits: ProposerLimits, clock: Callable[[], float]
    ) -> None:
        self.name, self.proposer, self.limits, self.clock = name, proposer, limits, clock
        self.context_length = context_length
        self.failed: str | None = None
        self.invalid_trees = 0
        self.sent: TokenTree | None = None
        self.last_response = clock()
        self.taken = False  # this context's tree was served
        self.closed = False

    def take(self, context_length: int, recent: list[int] | None = None) -> TokenTree | None:
        self.sent = None
        if self.has_tree_for(context_length):
            self.taken, self.sent = True, self.proposer.propose()
        return self.sent

    def has_tree_for(self, context_length: int) -> bool:
        return context_length == self.context_length and not self.taken and not self.closed

    def advance(self, tokens: list[int], hidden: object = None) -> None:
        self.proposer.extend(tokens)
        self.context_length += len(tokens)
        self.taken = False
        self.last_response = self.clock()

    def fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = f"proposer {self.name!r} failed: {reason}"
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.proposer.close()
