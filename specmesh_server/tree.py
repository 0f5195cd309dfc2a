"""Token trees as the verifier sees them: validation, depths, and the verification layout.

A tree is parallel arrays in topological order; ``parents[i] < i``, ``-1`` for children of
the root (the position right after the request's context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenTree:
    tokens: list[int]
    parents: list[int]
    # Per node (ids, probs): the sparse distribution the node was sampled from; None = deterministic.
    dists: list[tuple[list[int], list[float]]] | None = None
    # Per node: the proposer's estimate that the node's whole path is accepted (``path_probs``);
    # None = no estimate. Only the width gate reads it, never acceptance.
    probs: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class InvalidTree(ValueError):
    pass


def depths(parents: list[int]) -> list[int]:
    """Depth of each node, children of the root at depth 1.

    >>> depths([-1, 0, 0, 1, -1])
    [1, 2, 2, 3, 1]
    """
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def truncate(tree: TokenTree, n: int) -> TokenTree:
    """The first ``n`` nodes: still a tree, since parents precede children.

    >>> truncate(TokenTree([4, 5, 6], [-1, 0, -1], probs=[0.9, 0.6, 0.1]), 2)
    TokenTree(tokens=[4, 5], parents=[-1, 0], dists=None, probs=[0.9, 0.6])
    """
    if n >= len(tree):
        return tree
    return TokenTree(
        tree.tokens[:n],
        tree.parents[:n],
        tree.dists[:n] if tree.dists is not None else None,
        tree.probs[:n] if tree.probs is not None else None,
    )


def rebase(tree: TokenTree, tokens: list[int]) -> TokenTree | None:
    """The part of ``tree`` below the path spelled by ``tokens`` (which the context has since
    gained), re-rooted: a proposal that arrived a step late is still good where it guessed right.
    None when the path leaves the tree. Only for deterministic trees (greedy requests). Path
    probabilities become conditional on the new root.

    >>> t = TokenTree([5, 6, 7, 8, 9], [-1, 0, 1, 0, -1])   # 5→6→7, 5→8, 9
    >>> rebase(t, [5, 6])
    TokenTree(tokens=[7], parents=[-1], dists=None, probs=None)
    >>> rebase(TokenTree([5, 6, 8], [-1, 0, 0], probs=[0.8, 0.4, 0.2]), [5]).probs
    [0.5, 0.25]
    >>> rebase(t, [5]).parents, rebase(t, [5]).tokens
    ([-1, 0, -1], [6, 7, 8])
    >>> rebase(t, [4]) is None
    True
    """
    node = -1
    for tok in tokens:
        node = next((i for i, p in enumerate(tree.parents) if p == node and tree.tokens[i] == tok), None)
        if node is None:
            return None
    keep: dict[int, int] = {}  # old index → new index, for the descendants of ``node``
    parents: list[int] = []
    for i, p in enumerate(tree.parents):
        if p == node or p in keep:
            keep[i] = len(parents)
            parents.append(-1 if p == node else keep[p])
    probs = None
    if tree.probs is not None:
        base = tree.probs[node] if node >= 0 else 1.0
        probs = [min(1.0, tree.probs[i] / base) if base > 0 else 0.0 for i in keep]
    return TokenTree([tree.tokens[i] for i in keep], parents, probs=probs)


def follow(tree: TokenTree, node: int, tokens: list[int]) -> tuple[int, int, bool | None]:
    """Walk ``tokens`` down ``tree`` from ``node`` (0 = the root, i + 1 = node i): (the node reached,
    levels matched, outcome). Outcome None: still inside the tree; False: reached a leaf (nothing
    left to guess, censored); True: a token left the tree (a rejection).

    >>> t = TokenTree([5, 6, 7, 8], [-1, 0, 1, -1])   # 5→6→7, 8
    >>> follow(t, 0, [5])
    (1, 1, None)
    >>> follow(t, 1, [6, 7, 9])
    (3, 2, False)
    >>> follow(t, 1, [9])
    (1, 0, True)
    """
    levels = 0
    for tok in tokens:
        nxt = next((i + 1 for i, p in enumerate(tree.parents) if p + 1 == node and tree.tokens[i] == tok), None)
        if nxt is None:
            return node, levels, True
        node, levels = nxt, levels + 1
        if node - 1 not in tree.parents:
            return node, levels, False
    return node, levels, None


def validate_tree(tree: TokenTree, vocab_size: int, max_nodes: int, max_depth: int) -> list[int]:
    """Raise InvalidTree saying what is wrong; return the node depths.

    >>> validate_tree(TokenTree([5, 6], [-1, 0]), vocab_size=10, max_nodes=4, max_depth=4)
    [1, 2]
    >>> validate_tree(TokenTree([5, 6], [-1, 1]), 10, 4, 4)  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    specmesh_server.tree.InvalidTree: node 1: parent 1 is not an earlier node
    """
    n = len(tree.tokens)
    if len(tree.parents) != n:
        raise InvalidTree(f"{n} tokens but {len(tree.parents)} parents")
    if n > max_nodes:
        raise InvalidTree(f"{n} nodes, limit {max_nodes}")
    for i, (tok, par) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        if not -1 <= par < i:
            raise InvalidTree(f"node {i}: parent {par} is not an earlier node")
        if not 0 <= tok < vocab_size:
            raise InvalidTree(f"node {i}: token {tok} outside the vocabulary [0, {vocab_size})")
    d = depths(tree.parents)
    if d and max(d) > max_depth:
        raise InvalidTree(f"depth {max(d)}, limit {max_depth}")
    if tree.dists is not None:
        if len(tree.dists) != n:
            raise InvalidTree(f"{len(tree.dists)} distributions for {n} nodes")
        for i, (ids, probs) in enumerate(tree.dists):
            if len(ids) != len(probs) or not ids:
                raise InvalidTree(f"node {i}: distribution has {len(ids)} ids and {len(probs)} probs")
            if any(not 0 <= t < vocab_size for t in ids) or len(set(ids)) != len(ids):
                raise InvalidTree(f"node {i}: distribution ids must be distinct and inside the vocabulary")
            if any(not (p >= 0 and math.isfinite(p)) for p in probs) or abs(sum(probs) - 1) > 1e-3:
                raise InvalidTree(f"node {i}: distribution must be non-negative and sum to 1")
            mass = dict(zip(ids, probs, strict=True)).get(tree.tokens[i], 0.0)
            if mass <= 0:
                raise InvalidTree(f"node {i}: token {tree.tokens[i]} has zero proposal probability")
    if tree.probs is not None:
        if len(tree.probs) != n:
            raise InvalidTree(f"{len(tree.probs)} path probabilities for {n} nodes")
        if any(not 0 <= p <= 1 for p in tree.probs):  # NaN fails too
            raise InvalidTree("path probabilities must lie in [0, 1]")
    return d


def verification_layout(parents: list[int], prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and attention of [pending token, node 0, …, node n-1] over a cached prefix.

    The pending token (the newest accepted token, not yet cached) sits at ``prefix_len``; node i
    is written at ``prefix_len + 1 + i`` and takes position ``prefix_len + depth(i)``. Each new
    token sees the whole prefix, the pending token, its ancestors and itself.
    Returns positions int64 [n+1] and mask bool [n+1, prefix_len + n + 1].

    >>> pos, mask = verification_layout([-1, 0, -1], prefix_len=2)
    >>> pos.tolist()
    [2, 3, 4, 3]
    >>> mask.int().tolist()
    [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 1]]
    """
    n = len(parents)
    anc = torch.zeros(n + 1, n + 1, dtype=torch.bool)  # over [pending, nodes]
    anc[:, 0] = True
    for i, p in enumerate(parents):
        row = i + 1
        if p >= 0:
            anc[row] = anc[p + 1]
        anc[row, row] = True
    mask = torch.cat([torch.ones(n + 1, prefix_len, dtype=torch.bool), anc], dim=1)
    pos = torch.tensor([prefix_len] + [prefix_len + d for d in depths(parents)], dtype=torch.long)
    return pos, mask
