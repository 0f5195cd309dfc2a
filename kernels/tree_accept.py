"""Batched lossless acceptance of token trees on the device: a Triton kernel, its launcher, the torch reference.

Same semantics as the engine's host walk (``verifier_svc.acceptance``: ``greedy_accept``,
``sample_accept``), for every request of a step in one launch, with one device-to-host copy of the
result. That host walk is the one reference: the kernel tests compare against it draw for draw.
This module takes tensors only; the sampling policy (temperature / top-k / top-p, the seeded
uniforms) stays with the caller (``verifier_svc.batch_accept.accept_on_device``).

Layout (ragged, no padding): request ``b`` owns target rows ``row_offsets[b] .. row_offsets[b+1]-1``
(its pending token, then its ``n_b`` tree nodes) and nodes ``row_offsets[b] - b ..`` of ``tokens`` /
``parents`` (parents local to the tree, -1 = root). A stochastic request carries, per node, the
sparse distribution its proposer sampled from (``draft_ids`` / ``draft_probs``, ``[nodes, K]``,
padded with id -1); a deterministic one uses q = one-hot(token).

Split of work: everything parallel over rows happens in torch before the kernel (the caller's
filtered probabilities, argmax and table of uniforms; here row sums, q normalisation,
first-child / next-sibling links); the kernel does the sequential part, one program per request:
the walk down the tree with scalar loads, the child tests, the residual updates (in a float64
scratch row, written only at a level's first rejection; barriers around every write, since the
program's threads read back each other's stores) and the inverse-CDF bonus draw. Float sums
run in a different order than NumPy's, so a draw can differ from the host walk only when a uniform
falls within rounding (~1e-16) of a boundary.

Output: int64 ``[b, 2 + max_nodes]``: column 0 the number of accepted nodes, column 1 the bonus
token, columns ``2 ..`` the accepted node indices (0-based tree nodes, root to leaf).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specmesh_kernels._runtime import runnable

MAX_NODES = 63  # as tree attention: pending token + 63 nodes in one int64 bitmask


@dataclass(frozen=True)
class PackedTrees:
    """The trees of one step as flat device tensors (see the module docstring).

    row_offsets int32 [b + 1]; tokens int64 [nodes]; parents int32 [nodes]; stochastic bool [b];
    draft_ids int64 [nodes, K] and draft_probs float64 [nodes, K] (K >= 1; unused rows -1 / 0).
    """

    row_offsets: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    stochastic: torch.Tensor
    draft_ids: torch.Tensor
    draft_probs: torch.Tensor

    @property
    def max_nodes(self) -> int:
        return int((self.row_offsets[1:] - self.row_offsets[:-1]).max()) - 1 if self.row_offsets.numel() > 1 else 0

    @staticmethod
    def from_lists(
        tokens: list[list[int]],
        parents: list[list[int]],
        dists: list[list[tuple[list[int], list[float]]] | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> PackedTrees:
        """Pack per-request trees (``TokenTree`` fields) into one batch.

        >>> p = PackedTrees.from_lists([[7, 8], []], [[-1, 0], []])
        >>> p.row_offsets.tolist(), p.tokens.tolist(), p.parents.tolist(), p.stochastic.tolist()
        ([0, 3, 4], [7, 8], [-1, 0], [False, False])
        """
        dists = dists or [None] * len(tokens)
        for t in tokens:
            if len(t) > MAX_NODES:
                raise ValueError(f"{len(t)} nodes: tree acceptance takes at most {MAX_NODES}")
        k = max((len(ids) for ds in dists if ds for ids, _ in ds), default=1)
        n = sum(map(len, tokens))
        ids = torch.full((n, k), -1, dtype=torch.int64)
        probs = torch.zeros(n, k, dtype=torch.float64)
        node = 0
        for t, ds in zip(tokens, dists, strict=True):
            for i, (d_ids, d_probs) in enumerate(ds or []):
                ids[node + i, : len(d_ids)] = torch.tensor(d_ids, dtype=torch.int64)
                probs[node + i, : len(d_probs)] = torch.tensor(d_probs, dtype=torch.float64)
            node += len(t)
        rows = torch.tensor([0] + [len(t) + 1 for t in tokens]).cumsum(0)
        flat_tokens = [x for t in tokens for x in t]
        flat_parents = [x for p in parents for x in p]
        return PackedTrees(
            row_offsets=rows.to(device=device, dtype=torch.int32),
            tokens=torch.tensor(flat_tokens, dtype=torch.int64, device=device),
            parents=torch.tensor(flat_parents, dtype=torch.int32, device=device),
            stochastic=torch.tensor([d is not None for d in dists], dtype=torch.bool, device=device),
            draft_ids=ids.to(device),
            draft_probs=probs.to(device),
        )


def unpack_result(out: torch.Tensor) -> list[tuple[list[int], int]]:
    """Kernel output (on the host) → (accepted node path, bonus token) per request.

    >>> unpack_result(torch.tensor([[2, 9, 0, 3, -1], [0, 4, -1, -1, -1]]))
    [([0, 3], 9), ([], 4)]
    """
    rows = out.tolist()
    return [(r[2 : 2 + r[0]], r[1]) for r in rows]


@triton.jit
def _copy_row(Src, Dst, vocab, BLOCK_V: tl.constexpr):
    tl.debug_barrier()  # every thread's reads of Dst done before any thread overwrites it
    for start in range(0, vocab, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        tl.store(Dst + v, tl.load(Src + v, mask=v < vocab, other=0.0).to(tl.float64), mask=v < vocab)
    tl.debug_barrier()  # the row is read next by other threads of the program: its stores must land first


@triton.jit
def _row_sum(Src, vocab, BLOCK_V: tl.constexpr):
    total = tl.zeros([], dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        total += tl.sum(tl.load(Src + v, mask=v < vocab, other=0.0).to(tl.float64), 0)
    return total


@triton.jit
def _inverse_cdf(Src, vocab, u, BLOCK_V: tl.constexpr):
    """First index whose cumulative mass exceeds u * total (``sample_from_probs``), two passes."""
    total = tl.zeros([], dtype=tl.float64)
    for start in range(0, vocab, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        total += tl.sum(tl.load(Src + v, mask=v < vocab, other=0.0).to(tl.float64), 0)
    target = u * total
    carry = tl.zeros([], dtype=tl.float64)
    count = tl.zeros([], dtype=tl.int32)
    for start in range(0, vocab, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        vals = tl.load(Src + v, mask=v < vocab, other=0.0).to(tl.float64)
        cdf = carry + tl.cumsum(vals, 0)
        count += tl.sum(((cdf <= target) & (v < vocab)).to(tl.int32), 0)
        carry += tl.sum(vals, 0)
    return tl.minimum(count, vocab - 1)


@triton.jit
def _tree_accept_kernel(
    Probs,
    RowSum,
    Argmax,
    RowOff,
    Tokens,
    FirstChild,
    NextSibling,
    Stoch,
    DIds,
    DProbs,
    QX,
    Greedy,
    U,
    Scratch,
    Out,
    vocab,
    stride_p,
    stride_ub,
    stride_ud,
    out_width,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    row0 = tl.load(RowOff + b)
    node0 = row0 - b
    greedy = tl.load(Greedy + b) != 0
    stoch_i = tl.load(Stoch + b).to(tl.int32)
    stoch = stoch_i != 0
    u_row = U + b * stride_ub
    scratch = Scratch + b.to(tl.int64) * vocab
    kk = tl.arange(0, BLOCK_K)
    q_ok = (kk < K) & (kk * 0 + stoch_i != 0)  # (a scalar mask operand trips the interpreter)

    cur = tl.zeros([], dtype=tl.int32)  # 0 = root, node i = i + 1
    depth = tl.zeros([], dtype=tl.int32)
    done = tl.zeros([], dtype=tl.int32)
    bonus = tl.zeros([], dtype=tl.int64)
    while done == 0:
        row = (row0 + cur).to(tl.int64)
        p_row = Probs + row * stride_p
        child = tl.load(FirstChild + row)  # node index (0-based) or -1; siblings via NextSibling
        accepted = tl.full([], -1, dtype=tl.int32)
        if greedy:
            want = tl.load(Argmax + row)
            while child >= 0:
                if tl.load(Tokens + node0 + child) == want:
                    accepted = child
                    child = tl.full([], -1, dtype=tl.int32)
                else:
                    child = tl.load(NextSibling + node0 + child)
            bonus = want
        else:
            total = tl.load(RowSum + row)
            written = tl.zeros([], dtype=tl.int32)  # scratch holds this level's residual
            j = tl.zeros([], dtype=tl.int32)
            while child >= 0:
                x = tl.load(Tokens + node0 + child)
                u = tl.load(u_row + depth * stride_ud + j + 1)
                if written != 0:  # noqa: SIM108  (runtime conditions: no ternaries in Triton)
                    rx = tl.load(scratch + x)
                else:
                    rx = tl.load(p_row + x).to(tl.float64)
                if stoch:  # noqa: SIM108  u < r(x) / q(x)
                    ok = u * tl.load(QX + node0 + child) * total < rx
                else:  # q = one-hot(x): u < r(x)
                    ok = u * total < rx
                if ok:
                    accepted = child
                    child = tl.full([], -1, dtype=tl.int32)
                else:
                    if written == 0:
                        _copy_row(p_row, scratch, vocab, BLOCK_V)
                        written = tl.full([], 1, dtype=tl.int32)
                    if stoch:  # r <- max(r - q, 0)
                        qid = tl.load(DIds + (node0 + child) * K + kk, mask=q_ok, other=-1)  # [BK]
                        qp = tl.load(DProbs + (node0 + child) * K + kk, mask=q_ok, other=0.0)
                        valid = q_ok & (qid >= 0)
                        r_ids = tl.load(scratch + qid, mask=valid, other=0.0)
                        tl.debug_barrier()  # every thread has read r(x) before any overwrites it
                        tl.store(scratch + qid, tl.maximum(r_ids - qp * total, 0.0), mask=valid)
                        tl.debug_barrier()  # visible to every thread before the sum reads them
                        total = _row_sum(scratch, vocab, BLOCK_V)
                    else:
                        tl.debug_barrier()  # every thread has read r(x) before any overwrites it
                        tl.store(scratch + x, 0.0)
                        tl.debug_barrier()  # a later child's load of r(x) must see it
                        total = total - rx
                    if total <= 0.0:  # r == q exactly: start again from p (as the host walk does)
                        _copy_row(p_row, scratch, vocab, BLOCK_V)
                        total = tl.load(RowSum + row)
                    j += 1
                    child = tl.load(NextSibling + node0 + child)
            if accepted < 0:
                u0 = tl.load(u_row + depth * stride_ud)
                if written != 0:
                    bonus = _inverse_cdf(scratch, vocab, u0, BLOCK_V).to(tl.int64)
                else:
                    bonus = _inverse_cdf(p_row, vocab, u0, BLOCK_V).to(tl.int64)
        if accepted >= 0:
            tl.store(Out + b * out_width + 2 + depth, accepted.to(tl.int64))
            cur = accepted + 1
            depth += 1
        else:
            done = tl.full([], 1, dtype=tl.int32)
    tl.store(Out + b * out_width, depth.to(tl.int64))
    tl.store(Out + b * out_width + 1, bonus)


def tree_links(
    row_offsets: torch.Tensor, parents: torch.Tensor, max_nodes: int, n_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """First child of every row and next sibling of every node (local node indices, -1 = none), in torch.

    row_offsets int32 [b + 1]; parents int32 [nodes]; host bounds ``max_nodes`` (per tree) and
    ``n_rows`` (= row_offsets[-1]) → (first_child int32 [rows], next_sibling int32 [nodes]).

    >>> fc, ns = tree_links(torch.tensor([0, 4, 5]), torch.tensor([-1, 0, -1]), 3, 5)
    >>> fc.tolist(), ns.tolist()   # rows: root, node 0, node 1, node 2 | root of an empty tree
    ([0, 1, -1, -1, -1], [2, -1, -1])
    """
    dev = parents.device
    counts = (row_offsets[1:] - row_offsets[:-1] - 1).long()  # nodes per request [b]
    n_req, width = counts.shape[0], max(max_nodes, 1)
    req = torch.repeat_interleave(torch.arange(n_req, device=dev), counts, output_size=parents.shape[0])  # [nodes]
    local = (
        torch.arange(parents.shape[0], device=dev) - (row_offsets[:-1].long() - torch.arange(n_req, device=dev))[req]
    )
    par = torch.full((n_req, width), -2, dtype=torch.long, device=dev)  # [b, w], -2 = no node
    par[req, local] = parents.long()
    idx = torch.arange(width, device=dev)
    big = torch.full((), width, device=dev)
    # first child of index c (root = 0): smallest i with par[i] == c - 1
    is_child = par[:, None, :] == (torch.arange(width + 1, device=dev) - 1)[None, :, None]  # [b, w+1, w]
    first = torch.where(is_child, idx, big).amin(dim=-1)  # [b, w+1]
    first = torch.where(first == width, -1, first)
    row_req = torch.repeat_interleave(torch.arange(n_req, device=dev), counts + 1, output_size=n_rows)
    row_local = torch.arange(n_rows, device=dev) - row_offsets[:-1].long()[row_req]
    first_child = first[row_req, row_local]
    # next sibling of node i: smallest k > i with par[k] == par[i]
    same = (par[:, :, None] == par[:, None, :]) & (idx[None, None, :] > idx[None, :, None])  # [b, i, k]
    nxt = torch.where(same, idx, big).amin(dim=-1)
    nxt = torch.where(nxt == width, -1, nxt)
    return first_child.to(torch.int32), nxt[req, local].to(torch.int32)


@dataclass(frozen=True)
class WalkInputs:
    """What the kernel reads besides the target's rows, derived from the trees, the greedy flags and
    the uniforms (:func:`walk_inputs`) wherever those lie: on the host, so the caller can bring them to
    the device in one staged copy (every field a contiguous tensor; ``dataclasses.astuple`` order).

    row_offsets int32 [b + 1]; tokens int64 [nodes]; first_child int32 [rows]; next_sibling int32
    [nodes]; stochastic int8 [b]; draft_ids int64 [nodes, K]; q float64 [nodes, K] (normalised);
    qx float64 [nodes] (q of the node's own token); greedy int8 [b]; uniforms float64 [b, depth, salt].
    """

    row_offsets: torch.Tensor
    tokens: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    stochastic: torch.Tensor
    draft_ids: torch.Tensor
    q: torch.Tensor
    qx: torch.Tensor
    greedy: torch.Tensor
    uniforms: torch.Tensor


def walk_inputs(trees: PackedTrees, greedy: torch.Tensor, uniforms: torch.Tensor, max_nodes: int) -> WalkInputs:
    """The kernel's inputs that do not depend on the target (links, q normalised, flags), computed on
    the trees' device; ``max_nodes``: the host bound on nodes per tree.

    >>> w = walk_inputs(PackedTrees.from_lists([[7, 8]], [[-1, 0]]), torch.tensor([True]),
    ...                 torch.zeros(1, 3, 3, dtype=torch.float64), 2)
    >>> w.first_child.tolist(), w.next_sibling.tolist(), w.greedy.tolist()   # root → node 0 → node 1
    ([0, 1, -1], [-1, -1], [1])
    """
    n_req = trees.row_offsets.shape[0] - 1
    n_nodes = trees.tokens.shape[0]
    if trees.parents.shape != (n_nodes,):
        raise ValueError(f"parents must be [{n_nodes}], got {tuple(trees.parents.shape)}")
    if trees.draft_ids.shape != trees.draft_probs.shape or trees.draft_ids.shape[0] != n_nodes:
        raise ValueError("draft_ids / draft_probs must both be [nodes, K]")
    if greedy.shape != (n_req,):
        raise ValueError(f"greedy must be [{n_req}], got {tuple(greedy.shape)}")
    if max_nodes > MAX_NODES:
        raise ValueError(f"{max_nodes} nodes: tree acceptance takes at most {MAX_NODES}")
    n = max_nodes + 1
    if (
        uniforms.dtype != torch.float64
        or uniforms.dim() != 3
        or uniforms.shape[0] != n_req
        or min(uniforms.shape[1:]) < n
    ):
        raise ValueError(
            f"uniforms must be float64 [{n_req}, >= {n}, >= {n}], got {uniforms.dtype} {tuple(uniforms.shape)}"
        )
    q = trees.draft_probs.to(torch.float64)
    q = q / q.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)  # as the host walk normalises
    own = trees.draft_ids == trees.tokens[:, None]  # [nodes, K]: where each node's token sits in its q
    qx = torch.where(own, q, torch.zeros_like(q)).sum(dim=-1)  # [nodes] q(x) of the node's own token
    first_child, next_sibling = tree_links(trees.row_offsets, trees.parents, max_nodes, n_nodes + n_req)
    return WalkInputs(
        trees.row_offsets.to(torch.int32).contiguous(),
        trees.tokens.contiguous(),
        first_child.contiguous(),
        next_sibling.contiguous(),
        trees.stochastic.to(torch.int8),
        trees.draft_ids.contiguous(),
        q.contiguous(),
        qx.contiguous(),
        greedy.to(torch.int8),
        uniforms.contiguous(),
    )


def tree_accept_kernel_launch(
    probs: torch.Tensor,
    argmax: torch.Tensor,
    trees: PackedTrees,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    max_nodes: int | None = None,
    any_sampled: bool | None = None,
) -> torch.Tensor:
    """Acceptance of every tree of the batch in one launch: per request, the walk of
    ``verifier_svc.acceptance`` (greedy rows follow ``argmax``, sampled rows test children against
    ``probs`` and draw the bonus from the residual).

    probs: fp32/fp64 [rows, vocab] (last dim contiguous; the caller's filtered target
    distributions, rows of greedy requests unused); argmax int64 [rows]; greedy bool [b];
    uniforms float64 [b, max_nodes + 1, max_nodes + 1], entry [i, d, s] for request i's token at
    depth d (salt 0: the residual draw, salt 1 + j: the test of child j); ``max_nodes`` (host
    bound on nodes per tree; read from the device when omitted) → int64 [b, 2 + max_nodes] on the
    device, unused path entries -1. ``any_sampled``: host knowledge of whether ``greedy`` has a False
    (the size of the residual scratch); read from the device, a sync, when omitted.
    """
    if max_nodes is None:
        max_nodes = trees.max_nodes
    if any_sampled is None:
        any_sampled = bool((~greedy.to(torch.bool)).any())
    return walk_launch(probs, argmax, walk_inputs(trees, greedy, uniforms, max_nodes), max_nodes, any_sampled)


def walk_launch(
    probs: torch.Tensor, argmax: torch.Tensor, walk: WalkInputs, max_nodes: int, any_sampled: bool
) -> torch.Tensor:
    """The kernel over inputs already on ``probs``' device (:func:`walk_inputs`, e.g. computed on the
    host and copied in one go): the launch of :func:`tree_accept_kernel_launch`, without its
    preparation. Nothing here reads the device."""
    n_req = walk.row_offsets.shape[0] - 1
    rows, vocab = probs.shape
    if probs.dim() != 2 or probs.stride(1) != 1 or probs.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"probs must be fp32/fp64 [rows, vocab] with a contiguous vocab axis: {probs.shape}")
    if argmax.shape != (rows,) or argmax.dtype != torch.int64:
        raise ValueError(f"argmax must be int64 [{rows}], got {argmax.dtype} {tuple(argmax.shape)}")
    n_nodes = walk.tokens.shape[0]
    if rows != n_nodes + n_req:
        raise ValueError(f"{rows} target rows for {n_req} requests and {n_nodes} nodes (want nodes + requests)")
    dev = probs.device
    out = torch.full((n_req, 2 + max_nodes), -1, dtype=torch.int64, device=dev)
    if n_req == 0:
        return out
    row_sum = probs.sum(dim=-1, dtype=torch.float64)  # [rows]
    scratch = torch.empty(n_req if any_sampled else 1, vocab, dtype=torch.float64, device=dev)
    u = walk.uniforms  # [b, depth, salt]
    k = walk.draft_ids.shape[1]
    kernel = runnable(_tree_accept_kernel, dev)
    kernel[(n_req,)](
        probs,
        row_sum,
        argmax,
        walk.row_offsets,
        walk.tokens,
        walk.first_child,
        walk.next_sibling,
        walk.stochastic,
        walk.draft_ids,
        walk.q,
        walk.qx,
        walk.greedy,
        u,
        scratch,
        out,
        vocab,
        probs.stride(0),
        u.stride(0),
        u.stride(1),
        out.shape[1],
        K=k,
        BLOCK_K=max(2, triton.next_power_of_2(k)),
        BLOCK_V=1024,
    )
    return out
