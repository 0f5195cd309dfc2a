"""The tree the suffix and RAG proposers build from a match: the trie of what followed each of its
occurrences, cut to its most frequent nodes.

``continuations`` gathers, for each occurrence, the ``depth`` tokens after it into one row,
stopped at the buffer's separator; ``heaviest_nodes`` merges the rows into a trie (a node: a
distinct row prefix, its share: the fraction of the rows through it) and keeps the nodes whose
share is at least ``min_share``, most frequent first, ties to the shallower then to the first seen
(rows in order, each from the root down), at most ``max_nodes``. A child never has a larger share
than its parent and is seen after it, so a parent always precedes its children: the nodes kept are
a tree, listed parents first.

The n-gram proposer's tree (``specmesh_server.ngram``) is a different ranking and stays there:
its occurrences weigh 1 + their relative recency and ties go to the first seen node, and it runs
in the verifier's process as plain Python (no compiler on its engine thread).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit


@dataclass(slots=True)
class TopNodes:
    """The nodes kept, most frequent first: each one's token, parent (an index into these arrays,
    -1 for a child of the root) and share (rows through it / rows)."""

    tokens: np.ndarray  # [nodes], the rows' dtype
    parents: np.ndarray  # [nodes] int32
    shares: np.ndarray  # [nodes] float64


@njit(cache=True, nogil=True)
def continuations(buf, starts, depth, out, row, sep):  # pragma: no cover - compiled
    """Writes the ``depth`` tokens after each start into ``out[row:]`` (``sep`` from the first
    separator or the buffer's end on); returns the next free row.

    >>> out = np.zeros((2, 3), np.int32)
    >>> continuations(np.array([1, 2, 99, 3], dtype=np.int32), np.array([0, 3]), 3, out, 0, 99)
    2
    >>> out.tolist()
    [[1, 2, 99], [3, 99, 99]]
    """
    for s in starts:
        if row >= out.shape[0]:
            break
        ended = False
        for d in range(depth):
            p = s + d
            if not ended and (p >= len(buf) or buf[p] == sep):
                ended = True
            out[row, d] = sep if ended else buf[p]
        row += 1
    return row


def heaviest_nodes(conts: np.ndarray, max_nodes: int, stop: int, min_share: float = 0.0) -> TopNodes:
    """The trie of ``conts`` rows ([rows, depth], each ended by ``stop``) cut to its most frequent
    nodes (see the module).

    Worked example: after the match, 4 occurrences continued ``7 8``, ``7 8``, ``7 9`` and ``5``:
    node 7 has a share of 3/4, its child 8 2/4, 9 and 5 1/4 each; 9 was seen first but 5 is
    shallower:

    >>> conts = np.array([[7, 8], [7, 8], [7, 9], [5, -1]])
    >>> top = heaviest_nodes(conts, max_nodes=3, stop=-1)
    >>> top.tokens.tolist(), top.parents.tolist(), top.shares.tolist()
    ([7, 8, 5], [-1, 0, -1], [0.75, 0.5, 0.25])
    >>> heaviest_nodes(conts, max_nodes=8, stop=-1, min_share=0.5).tokens.tolist()
    [7, 8]
    """
    size = max(max_nodes, 0)
    tokens, parents, shares = np.empty(size, conts.dtype), np.empty(size, np.int32), np.empty(size, np.float64)
    n = heaviest(conts, stop, min_share, tokens, parents, shares) if conts.size and size else 0
    return TopNodes(tokens[:n], parents[:n], shares[:n])


@njit(cache=True, nogil=True)
def heaviest(conts, stop, min_share, out_tokens, out_parents, out_shares):  # pragma: no cover - compiled
    """Writes the trie's most frequent nodes into the ``out_*`` arrays (at most their length);
    returns how many (see ``heaviest_nodes``)."""
    rows, depth = conts.shape
    cap = rows * depth + 1
    token = np.empty(cap, conts.dtype)
    parent = np.empty(cap, np.int32)
    level = np.empty(cap, np.int32)
    count = np.zeros(cap, np.int64)
    first_child = np.full(cap, -1, np.int32)
    next_sibling = np.full(cap, -1, np.int32)
    nodes = 1  # node 0: the root (the matched context)
    for r in range(rows):
        node = 0
        for d in range(depth):
            t = conts[r, d]
            if t == stop:
                break
            c = first_child[node]
            last = -1
            while c != -1 and token[c] != t:
                last = c
                c = next_sibling[c]
            if c == -1:
                c = nodes
                nodes += 1
                token[c], parent[c], level[c] = t, node, d
                if last == -1:
                    first_child[node] = c
                else:
                    next_sibling[last] = c
            count[c] += 1
            node = c
    # most frequent first; ties: shallower, then first seen (a parent always precedes its children)
    keep = np.empty(nodes, np.int64)
    k = 0
    for c in range(1, nodes):
        if count[c] >= min_share * rows:
            keep[k] = c
            k += 1
    keep = keep[:k]
    order = np.argsort((-count[keep] * (depth + 1) + level[keep]) * cap + keep)
    keep = keep[order[: len(out_tokens)]]
    out_index = np.full(nodes, -1, np.int64)
    for i in range(len(keep)):
        c = keep[i]
        out_index[c] = i
        out_tokens[i] = token[c]
        out_parents[i] = -1 if parent[c] == 0 else out_index[parent[c]]
        out_shares[i] = count[c] / rows
    return len(keep)
