"""An unindexed buffer of tokens that is searched as it grows (``TokenBuffer``): a request's
context, a request's live output, the cache's tail not yet sealed; its numba hash chains."""

from __future__ import annotations

import numpy as np
from numba import njit

from proposer_svc.suffix.config import SuffixConfig
from proposer_svc.suffix.index import SEP
from proposer_svc.suffix.matches import NO_MATCH, Matches


@njit(cache=True, nogil=True)
def _slot(keys, key):  # pragma: no cover - compiled
    """Open addressing, linear probing: the slot holding ``key`` or the empty one where it goes."""
    mask = len(keys) - 1
    i = (key * 0x9E3779B97F4A7C15) >> 40 & mask
    while keys[i] != -1 and keys[i] != key:
        i = (i + 1) & mask
    return i


@njit(cache=True, nogil=True)
def _index_bigrams(data, chain, keys, heads, start, n):  # pragma: no cover - compiled
    """Chains every bigram ending in [start, n): ``chain[p]`` = the previous end of the same bigram."""
    for p in range(max(start, 1), n):
        a, b = data[p - 1], data[p]
        chain[p] = -1
        if a == SEP or b == SEP:
            continue
        key = (np.int64(a) << 21) | b
        i = _slot(keys, key)
        if keys[i] == key:
            chain[p] = heads[i]
        keys[i] = key
        heads[i] = p


@njit(cache=True, nogil=True)
def _rehash(keys, heads, new_keys, new_heads):  # pragma: no cover - compiled
    for i in range(len(keys)):
        if keys[i] != -1:
            j = _slot(new_keys, keys[i])
            new_keys[j] = keys[i]
            new_heads[j] = heads[i]


@njit(cache=True, nogil=True)
def _find(data, chain, keys, heads, n, ctx, max_match, min_end, starts, lengths):  # pragma: no cover - compiled
    """The most recent occurrences of ``ctx``'s last two tokens in ``data[:n]`` that end at or after
    ``min_end`` and have a next token: writes their continuation starts and match lengths (≤
    max_match tokens of ``ctx``'s suffix), at most ``len(starts)``; returns how many."""
    if len(ctx) < 2:
        return 0
    key = (np.int64(ctx[len(ctx) - 2]) << 21) | ctx[len(ctx) - 1]
    i = _slot(keys, key)
    if keys[i] != key:
        return 0
    m = min(max_match, len(ctx))
    found = 0
    p = heads[i]
    while p != -1 and p >= min_end and found < len(starts):
        if p < n - 1:
            ell = 2
            while ell < m and p - ell >= 0 and data[p - ell] == ctx[len(ctx) - 1 - ell]:
                ell += 1
            starts[found] = p + 1
            lengths[found] = ell
            found += 1
        p = chain[p]
    return found


def _table_size(capacity: int) -> int:
    """A power of two (``_slot`` masks) of at least 4 slots per position.

    >>> _table_size(16), _table_size(17)
    (64, 128)
    """
    return 1 << (4 * capacity - 1).bit_length()


class TokenBuffer:
    """An int32 array grown by doubling (``view()`` is the filled part) with a hash chain per
    bigram (as LZ77 compressors keep): the occurrences of a context's last two tokens, most
    recent first, without a scan. Every match is at least ``min_match`` = 2 tokens long."""

    __slots__ = ("chain", "data", "heads", "keys", "n")

    def __init__(self, capacity: int = 256) -> None:
        capacity = max(capacity, 16)
        self.data = np.empty(capacity, np.int32)
        self.chain = np.empty(capacity, np.int32)  # [capacity]: previous end of the same bigram, -1
        size = _table_size(capacity)
        self.keys = np.full(size, -1, np.int64)  # hash table: bigram → its latest end; load ≤ 1/4
        self.heads = np.empty(size, np.int32)
        self.n = 0

    def extend(self, tokens) -> None:
        k = len(tokens)
        if self.n + k > len(self.data):
            cap = max(2 * len(self.data), self.n + k)
            for name in ("data", "chain"):
                grown = np.empty(cap, np.int32)
                grown[: self.n] = getattr(self, name)[: self.n]
                setattr(self, name, grown)
            keys, heads = np.full(_table_size(cap), -1, np.int64), np.empty(_table_size(cap), np.int32)
            _rehash(self.keys, self.heads, keys, heads)
            self.keys, self.heads = keys, heads
        start = self.n
        self.data[start : start + k] = tokens
        self.n += k
        _index_bigrams(self.data, self.chain, self.keys, self.heads, start, self.n)

    def view(self) -> np.ndarray:
        return self.data[: self.n]

    def nbytes(self) -> int:
        return self.data.nbytes + self.chain.nbytes + self.keys.nbytes + self.heads.nbytes

    def matches(self, ctx: np.ndarray, cfg: SuffixConfig, min_end: int = 0) -> Matches:
        """Occurrences of ``ctx``'s suffix (≥ 2 tokens) followed by at least one token, the most
        recent ``max_scan`` of them; ends below ``min_end`` (evicted requests) are not counted."""
        starts, lengths = np.empty(cfg.max_scan, np.int64), np.empty(cfg.max_scan, np.int64)
        index = (self.data, self.chain, self.keys, self.heads, self.n)
        found = _find(*index, ctx, cfg.max_match, min_end, starts, lengths)
        if not found:
            return NO_MATCH
        starts, lengths = starts[:found], lengths[:found]
        data = self.view()
        return Matches(int(lengths.max()), lambda ell: [(data, starts[lengths >= ell])])
