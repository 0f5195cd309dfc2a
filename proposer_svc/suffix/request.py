"""One stream's state in the suffix proposer (``SuffixRequest``): its context, its live entry in
the global cache, and the trees it sent, scored when the tokens after them arrive."""

from __future__ import annotations

import numpy as np

from proposer_svc.suffix.buffer import TokenBuffer
from proposer_svc.suffix.cache import SuffixCache
from proposer_svc.suffix.calibration import Scored
from proposer_svc.suffix.trees import Proposal, best_tree, union


class SuffixRequest:
    """One stream's state: its context (prompt + accepted) and its live entry in the global cache."""

    def __init__(self, cache: SuffixCache, scope: str) -> None:
        self.cache, self.scope = cache, scope
        self.context = TokenBuffer(1024)
        self.key = cache.begin(scope)
        self.started = False
        self.pending: list[Scored] = []  # the last proposal's source trees, scored when tokens follow

    @property
    def context_length(self) -> int:
        return self.context.n

    def extend(self, tokens: list[int]) -> None:
        cal = self.cache.calibration
        if cal is not None and self.pending:
            emitted = np.asarray(tokens, np.int64)
            for scored in self.pending:
                cal.learn(scored, emitted)
        self.pending = []
        self.context.extend(tokens)
        if self.started or self.cache.config.cache_prompts:
            self.cache.extend(self.scope, self.key, tokens)
        self.started = True

    def propose(self, max_nodes: int | None = None, max_depth: int | None = None) -> Proposal:
        cfg = self.cache.config
        nodes = min(max_nodes or cfg.max_nodes, cfg.max_nodes)
        depth = min(max_depth or cfg.max_depth, cfg.max_depth)
        ctx = self.context.view()
        # One tree per source, then their union (a node as probable as its likelier source says): a
        # request copying its own prompt is not outvoted by the many global occurrences of a short
        # match, nor the reverse, and the verifier's gate cuts the union by those probabilities.
        own = best_tree(self.context.matches(ctx, cfg), "request", cfg, nodes, depth)
        shared = best_tree(self.cache.matches(self.scope, ctx, self.key), "global", cfg, nodes, depth)
        cal = self.cache.calibration
        if cal is not None:
            (own, a), (shared, b) = cal.apply(own), cal.apply(shared)
            self.pending = [x for x in (a, b) if x is not None]
        return union(own, shared, nodes)

    def close(self) -> np.ndarray:
        return self.cache.finish(self.scope, self.key)
