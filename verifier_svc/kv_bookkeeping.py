"""The KV blocks of the engine's requests around a forward: growth before it, and after a decode
step's acceptance the accepted path's KV in order, the rejected tail's blocks back, the new full
blocks into the prefix cache; and all of a request's blocks back when it leaves the batch (``close``).

A decode step writes request i's pending token at position ``length`` and its tree's node k at
``length + 1 + k`` (``grow_for_trees`` gives it the blocks). Acceptance picks a path of nodes; their
KV moves into path order behind the pending token, one copy for the whole batch (``keep_accepted``),
so the request's cache holds its accepted tokens contiguously. Its length then passes the pending
token and the path, and the blocks past it go back to the pool (``settle``). Once the accepted tokens
are streamed, the blocks they filled are hashed into the prefix cache (``commit``).

Example (block size 4): a request at length 6 verifies a 5-node tree: positions 6…11, blocks for 12.
It accepts nodes [0, 2] (node 2's KV at position 9 moves to 8); its length becomes 6 + 1 + 2 = 9,
it keeps the 3 blocks that hold 9 positions, and its first 2 blocks (8 tokens) are full and committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verifier_svc.prefix_cache import cache_tokens

if TYPE_CHECKING:
    from specmesh_server.kv_blocks import BlockManager
    from specmesh_server.model_runner import ModelRunner
    from specmesh_server.paged_kv import PagedKVCache, PagedRows
    from specmesh_server.tree import TokenTree
    from verifier_svc.sequence import Sequence


def grow_for_prefill(cache: PagedKVCache, seqs: list[Sequence], chunks: list[list[int]]) -> PagedRows:
    """Blocks for each request's prompt chunk after its cached prefix, and the forward's rows."""
    ends = [s.length + len(c) for s, c in zip(seqs, chunks, strict=True)]
    for seq, end in zip(seqs, ends, strict=True):
        cache.manager.grow(seq.blocks, end)
    return cache.rows([s.blocks for s in seqs], max(ends))


def grow_for_trees(cache: PagedKVCache, seqs: list[Sequence], trees: list[TokenTree]) -> PagedRows:
    """Blocks for each request's pending token and tree after its cached prefix, and the step's rows
    (as wide as the widest: the pending token and the largest tree)."""
    for seq, tree in zip(seqs, trees, strict=True):
        cache.manager.grow(seq.blocks, seq.length + 1 + len(tree))
    width = 1 + max(len(t) for t in trees)
    return cache.rows([s.blocks for s in seqs], max(s.length for s in seqs) + width)


def accepted_positions(length: int, path: list[int]) -> list[int] | None:
    """Where the accepted ``path``'s nodes' KV sits after a step from ``length`` (node k at
    ``length + 1 + k``), to be moved to ``length + 1`` on; None where it already sits there.

    >>> accepted_positions(6, [0, 2]), accepted_positions(6, [0, 1]), accepted_positions(6, [])
    ([7, 9], None, None)
    """
    if path == list(range(len(path))):
        return None
    return [length + 1 + k for k in path]


def keep_accepted(runner: ModelRunner, seqs: list[Sequence], paths: list[list[int]]) -> None:
    """Move every request's accepted nodes' KV into path order, in one copy (before ``settle``)."""
    moves = [(s, accepted_positions(s.length, path)) for s, path in zip(seqs, paths, strict=True)]
    runner.move_positions([(s.blocks, src, s.length + 1) for s, src in moves if src is not None])


def settle(blocks: BlockManager, seq: Sequence, path: list[int]) -> None:
    """The request's cache now ends after its pending token and accepted ``path``: the blocks of the
    rejected nodes past it go back."""
    seq.length += 1 + len(path)
    blocks.shrink(seq.blocks, seq.length)


def commit(blocks: BlockManager, seq: Sequence) -> None:
    """The blocks the request's cached tokens filled join the prefix cache."""
    blocks.commit(seq.blocks, cache_tokens(seq)[: seq.length])


def close(blocks: BlockManager, seq: Sequence) -> None:
    """The request ended or waits again: all its blocks go back (its full ones stay cached)."""
    if seq.blocks is not None:
        blocks.close(seq.blocks)
        seq.blocks = None
