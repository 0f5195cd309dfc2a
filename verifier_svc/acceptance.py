"""Lossless acceptance of a verified token tree (pure functions, reference implementations).

Node indices: 0 is the root (the pending token), tree node i is index i + 1; row r of the
target's output describes the distribution of the token *after* index r.

Greedy: follow, from the root, the child whose token equals the target's argmax at its
parent; stop where none does. The bonus token is the argmax at the last accepted index.
The emitted tokens are exactly what plain greedy decoding would produce.

Sampling (SpecInfer's multi-step speculative sampling): at the current index with target
distribution p (residual r = p initially), try the children in order. Child x with proposal q
is accepted with probability min(1, r(x) / q(x)); on rejection r ← norm(max(r − q, 0)) and the
next child is tried. If all are rejected, the bonus is sampled from r; after an accepted leaf,
from p at that leaf. Deterministic children have q = one-hot(x), so the test is u < r(x) and
the residual zeroes x. Each emitted token is distributed exactly as p.
"""

from __future__ import annotations

import numpy as np
import torch

from specmesh_server.sampling import uniform
from specmesh_server.tree import TokenTree, depths


def children_lists(parents: list[int]) -> list[list[int]]:
    """Children (as node indices, root = 0) of each index, in tree order.

    >>> children_lists([-1, 0, -1])
    [[1, 3], [2], [], []]
    """
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i + 1)
    return kids


def greedy_accept(tree: TokenTree, argmax: list[int]) -> tuple[list[int], int]:
    """Accepted tree nodes (0-based, root to leaf) and the bonus token.

    argmax: the target's argmax after each index [root, node 0, …] (length n + 1).

    >>> tree = TokenTree(tokens=[7, 8, 9], parents=[-1, 0, -1])
    >>> greedy_accept(tree, argmax=[7, 8, 3, 4])   # root→7 ok, 7→8 ok, bonus after 8 is 3
    ([0, 1], 3)
    >>> greedy_accept(tree, argmax=[9, 0, 0, 5])   # second root child matches
    ([2], 5)
    """
    kids = children_lists(tree.parents)
    cur, path = 0, []
    while True:
        nxt = next((c for c in kids[cur] if tree.tokens[c - 1] == argmax[cur]), None)
        if nxt is None:
            return path, argmax[cur]
        path.append(nxt - 1)
        cur = nxt


def acceptance_uniforms(seeds: torch.Tensor, positions: torch.Tensor, n_depth: int, n_salt: int) -> torch.Tensor:
    """Uniforms for a batch of acceptance walks, in one vectorised call on the seeds' device (the
    host walk reads them as ``.numpy()``, the device kernel as they are).

    seeds, positions: int64 [b] → float64 [b, n_depth, n_salt], entry [i, d, s] =
    ``uniform(seed_i, position_i + d, salt=s)``: the token at sequence position
    ``position + d`` uses salt 1 + j to test its j-th child and salt 0 to draw from the
    residual, so plain decoding (no children) draws exactly as ``sample_next`` does.
    """
    b, dev = seeds.shape[0], seeds.device
    counters = (positions[:, None, None] + torch.arange(n_depth, device=dev)[None, :, None]).expand(b, n_depth, n_salt)
    salts = torch.arange(n_salt, device=dev)[None, None, :].expand(b, n_depth, n_salt)
    seeds3 = seeds[:, None, None].expand(b, n_depth, n_salt)
    return uniform(seeds3.reshape(-1), counters.reshape(-1), salts.reshape(-1)).view(b, n_depth, n_salt)


def walk_shape(tree: TokenTree) -> tuple[int, int]:
    """(depths, salts) a walk over ``tree`` may draw: max depth + 1, max children + 1."""
    return max(depths(tree.parents), default=0) + 1, max(map(len, children_lists(tree.parents))) + 1


def sample_accept(tree: TokenTree, probs: torch.Tensor, u: np.ndarray) -> tuple[list[int], int]:
    """Multi-step speculative sampling over one tree (the reference the kernel is tested against).

    probs: [n + 1, vocab] target distributions after each index (temperature/top-p/top-k
    already applied); u: [≥ depth + 1, ≥ max children + 1] uniforms from
    ``acceptance_uniforms`` (row d: the token at depth d; column 0 the residual draw,
    column 1 + j the test of child j).

    >>> p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float64)
    >>> tree = TokenTree(tokens=[2, 1], parents=[-1, -1])   # root children: 2 (p=0), then 1 (p=1)
    >>> u = acceptance_uniforms(torch.tensor([3]), torch.tensor([10]), *walk_shape(tree))[0].numpy()
    >>> sample_accept(tree, p, u)   # 2 rejected, 1 accepted, bonus from row 2
    ([1], 2)
    """
    kids = children_lists(tree.parents)
    rows = probs.detach().to("cpu", torch.float64).numpy()  # host walk over small trees
    cur, path = 0, []
    while True:
        depth = len(path)
        residual = rows[cur].copy()  # unnormalised: r = residual / total
        total = float(residual.sum())
        accepted = None
        for j, child in enumerate(kids[cur]):
            x = tree.tokens[child - 1]
            if tree.dists is None:  # q = one-hot(x): accept iff u < r(x); else zero x
                rx = float(residual[x])
                if u[depth, 1 + j] * total < rx:
                    accepted = child
                    break
                residual[x] = 0.0
                total -= rx
            else:
                ids, qp = tree.dists[child - 1]
                q = np.asarray(qp, dtype=np.float64)
                q /= q.sum()
                if u[depth, 1 + j] * float(q[ids.index(x)]) * total < float(residual[x]):  # u < r(x)/q(x)
                    accepted = child
                    break
                residual[ids] = np.maximum(residual[ids] - q * total, 0.0)  # max(r - q, 0), times total
                total = float(residual.sum())
            if total <= 0:  # r == q exactly (acceptance was certain): guard against rounding
                residual, total = rows[cur].copy(), float(rows[cur].sum())
        if accepted is None:
            cdf = np.cumsum(residual)
            bonus = int(np.searchsorted(cdf, u[depth, 0] * cdf[-1], side="right"))
            return path, min(bonus, len(cdf) - 1)
        path.append(accepted - 1)
        cur = accepted
