"""KV memory in blocks: a fixed pool of fixed-size blocks, reference-counted, with an automatic prefix
cache over them (vLLM's automatic prefix caching; SGLang's radix reuse, at block granularity).

A request's KV lives in the blocks its *block table* lists, in order: position ``p`` is at offset
``p % block_size`` of block ``table[p // block_size]``. A block whose ``block_size`` positions all hold
accepted tokens is *full* and gets a content hash chained from the start of the prompt:

    h_0 = H(namespace)            namespace = model ‖ tenant ‖ salt
    h_i = H(h_(i-1) ‖ tokens of block i)

so two equal hashes mean the same tokens at the same positions after the same prefix, in the same
namespace. Full blocks are registered in a hash → block map. A new request walks its own hashes and
takes the longest run of registered blocks (a *hit*): it prefills only the rest, and at least its
last prompt token (the first step needs logits, the head proposer a hidden state). Speculative tree
nodes are written after the accepted tokens, in a request's private tail: a block is hashed only once
every one of its positions holds an accepted token, so a draft is never shared.

Blocks whose count of references drops to zero wait in a least-recently-used queue. One that still
carries a hash stays registered there (*evictable*: a later request may still hit it) until the
queue hands it out again; then its hash is dropped (an *eviction*). A block referenced by a running
request is never in the queue, so it is never evicted.

Isolation: a tenant's requests hash under their own namespace, so a prefix cached for one tenant
never serves another (a timing side channel would otherwise tell a tenant that another sent a
prompt). Pure Python, no tensors: the KV tensors indexed by these block ids live in ``paged_kv``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockHash = bytes


class NoFreeBlocks(MemoryError):
    """Asked for more blocks than are free or evictable."""


def namespace(model: str, tenant: str = "", salt: str = "") -> BlockHash:
    """The chain's seed ``h_0``: requests share cached blocks only within one (model, tenant, salt).

    >>> namespace("m", "a") == namespace("m", "a"), namespace("m", "a") == namespace("m", "b")
    (True, False)
    """
    return hashlib.blake2b(f"{model}\0{tenant}\0{salt}".encode(), digest_size=16).digest()


def block_hashes(tokens: Sequence[int], block_size: int, seed: BlockHash, start: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks of ``tokens`` from block ``start`` on; ``seed`` is ``h_(start-1)``
    (the namespace when ``start`` is 0). A partial last block has none.

    >>> ns = namespace("m")
    >>> h = block_hashes([1, 2, 3, 4, 5], 2, ns)
    >>> len(h), h == block_hashes([1, 2, 3, 4], 2, ns), h[1] == block_hashes([1, 2, 3, 4], 2, h[0], start=1)[0]
    (2, True, True)
    >>> block_hashes([9, 2, 3, 4], 2, ns)[1] == h[1]   # same tokens, another prefix: another hash
    False
    """
    out, parent = [], seed
    for b in range(start, len(tokens) // block_size):
        data = array("q", tokens[b * block_size : (b + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        out.append(parent)
    return out


@dataclass
class CacheCounters:
    """Prefix-cache counters in vLLM's terms, in tokens (queries: prompt tokens looked up)."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0  # blocks whose hash was dropped to reuse them


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` positions; ids 0..num_blocks-1 index the KV tensors.

    >>> pool = BlockPool(4, block_size=2)
    >>> a = pool.allocate(2)                       # a request's two blocks
    >>> pool.register(a[0], b"h0"); pool.free_blocks
    2
    >>> pool.release(a); pool.free_blocks          # ended: both free, block a[0] still cached
    4
    >>> pool.lookup([b"h0", b"h1"]) == a[:1]       # a later request hits the first block
    True
    """

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one position, not {num_blocks} × {block_size}")
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, caching
        self.refs = [0] * num_blocks
        self.hash_of: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}  # registered full blocks, in use or evictable
        self.queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # refs 0, LRU first
        self.counters = CacheCounters()

    @property
    def free_blocks(self) -> int:
        """Blocks a request may be given now: never used, or evictable."""
        return len(self.queue)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.queue)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The registered blocks of the longest prefix of ``hashes`` (no reference taken)."""
        out: list[int] = []
        if self.caching:
            for h in hashes:
                block = self.cached.get(h)
                if block is None:
                    break
                out.append(block)
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on each of ``blocks`` (a hit's): an evictable one leaves the queue."""
        for b in blocks:
            if self.refs[b] == 0:
                del self.queue[b]
            self.refs[b] += 1

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` blocks with one reference each. NoFreeBlocks (nothing taken) when fewer than ``n`` are free.

        Blocks go to a table in runs of consecutive ids where they can, so that attention reads them
        where they lie (``paged_kv``): first the blocks right after ``after`` (a table's last) while
        they are free and cache nothing (taking those evicts nothing out of its turn); the rest are the
        least recently used blocks, in ascending order (an evictable block's hash is dropped: an
        eviction). The order of a batch taken from the queue's head does not change which blocks are
        evicted, and a request's blocks, released last one first, come back as one run.

        >>> pool = BlockPool(8, block_size=2)
        >>> pool.release(pool.allocate(8)[::-1])     # the queue is now 7, 6, …, 0
        >>> pool.allocate(3), pool.allocate(2, after=0)
        ([5, 6, 7], [1, 2])
        """
        if n > len(self.queue):
            raise NoFreeBlocks(f"{n} KV blocks asked, {len(self.queue)} free of {self.num_blocks}")
        out = []
        b = -1 if after is None else after + 1
        while len(out) < n and 0 <= b < self.num_blocks and self.refs[b] == 0 and self.hash_of[b] is None:
            del self.queue[b]
            out.append(b)
            b += 1
        oldest = [self.queue.popitem(last=False)[0] for _ in range(n - len(out))]
        for b in oldest:
            h = self.hash_of[b]
            if h is not None:
                del self.cached[h]
                self.hash_of[b] = None
                self.counters.evictions += 1
        out += sorted(oldest)
        for b in out:
            self.refs[b] = 1
        return out

    def register(self, block: int, h: BlockHash) -> None:
        """Record that ``block`` (in use, full of accepted tokens) holds the chain's hash ``h``. Where
        another block already holds ``h`` (two requests computed the same prefix at once), that one
        stays the cached copy and this one stays private."""
        if self.caching and h not in self.cached and self.hash_of[block] is None:
            self.cached[h] = block
            self.hash_of[block] = h

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each of ``blocks``; those left with none join the queue's end in
        the order given (pass a table tail first: a prompt's later blocks are shared less, so they are
        evicted before its earlier ones)."""
        for b in blocks:
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} released with no reference")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.queue[b] = None

    def reset_cache(self) -> int:
        """Forget every evictable block's hash (blocks in use keep theirs); returns how many were dropped."""
        dropped = [b for b in self.queue if self.hash_of[b] is not None]
        for b in dropped:
            del self.cached[self.hash_of[b]]
            self.hash_of[b] = None
        return len(dropped)

    def check(self) -> None:
        """Assert the pool's invariants (tests; cheap enough for a debug run)."""
        assert all(r >= 0 for r in self.refs)
        assert set(self.queue) == {b for b, r in enumerate(self.refs) if r == 0}
        assert all(self.hash_of[b] == h for h, b in self.cached.items())
        assert sum(h is not None for h in self.hash_of) == len(self.cached)


@dataclass
class BlockTable:
    """One request's blocks: ``blocks[i]`` holds positions [i·block_size, (i+1)·block_size). The first
    ``len(hashes)`` are full of accepted tokens and registered (or were offered to be)."""

    seed: BlockHash
    blocks: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    cached_tokens: int = 0  # the prefix a hit brought at the request's start

    def slot(self, position: int, block_size: int) -> int:
        """The flat KV slot of ``position``: block id × block_size + offset.

        >>> BlockTable(b"", blocks=[7, 2]).slot(5, 4)
        9
        """
        return self.blocks[position // block_size] * block_size + position % block_size


class BlockManager:
    """The block tables of running requests over one pool: a hit at the start, blocks for growth,
    hashing of newly full blocks, and release at the end.

    >>> m = BlockManager(BlockPool(8, block_size=4))
    >>> ns = namespace("m")
    >>> first = m.open(ns, list(range(10)))                      # nothing cached yet
    >>> m.grow(first, 11); m.commit(first, list(range(11))); first.cached_tokens, len(first.blocks)
    (0, 3)
    >>> m.close(first)
    >>> second = m.open(ns, list(range(9)) + [99, 98])           # same first 9 tokens: 2 blocks hit
    >>> second.cached_tokens, m.pool.counters.hits
    (8, 8)
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions.

        >>> BlockManager(BlockPool(1, 16)).blocks_for(33)
        3
        """
        return -(-positions // self.pool.block_size)

    def peek(self, seed: BlockHash, prompt: Sequence[int]) -> list[int]:
        """The blocks :meth:`open` would hit now, without taking them or counting a query."""
        return self.pool.lookup(block_hashes(prompt[: max(len(prompt) - 1, 0)], self.block_size, seed))

    def open(self, seed: BlockHash, prompt: Sequence[int]) -> BlockTable:
        """A table for a new (or returning) request: its longest cached prefix, at most all but the
        last prompt token (which is always computed), acquired."""
        hashes = block_hashes(prompt[: max(len(prompt) - 1, 0)], self.block_size, seed)
        hit = self.pool.lookup(hashes)
        self.pool.acquire(hit)
        self.pool.counters.queries += len(prompt)
        self.pool.counters.hits += len(hit) * self.block_size
        return BlockTable(seed, list(hit), hashes[: len(hit)], len(hit) * self.block_size)

    def grow(self, table: BlockTable, positions: int) -> None:
        """Give ``table`` blocks for ``positions`` positions in all (NoFreeBlocks, nothing taken, if
        the pool cannot)."""
        missing = self.blocks_for(positions) - len(table.blocks)
        if missing > 0:
            table.blocks += self.pool.allocate(missing, after=table.blocks[-1] if table.blocks else None)

    def shrink(self, table: BlockTable, positions: int) -> None:
        """Release the blocks past ``positions`` (a verification step's rejected tail)."""
        keep = max(self.blocks_for(positions), len(table.hashes))
        if keep < len(table.blocks):
            tail = table.blocks[keep:]
            del table.blocks[keep:]
            self.pool.release(tail[::-1])

    def commit(self, table: BlockTable, tokens: Sequence[int]) -> None:
        """``tokens``: the request's accepted tokens whose KV is written (prompt, then output). Hashes
        and registers the blocks they now fill."""
        full = min(len(tokens) // self.block_size, len(table.blocks))
        if full <= len(table.hashes):
            return
        start = len(table.hashes)
        new = block_hashes(
            tokens[: full * self.block_size], self.block_size, table.hashes[-1] if start else table.seed, start
        )
        for i, h in enumerate(new, start):
            self.pool.register(table.blocks[i], h)
        table.hashes += new

    def close(self, table: BlockTable) -> None:
        """The request ended or was preempted: every block goes back (its full ones stay cached)."""
        self.pool.release(table.blocks[::-1])
        table.blocks, table.hashes = [], []
