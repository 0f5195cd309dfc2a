"""Retrieval lookup (REST-style): a suffix array over a corpus of tokens, and proposal trees built
from the continuations of the longest suffix of the context that occurs in the corpus.

Corpus layout: every document's tokens followed by ``SEP`` (never a vocabulary id), as uint32.
A match never spans ``SEP`` (contexts hold vocabulary ids only) and continuations stop at it.
Suffixes compare as big-endian uint32 bytes, so one ``bytes`` slice comparison (memcmp) orders a
suffix against a pattern, and the binary search runs over the suffix array without copies.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from proposer_svc.core.continuation_trie import continuations, heaviest_nodes

SEP = 0xFFFF_FFFF  # document separator in the corpus, sorts after every token


@dataclass(frozen=True)
class RagConfig:
    min_match: int = 2  # shortest context suffix worth looking up; 1-token matches are noise
    max_match: int = 24  # longest suffix tried (binary search over the length)
    max_occurrences: int = 64  # occurrences sampled (evenly over the match range) into the trie
    max_nodes: int = 16
    max_depth: int = 12


def concat_documents(documents: Sequence[Sequence[int] | np.ndarray]) -> np.ndarray:
    """One corpus array: each document's tokens, then SEP.

    >>> concat_documents([[5, 6], [7]]).tolist() == [5, 6, SEP, 7, SEP]
    True
    """
    parts: list[np.ndarray] = []
    sep = np.array([SEP], dtype=np.uint32)
    for doc in documents:
        parts += [np.asarray(doc, dtype=np.uint32), sep]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def build_suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Start positions of all suffixes of ``tokens`` in lexicographic order (a shorter suffix
    first when it is a prefix of a longer one). Prefix doubling with numpy: after the round with
    step ``k`` suffixes are sorted by their first ``2k`` tokens; each round re-sorts only the
    groups still tied (Larsson-Sadakane style), so the cost is O(n log n) and mostly-distinct
    text finishes after a few cheap rounds.

    >>> build_suffix_array(np.array([2, 1, 2, 1, 3])).tolist()  # suffixes 1 2 1 3 < 1 3 < 2 1 2 1 3 < …
    [1, 3, 0, 2, 4]
    """
    n = len(tokens)
    idx = np.int32 if n < 2**31 - 1 else np.int64  # positions; sort keys are int64
    if n == 0:
        return np.zeros(0, dtype=idx)
    t = np.asarray(tokens)
    sa = np.argsort(t, kind="stable").astype(idx)  # [n] sorted by the first token
    st = t[sa]
    boundary = np.ones(n + 1, dtype=bool)  # boundary[i]: sa position i starts a group; [n] closes the last
    boundary[1:n] = st[1:] != st[:-1]
    del st
    rank = np.empty(n, dtype=idx)  # rank[suffix] = sa position where its group starts
    rank[sa] = np.maximum.accumulate(np.where(boundary[:n], np.arange(n, dtype=idx), 0))
    k = 1
    while True:
        active = np.flatnonzero(~(boundary[:n] & boundary[1:])).astype(idx)  # [m] tied groups, contiguous
        if active.size == 0:
            return sa
        s = sa[active]
        group = rank[s]
        after = s.astype(np.int64) + k
        nxt = np.where(after < n, rank[np.minimum(after, n - 1)], -1)  # -1: the suffix ends within k
        key = group.astype(np.int64) * (n + 1) + (nxt + 1)  # [m] (group, rank k tokens later)
        order = np.argsort(key)
        s, key = s[order], key[order]
        sa[active] = s
        new = np.ones(active.size, dtype=bool)
        new[1:] = key[1:] != key[:-1]
        boundary[active] = new
        rank[s] = np.maximum.accumulate(np.where(new, active, 0))
        k *= 2


def suffix_key(tokens: np.ndarray) -> bytes:
    """The corpus as big-endian uint32 bytes: byte order of slices = token order of suffixes."""
    return np.asarray(tokens, dtype=np.uint32).astype(">u4").tobytes()


def match_range(key: bytes, sa: Sequence[int], pattern: bytes) -> tuple[int, int]:
    """[lo, hi) of the suffix-array positions whose suffix starts with ``pattern`` (key bytes)."""
    n = len(pattern)

    def prefix(p: int) -> bytes:
        return key[4 * p : 4 * p + n]

    lo = bisect_left(sa, pattern, key=prefix)
    return lo, bisect_right(sa, pattern, lo=lo, key=prefix)


def longest_suffix_match(
    key: bytes, sa: Sequence[int], context: Sequence[int], min_len: int, max_len: int
) -> tuple[int, int, int]:
    """(length, lo, hi) of the longest suffix of ``context`` (``min_len`` ≤ length ≤ ``max_len``)
    that occurs in the corpus, with its suffix-array range; (0, 0, 0) when none does.

    If a suffix occurs, every shorter one does too, so the length is found by binary search.

    >>> corpus = concat_documents([[1, 2, 3, 4], [9, 2, 3, 5]])
    >>> longest_suffix_match(suffix_key(corpus), build_suffix_array(corpus).tolist(), [7, 1, 2, 3], 1, 8)
    (3, 0, 1)
    """
    hi_len = min(max_len, len(context))
    if hi_len < min_len or hi_len <= 0:
        return 0, 0, 0
    tail = suffix_key(np.asarray(context[-hi_len:], dtype=np.int64))
    best = (0, 0, 0)
    lo_len = max(min_len, 1)
    while lo_len <= hi_len:
        mid = (lo_len + hi_len) // 2
        lo, hi = match_range(key, sa, tail[len(tail) - 4 * mid :])
        if hi > lo:
            best, lo_len = (mid, lo, hi), mid + 1
        else:
            hi_len = mid - 1
    return best


@dataclass(frozen=True)
class CorpusIndex:
    """A corpus (concatenated documents) with its suffix array; immutable, shared by readers."""

    tokens: np.ndarray  # [n] uint32, documents separated by SEP
    sa: np.ndarray  # [n] int32 (int64 past 2^31 tokens)

    @classmethod
    def build(cls, tokens: np.ndarray) -> CorpusIndex:
        return cls(np.asarray(tokens, dtype=np.uint32), build_suffix_array(tokens))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key", suffix_key(self.tokens))
        object.__setattr__(self, "_sa_view", memoryview(np.ascontiguousarray(self.sa)))

    def __len__(self) -> int:
        return len(self.tokens)

    def propose(self, context: Sequence[int], config: RagConfig, max_nodes: int, max_depth: int):
        """(tokens, parents) of the proposal tree for ``context``; empty when nothing matches."""
        return propose_tree(self, context, config, max_nodes, max_depth)


def propose_tree(
    index: CorpusIndex, context: Sequence[int], config: RagConfig, max_nodes: int, max_depth: int
) -> tuple[list[int], list[int]]:
    """Tree of the corpus continuations after the longest suffix of ``context`` found in it.

    Up to ``max_occurrences`` occurrences, evenly spread over the match range (so frequent
    continuations keep their share), each give ``max_depth`` tokens; the trie of those keeps its
    ``max_nodes`` most frequent nodes (ties: shallower, then first seen; the proposers' shared
    ``proposer_svc.core.continuation_trie``).

    Worked example: documents ``1 2 3 4``, ``1 2 3 5``, ``8 2 3 4 6``; context ``… 9 2 3``: the
    longest suffix found is ``2 3`` (``9 2 3`` is not in the corpus), continued by ``4``, ``5``
    and ``4 6``; ``4`` weighs 2:

    >>> idx = CorpusIndex.build(concat_documents([[1, 2, 3, 4], [1, 2, 3, 5], [8, 2, 3, 4, 6]]))
    >>> propose_tree(idx, [7, 9, 2, 3], RagConfig(), max_nodes=8, max_depth=4)
    ([4, 5, 6], [-1, -1, 0])
    """
    if len(index) == 0 or max_nodes <= 0 or max_depth <= 0:
        return [], []
    length, lo, hi = longest_suffix_match(index._key, index._sa_view, context, config.min_match, config.max_match)
    if length == 0:
        return [], []
    count = hi - lo
    m = min(count, config.max_occurrences)
    picks = lo + (np.arange(m, dtype=np.int64) * count) // m  # [m] ascending, evenly spread
    starts = index.sa[picks].astype(np.int64) + length
    conts = np.empty((m, max_depth), np.uint32)  # [m, max_depth], SEP from the document's end on
    continuations(index.tokens, starts, max_depth, conts, 0, SEP)
    top = heaviest_nodes(conts, max_nodes, stop=SEP)
    return top.tokens.tolist(), top.parents.tolist()


class RagRequest:
    """Per-request proposer state: the tail of the context, looked up in one corpus snapshot."""

    def __init__(self, index: CorpusIndex, config: RagConfig) -> None:
        self.index, self.config = index, config
        self._tail: list[int] = []
        self._length = 0

    @property
    def context_length(self) -> int:
        return self._length

    def extend(self, tokens: list[int]) -> None:
        self._length += len(tokens)
        self._tail = (self._tail + list(tokens))[-self.config.max_match :]

    def propose(self, max_nodes: int | None = None, max_depth: int | None = None) -> tuple[list[int], list[int]]:
        cfg = self.config
        return propose_tree(
            self.index,
            self._tail,
            cfg,
            max_nodes if max_nodes is not None else cfg.max_nodes,
            max_depth if max_depth is not None else cfg.max_depth,
        )
