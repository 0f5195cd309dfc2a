"""The sealed index: a truncated suffix array over the finished outputs of one scope, rebuilt by
the cache in the background (``SealedIndex``), and its numba searches.

Tokens are < ``SEP`` (2**21 − 1): three pack order-preserving into one int64, which is what lets
a binary search walk the suffix array by packed keys (``pack3``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from proposer_svc.suffix.config import SuffixConfig
from proposer_svc.suffix.matches import Matches

SEP = (1 << 21) - 1  # separates requests in a buffer; above every token id
MAX_VOCAB = SEP  # token ids in [0, MAX_VOCAB)
_SHIFT = np.array([42, 21, 0], dtype=np.int64)


def pack3(tokens: np.ndarray) -> np.ndarray:
    """Order-preserving keys of token triples: ``[..., 3]`` → ``[...]`` int64.

    >>> int(pack3(np.array([1, 2, 3]))) == (1 << 42) | (2 << 21) | 3
    True
    >>> bool(pack3(np.array([1, 2, 3])) < pack3(np.array([1, 3, 0])))
    True
    """
    return (tokens.astype(np.int64) << _SHIFT).sum(axis=-1)


class SealedIndex:
    """A truncated suffix array over ``tokens``: the start of every suffix, sorted by its first
    ``3 × levels`` tokens (ties: by position), with each level's packed key kept in that order.
    Memory: 4 (token) + 4 (start) + 8 × levels bytes per token.

    >>> idx = SealedIndex(np.array([1, 2, 3, 1, 2, 4, SEP], dtype=np.int32), levels=2)
    >>> lo, hi = idx.find(np.array([1, 2], dtype=np.int32)); sorted(idx.sa[lo:hi].tolist())
    [0, 3]
    >>> idx.sa[slice(*idx.find(np.array([2, 3, 1, 2], dtype=np.int32)))].tolist()
    [1]
    """

    def __init__(self, tokens: np.ndarray, levels: int = 4) -> None:
        self.tokens = tokens  # int32 [n]; SEP between requests
        self.levels = levels
        padded = np.concatenate([tokens, np.full(3 * levels, SEP, dtype=np.int32)])
        starts = np.flatnonzero(tokens != SEP)
        triples = np.lib.stride_tricks.sliding_window_view(padded, 3)  # [n + 3L - 2, 3]
        keys = [pack3(triples[starts + 3 * i]) for i in range(levels)]  # each [suffixes]
        order = np.lexsort((starts, *reversed(keys)))  # keys[0] primary
        self.sa = starts[order].astype(np.int32)  # [suffixes]
        self.keys = np.stack([k[order] for k in keys])  # [levels, suffixes]: sorted within the previous level's runs
        self.size = len(tokens)

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.sa.nbytes + self.keys.nbytes

    def find(self, pattern: np.ndarray) -> tuple[int, int]:
        """[lo, hi) of the suffixes starting with ``pattern`` (≤ 3 × levels tokens)."""
        return _sa_range(self.keys, pattern, len(pattern))

    def matches(self, ctx: np.ndarray, min_start: int, cfg: SuffixConfig) -> Matches:
        """The occurrences of ``ctx``'s suffix (≤ ``max_match`` tokens) starting at or after
        ``min_start`` (below: evicted requests); per match length an even sample of at most
        ``max_occurrences``. The result reads arrays that are never changed: it may outlive the index."""
        ell_max = min(cfg.max_match, 3 * self.levels, len(ctx))
        longest = _sa_longest(self.keys, self.sa, ctx, ell_max, min_start)
        tokens, keys, sa = self.tokens, self.keys, self.sa

        def at_least(ell: int) -> list[tuple[np.ndarray, np.ndarray]]:
            if ell > longest:
                return []
            lo, hi = _sa_range(keys, ctx, ell)
            starts = np.empty(min(hi - lo, cfg.max_occurrences), np.int64)
            return [(tokens, starts[: _sa_sample(sa, lo, hi, min_start, ell, starts)])]

        return Matches(longest, at_least)


@njit(cache=True, nogil=True)
def _sa_range(keys, ctx, ell):  # pragma: no cover - compiled
    """[lo, hi) of the suffixes starting with ``ctx[-ell:]``: a binary search per level of triples."""
    lo, hi = 0, keys.shape[1]
    base = len(ctx) - ell
    for level in range((ell + 2) // 3):
        if lo >= hi:
            break
        low, high = 0, 0
        for i in range(3):
            low, high = low << 21, high << 21
            j = 3 * level + i
            if j < ell:
                low |= ctx[base + j]
                high |= ctx[base + j]
            else:
                high |= SEP
        a, b = lo, hi  # first key >= low
        while a < b:
            mid = (a + b) >> 1
            if keys[level, mid] < low:
                a = mid + 1
            else:
                b = mid
        first = a
        b = hi  # first key > high
        while a < b:
            mid = (a + b) >> 1
            if keys[level, mid] <= high:
                a = mid + 1
            else:
                b = mid
        lo, hi = first, a
    return lo, hi


@njit(cache=True, nogil=True)
def _sa_longest(keys, sa, ctx, max_ell, min_start):  # pragma: no cover - compiled
    """Longest ℓ ≤ max_ell such that ctx[-ℓ:] starts a suffix at a position ≥ min_start (not evicted)."""
    ok, bad = 0, max_ell + 1
    while bad - ok > 1:  # a suffix that occurs implies every shorter one occurs
        mid = (ok + bad) >> 1
        lo, hi = _sa_range(keys, ctx, mid)
        live = False
        for i in range(lo, hi):
            if sa[i] >= min_start:
                live = True
                break
        if live:
            ok = mid
        else:
            bad = mid
    return ok


@njit(cache=True, nogil=True)
def _sa_sample(sa, lo, hi, min_start, ell, out):  # pragma: no cover - compiled
    """Writes the continuation starts of at most ``len(out)`` live suffixes of [lo, hi), evenly
    spaced over the range, into ``out``; returns how many."""
    n = hi - lo
    step = max(1.0, n / len(out))
    k = 0
    x = 0.0
    while k < len(out) and int(x) < n:
        p = sa[lo + int(x)]
        if p >= min_start:
            out[k] = p + ell
            k += 1
        x += step
    return k
