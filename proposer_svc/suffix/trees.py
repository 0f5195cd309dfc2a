"""The suffix proposer's trees: one per source from the continuations of its best match
(``best_tree``, counted by the proposers' shared ``continuation_trie``), and the union of two.

The tree for a match length ℓ (``continuation_tree``) is the trie of the continuations of every
occurrence of the context's last ℓ tokens, a node's count being how many occurrences pass through
it; its probability is the product of count(child) / count(parent) along its path, which
telescopes to count(node) / count(root). Nodes below ``min_token_prob`` are never proposed,
the depth grows with ℓ (``spec_factor``), and the most probable nodes fill the verifier's budget
(a child is never more probable than its parent, so they form a tree). Each source proposes its
best-scoring tree (score = Σ node probabilities, the expected accepted tokens if the counts are
right), and their union is sent (``union``), each node with the larger of its two probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from proposer_svc.core.continuation_trie import continuations, heaviest_nodes
from proposer_svc.suffix.config import SuffixConfig
from proposer_svc.suffix.index import SEP
from proposer_svc.suffix.matches import Matches


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    parents: list[int]
    probs: list[float]  # per node: count(node) / count(root)
    source: str  # "request" | "global" | "" (no tree)
    match_length: int
    score: float  # Σ probs: the expected accepted tokens if the counts are right
    rows: int = 0  # occurrences the tree was counted from


EMPTY = Proposal([], [], [], "", 0, 0.0)


def continuation_tree(
    conts: np.ndarray, max_nodes: int, min_prob: float, source: str = "", match_length: int = 0
) -> Proposal:
    """The trie of ``conts`` rows ([occurrences, depth] int32, SEP-ended: the continuations of one
    match), its most probable nodes first.

    A node's probability is count / rows (the product of count(child) / count(parent) along its
    path). Nodes at or above ``min_prob`` are taken by probability (ties: shallower, then first
    seen), at most ``max_nodes``; a parent is never less probable than its child, so every parent
    precedes its children.

    Worked example: after the match, 4 occurrences continued ``7 8``, ``7 8``, ``7 9`` and ``5``:
    node 7 has probability 3/4, its child 8 2/4, 9 and 5 1/4 each:

    >>> t = continuation_tree(np.array([[7, 8], [7, 8], [7, 9], [5, SEP]], np.int32), max_nodes=3, min_prob=0.2)
    >>> t.tokens, t.parents, t.probs, t.score, t.rows
    ([7, 8, 5], [-1, 0, -1], [0.75, 0.5, 0.25], 1.5, 4)
    """
    top = heaviest_nodes(conts, max_nodes, SEP, min_prob)
    probs = top.shares
    return Proposal(
        top.tokens.tolist(), top.parents.tolist(), probs.tolist(), source, match_length, float(probs.sum()), len(conts)
    )


def _depth_for(match: int, cfg: SuffixConfig, max_depth: int) -> int:
    return max(1, min(max_depth, int(cfg.spec_factor * match) + cfg.spec_offset))


def best_tree(matches: Matches, source: str, cfg: SuffixConfig, max_nodes: int, max_depth: int) -> Proposal:
    """The tree of one source's occurrences for the longest match (≥ min_match); when fewer than
    ``min_support`` occurrences back it, also the tree of half that length, the better scoring one."""
    best = EMPTY
    for ell in (matches.longest, max(cfg.min_match, matches.longest // 2)):
        if ell < cfg.min_match or (best.source and ell == best.match_length):
            break
        depth = _depth_for(ell, cfg, max_depth)
        conts = np.empty((cfg.max_occurrences, depth), np.int32)  # [occurrences, depth]
        rows = 0
        for buf, starts in matches.at_least(ell):
            rows = continuations(buf, starts, depth, conts, rows, SEP)
        if not rows:
            continue
        tree = continuation_tree(conts[:rows], max_nodes, cfg.min_token_prob, source, ell)
        if tree.score > best.score:
            best = tree
        if rows >= cfg.min_support:
            break
    return best


@njit(cache=True, nogil=True)
def _union(ta, pa, qa, tb, pb, qb, max_nodes, out_t, out_p, out_q):  # pragma: no cover - compiled
    """Writes the union of trees a and b into the ``out_*`` arrays; returns its size (see ``union``)."""
    cap = len(ta) + len(tb)
    tok = np.empty(cap, np.int32)
    par = np.empty(cap, np.int64)
    prob = np.empty(cap, np.float64)
    depth = np.empty(cap, np.int64)
    n = len(ta)
    for i in range(n):
        tok[i], par[i], prob[i] = ta[i], pa[i], qa[i]
        depth[i] = 1 if pa[i] < 0 else depth[pa[i]] + 1
    where = np.empty(len(tb), np.int64)  # b's node → its node in the union
    for j in range(len(tb)):
        parent = -1 if pb[j] < 0 else where[pb[j]]
        found = -1
        for i in range(n):
            if par[i] == parent and tok[i] == tb[j]:
                found = i
                break
        if found >= 0:
            prob[found] = max(prob[found], qb[j])
        else:
            found = n
            tok[n], par[n], prob[n] = tb[j], parent, qb[j]
            depth[n] = 1 if parent < 0 else depth[parent] + 1
            n += 1
        where[j] = found
    # most probable first; ties: shallower, then a's before b's (a parent always precedes its
    # children). Insertion sort: at most 2 × max_nodes entries.
    order = np.arange(n)
    for k in range(1, n):
        i = order[k]
        m = k - 1
        while m >= 0 and (prob[order[m]] < prob[i] or (prob[order[m]] == prob[i] and depth[order[m]] > depth[i])):
            order[m + 1] = order[m]
            m -= 1
        order[m + 1] = i
    keep = min(n, max_nodes)
    new_index = np.full(n, -1, np.int64)
    for k in range(keep):
        i = order[k]
        new_index[i] = k
        out_t[k], out_q[k] = tok[i], prob[i]
        out_p[k] = -1 if par[i] < 0 else new_index[par[i]]
    return keep


def union(a: Proposal, b: Proposal, max_nodes: int) -> Proposal:
    """One tree holding both trees' branches (same root), a node's probability the larger of its
    two estimates, the most probable ``max_nodes`` kept (ancestor-closed: a child is never more
    probable than its parent in either tree, so neither in the union).

    Worked example: the request's chain 7 → 8 (1.0, 0.5) and the global tree's 7 (0.75), 5 (0.25):

    >>> t = union(Proposal([7, 8], [-1, 0], [1.0, 0.5], "request", 2, 1.5),
    ...           Proposal([7, 5], [-1, -1], [0.75, 0.25], "global", 3, 1.0), max_nodes=3)
    >>> t.tokens, t.parents, t.probs, t.source, t.score
    ([7, 8, 5], [-1, 0, -1], [1.0, 0.5, 0.25], 'request+global', 1.75)
    """
    if not a.tokens and not b.tokens:
        return EMPTY
    tokens, parents, probs = np.empty(max_nodes, np.int32), np.empty(max_nodes, np.int32), np.empty(max_nodes)
    n = _union(
        np.asarray(a.tokens, np.int32), np.asarray(a.parents, np.int64), np.asarray(a.probs, np.float64),
        np.asarray(b.tokens, np.int32), np.asarray(b.parents, np.int64), np.asarray(b.probs, np.float64),
        max_nodes, tokens, parents, probs,
    )  # fmt: skip
    probs = probs[:n]
    source = f"{a.source}+{b.source}" if a.tokens and b.tokens else a.source or b.source
    return Proposal(
        tokens[:n].tolist(),
        parents[:n].tolist(),
        probs.tolist(),
        source,
        max(a.match_length, b.match_length),
        float(probs.sum()),
    )
