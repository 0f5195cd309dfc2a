"""Suffix proposal (SuffixDecoding, arXiv 2411.04975): trees of what followed the context's suffix,
in this request and in the outputs of past requests, scored by frequency.

Two sources per request:

- **the request's own context** (prompt + accepted tokens), scanned with numpy;
- **the global cache** of one scope (``ScopeCache``): the outputs of recent requests with the same
  ``cache_scope``. Finished outputs are indexed by a truncated suffix array (``SealedIndex``,
  rebuilt in a background thread as the cache grows), the newest not yet indexed ones sit in a
  ``tail`` buffer, and the outputs of requests still running are scanned where they are, so an
  output feeds other requests as it is generated. The cache is bounded by tokens with FIFO
  eviction by request (``SuffixCache``).

The tree for a match length ℓ (``continuation_tree``) is the trie of the continuations of every
occurrence of the context's last ℓ tokens, a node's count being how many occurrences pass through
it; its probability is the product of count(child) / count(parent) along its path, which
telescopes to count(node) / count(root). Nodes below ``min_token_prob`` are never proposed,
the depth grows with ℓ (``spec_factor``), and the most probable nodes fill the verifier's budget
(a child is never more probable than its parent, so they form a tree). Each source proposes its
best-scoring tree (score = Σ node probabilities, the expected accepted tokens if the counts are
right), and their union is sent (``union``), each node with the larger of its two probabilities.

The counts are not what the verifier should bet on: on the dev workload, global first tokens with
count ratio 1.0 were right 35% of the time, those after an 8-token match in the request's own
context 94%. ``Calibration`` turns each node's count
ratio into the acceptance this proposer has measured for nodes like it (same source, match
length, depth 1 or deeper, count ratio, parent count), learned from the tokens every stream's
``Advance`` brings (under greedy decoding a node is right exactly when its token is the one
emitted at its depth), so the path probabilities sent are calibrated and the verifier's gate can
take them at their word.

Tokens are < ``SEP`` (2**21 − 1): three pack order-preserving into one int64, which is what lets
numpy's ``searchsorted`` walk the suffix array (``pack3``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numba import njit

SEP = (1 << 21) - 1  # separates requests in a buffer; above every token id
MAX_VOCAB = SEP  # token ids in [0, MAX_VOCAB)
_SHIFT = np.array([42, 21, 0], dtype=np.int64)


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 24  # deepest node (the verifier's budget may cut further)
    max_nodes: int = 32
    min_token_prob: float = 0.05  # nodes whose count ratio is below are not proposed
    spec_factor: float = 2.0  # depth ≤ spec_factor × match length + spec_offset
    spec_offset: int = 4
    min_match: int = 1  # shortest suffix matched in the sealed index (unindexed buffers match ≥ 2)
    max_match: int = 12  # longest suffix matched (the sealed index resolves 3 × index_levels)
    max_occurrences: int = 64  # occurrences per tree (the most recent; of an indexed match, an even sample)
    max_scan: int = 1024  # occurrences of the last token looked at per unindexed buffer (most recent first)
    min_support: int = 4  # fewer occurrences of the longest match: also try half its length
    max_cached_tokens: int = 1_000_000  # global cache, every scope together; FIFO by request
    cache_prompts: bool = False  # the global cache also learns prompts, not only outputs
    index_every: int = 8192  # tail tokens that trigger a re-index (or 1/8 of the indexed size)
    calibrate: bool = True  # send measured acceptance per node kind instead of raw count ratios
    calibration_prior: float = 2.0  # pseudo-trials behind a bin's prior (its count ratio)


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


@njit(cache=True, nogil=True)
def continuations(buf, starts, depth, out, row):  # pragma: no cover - compiled
    """Writes the ``depth`` tokens after each start into ``out[row:]`` (SEP from the first separator
    or the buffer's end on); returns the next free row.

    >>> out = np.zeros((2, 3), np.int32)
    >>> continuations(np.array([1, 2, SEP, 3], dtype=np.int32), np.array([0, 3]), 3, out, 0)
    2
    >>> out.tolist() == [[1, 2, SEP], [3, SEP, SEP]]
    True
    """
    for s in starts:
        if row >= out.shape[0]:
            break
        ended = False
        for d in range(depth):
            p = s + d
            if not ended and (p >= len(buf) or buf[p] == SEP):
                ended = True
            out[row, d] = SEP if ended else buf[p]
        row += 1
    return row


@njit(cache=True, nogil=True)
def _trie(conts, rows, min_prob, out_tokens, out_parents, out_probs):  # pragma: no cover - compiled
    """Writes the trie's most probable nodes into the ``out_*`` arrays (at most their length);
    returns how many (see ``continuation_tree``)."""
    depth = conts.shape[1]
    cap = rows * depth + 1
    token = np.empty(cap, np.int32)
    parent = np.empty(cap, np.int32)
    level = np.empty(cap, np.int32)
    count = np.zeros(cap, np.int64)
    first_child = np.full(cap, -1, np.int32)
    next_sibling = np.full(cap, -1, np.int32)
    nodes = 1  # node 0: the root (the context)
    for r in range(rows):
        node = 0
        for d in range(depth):
            t = conts[r, d]
            if t == SEP:
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
    # most probable first; ties: shallower, then first seen (a parent always precedes its children)
    keep = np.empty(nodes, np.int64)
    k = 0
    for c in range(1, nodes):
        if count[c] >= min_prob * rows:
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
        out_probs[i] = count[c] / rows
    return len(keep)


def continuation_tree(conts: np.ndarray, max_nodes: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """The trie of ``conts`` rows (the continuations of one match), its most probable nodes first.

    A node's count is the number of rows through it, its probability count / rows (the product
    of count(child) / count(parent) along its path). Nodes at or above ``min_prob`` are taken by
    probability (ties: shallower, then first seen), at most ``max_nodes``; a parent is never less
    probable than its child, so every parent precedes its children.

    Worked example: after the match, 4 occurrences continued ``7 8``, ``7 8``, ``7 9`` and ``5``:
    node 7 has probability 3/4, its child 8 2/4, 9 and 5 1/4 each:

    >>> continuation_tree(np.array([[7, 8], [7, 8], [7, 9], [5, SEP]], np.int32), max_nodes=3, min_prob=0.2)
    ([7, 8, 5], [-1, 0, -1], [0.75, 0.5, 0.25])
    """
    if not len(conts) or not conts.shape[1]:
        return [], [], []
    tokens, parents, probs = _tree_arrays(conts, max_nodes, min_prob)
    return tokens.tolist(), parents.tolist(), probs.tolist()


def _tree_arrays(conts: np.ndarray, max_nodes: int, min_prob: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    out = _TreeOut(max_nodes)
    n = _trie(conts, len(conts), min_prob, out.tokens, out.parents, out.probs)
    return out.tokens[:n], out.parents[:n], out.probs[:n]


class _TreeOut:
    __slots__ = ("parents", "probs", "tokens")

    def __init__(self, max_nodes: int) -> None:
        self.tokens = np.empty(max_nodes, np.int32)
        self.parents = np.empty(max_nodes, np.int32)
        self.probs = np.empty(max_nodes, np.float64)


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


def _depth_for(match: int, cfg: SuffixConfig, max_depth: int) -> int:
    return max(1, min(max_depth, int(cfg.spec_factor * match) + cfg.spec_offset))


@dataclass
class Matches:
    """Occurrences of the context's suffix in one source: the longest match, and per match length
    ℓ the (buffer, continuation starts) of the occurrences matching ≥ ℓ tokens."""

    longest: int
    at_least: Callable[[int], list[tuple[np.ndarray, np.ndarray]]]


NO_MATCH = Matches(0, lambda ell: [])


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
            rows = continuations(buf, starts, depth, conts, rows)
        if not rows:
            continue
        tokens, parents, probs = _tree_arrays(conts[:rows], max_nodes, cfg.min_token_prob)
        tree = Proposal(tokens.tolist(), parents.tolist(), probs.tolist(), source, ell, float(probs.sum()), rows)
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
    out = _TreeOut(max_nodes)
    n = _union(
        np.asarray(a.tokens, np.int32), np.asarray(a.parents, np.int64), np.asarray(a.probs, np.float64),
        np.asarray(b.tokens, np.int32), np.asarray(b.parents, np.int64), np.asarray(b.probs, np.float64),
        max_nodes, out.tokens, out.parents, out.probs,
    )  # fmt: skip
    probs = out.probs[:n]
    source = f"{a.source}+{b.source}" if a.tokens and b.tokens else a.source or b.source
    return Proposal(
        out.tokens[:n].tolist(),
        out.parents[:n].tolist(),
        probs.tolist(),
        source,
        max(a.match_length, b.match_length),
        float(probs.sum()),
    )


# ---------------------------------------------------------------------------------------------
# Calibration: what the count ratios are worth, measured

SOURCES = ("request", "global")
_LENGTHS, _QBINS, _PARENT_COUNTS = 6, 11, 4
CALIBRATION_BINS = len(SOURCES) * _LENGTHS * 2 * _QBINS * _PARENT_COUNTS
_WINDOW = 1024.0  # a bin past this many trials halves its counts: it follows the recent traffic


@njit(cache=True, nogil=True)
def calibrate(parents, probs, rows, source, ell, hits, trials, prior, out_bins, out_path):  # pragma: no cover
    """Each node's bin and calibrated path probability (see ``Calibration``). The bin is (source,
    match length ℓ ≤ 6, depth 1 or deeper, q = count(node) / count(parent) in tenths, count(parent)
    ≤ 4); the conditional (hits + prior · q) / (trials + prior); the path probability its product
    with the parent's (parents precede children)."""
    for i in range(len(parents)):
        par = parents[i]
        above = 1.0 if par < 0 else probs[par]
        q = min(1.0, probs[i] / above) if above > 0 else 0.0
        parent_count = max(1, int(above * rows + 0.5))
        b = source * _LENGTHS + min(max(ell, 1), _LENGTHS) - 1
        b = b * 2 + (1 if par < 0 else 0)
        b = b * _QBINS + min(int(q * 10.0), 10)
        b = b * _PARENT_COUNTS + min(parent_count, _PARENT_COUNTS) - 1
        out_bins[i] = b
        cond = (hits[b] + prior * q) / (trials[b] + prior)
        out_path[i] = cond if par < 0 else cond * out_path[par]


@njit(cache=True, nogil=True)
def learn_outcomes(tokens, parents, bins, emitted, hits, trials):  # pragma: no cover - compiled
    """Scores every node whose parent's path was emitted: right iff its token was emitted at its
    depth (the target's own token there, whatever the verifier cut). Returns how many were scored."""
    n = len(tokens)
    right = np.zeros(n, np.bool_)
    depth = np.empty(n, np.int64)
    scored = 0
    for i in range(n):
        par = parents[i]
        depth[i] = 1 if par < 0 else depth[par] + 1
        if (par < 0 or right[par]) and depth[i] <= len(emitted):
            right[i] = tokens[i] == emitted[depth[i] - 1]
            b = bins[i]
            trials[b] += 1.0
            hits[b] += 1.0 if right[i] else 0.0
            if trials[b] > _WINDOW:
                trials[b] *= 0.5
                hits[b] *= 0.5
            scored += 1
    return scored


@dataclass
class Scored:
    """A tree sent, kept until the tokens after its context arrive: each node's calibration bin."""

    tokens: np.ndarray  # [nodes] int64
    parents: np.ndarray  # [nodes] int64
    bins: np.ndarray  # [nodes] int64


class Calibration:
    """Measured acceptance per node kind, shared by every stream of the process.

    A node's calibrated conditional is (hits + prior · q) / (trials + prior) of its bin (q: its
    count ratio, the prior's mean), its path probability the product along its path; the tree is
    then re-ordered most probable first (a child never above its parent: each factor ≤ 1).

    Worked example: nodes like the root child 7 below (global, 1-token match, q = 1, one
    occurrence) were right once in 4 trials; a prior of 2 pulls that toward q = 1:
    (1 + 2 · 1) / (4 + 2) = 0.5; its child 8 was right the one time its parent was (3 / 3 = 1.0):

    >>> cal = Calibration(prior=2.0)
    >>> tree = Proposal([7, 8], [-1, 0], [1.0, 1.0], "global", 1, 2.0, rows=1)
    >>> for emitted in ([7, 8], [5], [5], [5]):
    ...     _ = cal.learn(cal.apply(tree)[1], emitted)
    >>> cal.apply(tree)[0].probs
    [0.5, 0.5]
    """

    def __init__(self, prior: float = 2.0) -> None:
        self.prior = prior
        self.hits = np.zeros(CALIBRATION_BINS, np.float64)
        self.trials = np.zeros(CALIBRATION_BINS, np.float64)
        self.lock = threading.Lock()

    def apply(self, tree: Proposal) -> tuple[Proposal, Scored | None]:
        if not tree.tokens:
            return tree, None
        n = len(tree.tokens)
        bins, path = np.empty(n, np.int64), np.empty(n, np.float64)
        src = SOURCES.index(tree.source)
        parents, counts = np.asarray(tree.parents, np.int64), np.asarray(tree.probs, np.float64)
        with self.lock:
            ell, prior = tree.match_length, self.prior
            calibrate(parents, counts, tree.rows, src, ell, self.hits, self.trials, prior, bins, path)
        probs = path.tolist()
        out = Proposal(tree.tokens, tree.parents, probs, tree.source, tree.match_length, float(path.sum()), tree.rows)
        return out, Scored(np.asarray(tree.tokens, np.int64), parents, bins)

    def learn(self, scored: Scored | None, emitted) -> int:
        """The tokens that followed the context ``scored`` was proposed for; returns the nodes scored."""
        if scored is None or not len(emitted):
            return 0
        emitted = np.asarray(emitted, np.int64)
        with self.lock:
            return learn_outcomes(scored.tokens, scored.parents, scored.bins, emitted, self.hits, self.trials)


def merged(parts: list[Matches]) -> Matches:
    """One ``Matches`` over several sources."""
    parts = [m for m in parts if m.longest]
    if not parts:
        return NO_MATCH
    return Matches(max(m.longest for m in parts), lambda ell: [g for m in parts for g in m.at_least(ell)])


@dataclass
class _Cached:
    """One request's span in its scope's logical coordinates (FIFO eviction unit)."""

    scope: str
    end: int  # logical position just past its tokens (and separator)
    tokens: int


@dataclass
class ScopeCache:
    """The global cache of one scope: a sealed index, the unindexed tail, the live requests.

    Logical positions count every token (and separator) ever cached in the scope; the sealed
    index covers [sealed_start, sealed_end), the tail [sealed_end, …); positions below
    ``watermark`` belong to evicted requests and never count.
    """

    levels: int
    sealed: SealedIndex | None = None
    sealed_start: int = 0
    sealed_end: int = 0
    tail: TokenBuffer = field(default_factory=TokenBuffer)
    watermark: int = 0
    live: dict[int, TokenBuffer] = field(default_factory=dict)  # request key → its cached tokens so far
    building: bool = False

    @property
    def logical_end(self) -> int:
        return self.sealed_end + self.tail.n

    def stored_tokens(self) -> int:
        return (self.sealed.size if self.sealed is not None else 0) + self.tail.n

    def nbytes(self) -> int:
        live = sum(b.nbytes() for b in self.live.values())
        return (self.sealed.nbytes if self.sealed is not None else 0) + self.tail.nbytes() + live

    def matches(self, ctx: np.ndarray, exclude: int | None, cfg: SuffixConfig) -> Matches:
        """The context suffix's occurrences in the sealed index, the tail and the other live requests."""
        parts = []
        if self.tail.n:  # the tail's evicted requests lie below the watermark
            parts.append(self.tail.matches(ctx, cfg, min_end=self.watermark - self.sealed_end))
        parts += [b.matches(ctx, cfg) for k, b in self.live.items() if k != exclude and b.n]
        sealed = self.sealed
        if sealed is not None:
            min_start = self.watermark - self.sealed_start
            ell_max = min(cfg.max_match, 3 * sealed.levels, len(ctx))
            longest = _sa_longest(sealed.keys, sealed.sa, ctx, ell_max, min_start)

            def at_least(ell: int) -> list[tuple[np.ndarray, np.ndarray]]:
                if ell > longest:
                    return []
                lo, hi = _sa_range(sealed.keys, ctx, ell)
                starts = np.empty(min(hi - lo, cfg.max_occurrences), np.int64)
                return [(sealed.tokens, starts[: _sa_sample(sealed.sa, lo, hi, min_start, ell, starts)])]

            parts.append(Matches(longest, at_least))
        return merged(parts)


class SuffixCache:
    """Every scope's global cache, bounded by ``max_cached_tokens`` with FIFO eviction by request.

    Thread-safe: streams call ``begin``/``extend``/``finish``/``propose`` on the event loop,
    ``ingest`` comes from the Redis reader thread, re-indexing runs in a thread of its own.
    """

    def __init__(self, config: SuffixConfig, levels: int = 4, background: bool = True) -> None:
        self.config, self.levels, self.background = config, levels, background
        self.scopes: dict[str, ScopeCache] = {}
        self.fifo: deque[_Cached] = deque()
        self.cached_tokens = 0  # finished requests' tokens still cached (live ones not counted)
        self.lock = threading.RLock()
        self.builds = 0
        self._next_key = 0
        # Pooled over scopes, as the router's acceptance statistics are: rates per node kind, no text.
        self.calibration = Calibration(config.calibration_prior) if config.calibrate else None

    def scope(self, name: str) -> ScopeCache:
        s = self.scopes.get(name)
        if s is None:
            s = self.scopes[name] = ScopeCache(self.levels)
        return s

    def begin(self, scope: str) -> int:
        """A live request's key: its tokens (``extend``) are proposed from as they are generated."""
        with self.lock:
            self._next_key += 1
            self.scope(scope).live[self._next_key] = TokenBuffer()
            return self._next_key

    def extend(self, scope: str, key: int, tokens) -> None:
        with self.lock:
            buf = self.scope(scope).live.get(key)
            if buf is not None:
                buf.extend(tokens)

    def finish(self, scope: str, key: int) -> np.ndarray:
        """Moves a live request into the FIFO cache; returns its tokens (for sharing)."""
        with self.lock:
            s = self.scope(scope)
            buf = s.live.pop(key, None)
            tokens = buf.view().copy() if buf is not None else np.empty(0, np.int32)
            if len(tokens):
                self._append(scope, tokens)
            elif not s.live and s.watermark >= s.logical_end and not s.building:
                del self.scopes[scope]  # a scope with nothing (left) cached leaves nothing behind
            return tokens

    def ingest(self, scope: str, tokens) -> None:
        """A finished output from elsewhere (another replica) enters the cache."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if not len(tokens) or tokens.min() < 0 or tokens.max() >= MAX_VOCAB:
            return
        with self.lock:
            self._append(scope, tokens)

    def learn(self, scope: str, prompt: list[int], output: list[int]) -> np.ndarray:
        """A finished request that no stream followed enters the cache as its stream's would have
        (``SuffixRequest.extend``): its output, after its prompt with ``cache_prompts``. Returns the
        tokens cached (for sharing)."""
        tokens = np.asarray([*prompt, *output] if self.config.cache_prompts else output, dtype=np.int32)
        self.ingest(scope, tokens)
        return tokens

    def _append(self, scope: str, tokens: np.ndarray) -> None:
        s = self.scope(scope)
        s.tail.extend(tokens)
        s.tail.extend([SEP])
        self.fifo.append(_Cached(scope, s.logical_end, len(tokens)))
        self.cached_tokens += len(tokens)
        self._evict()
        self.reindex(s)

    def _evict(self) -> None:
        while self.cached_tokens > self.config.max_cached_tokens and len(self.fifo) > 1:
            old = self.fifo.popleft()
            self.cached_tokens -= old.tokens
            s = self.scopes[old.scope]
            s.watermark = old.end
            if s.watermark >= s.logical_end and not s.live and not s.building:
                del self.scopes[old.scope]  # nothing of the scope left
            else:
                self.reindex(s)

    def reindex(self, s: ScopeCache, force: bool = False) -> None:
        """Re-index when the tail is long or a quarter of what is stored is evicted (or ``force``)."""
        if s.building:
            return
        dead = max(0, s.watermark - s.sealed_start)
        stored = s.stored_tokens()
        if not force and s.tail.n < max(self.config.index_every, stored // 8) and dead * 4 < max(stored, 1):
            return
        start = max(s.watermark, s.sealed_start)
        parts = []
        if s.sealed is not None and start < s.sealed_end:
            parts.append(s.sealed.tokens[start - s.sealed_start :])
        tail_from = max(0, start - s.sealed_end)
        parts.append(s.tail.view()[tail_from:].copy())
        end = s.logical_end
        s.building = True
        tokens = np.concatenate(parts) if parts else np.empty(0, np.int32)

        def build() -> None:
            index = SealedIndex(tokens, self.levels) if len(tokens) else None
            with self.lock:
                s.building = False
                self.builds += 1
                consumed = end - s.sealed_end  # tail tokens now in the index
                rest = s.tail.view()[consumed:]
                s.tail = TokenBuffer(len(rest) + 256)
                s.tail.extend(rest)
                s.sealed, s.sealed_start, s.sealed_end = index, start, end
                if index is None:
                    s.sealed_start = s.sealed_end = end
                if s.watermark >= s.logical_end and not s.live:  # all evicted while it built: drop it
                    name = next((k for k, v in self.scopes.items() if v is s), None)
                    if name is not None:
                        del self.scopes[name]

        if self.background:
            threading.Thread(target=build, name="suffix-index", daemon=True).start()
        else:
            build()

    def nbytes(self) -> int:
        with self.lock:
            return sum(s.nbytes() for s in self.scopes.values())

    def matches(self, scope: str, ctx: np.ndarray, exclude: int | None) -> Matches:
        """``ctx``'s suffix in the scope's global cache (``exclude``: the asking request's live entry).
        The result reads arrays that re-indexing replaces but never changes: it may outlive the lock."""
        with self.lock:
            s = self.scopes.get(scope)
            return NO_MATCH if s is None else s.matches(ctx, exclude, self.config)


class SuffixRequest:
    """One stream's state: its context (prompt + accepted) and its live entry in the global cache."""

    def __init__(self, cache: SuffixCache, scope: str) -> None:
        self.cache, self.scope = cache, scope
        self.context = TokenBuffer(1024)
        self.key = cache.begin(scope)
        self.started = False
        self.pending: list[Scored] = []  # the last proposal's source trees, scored when tokens follow

    @property
    def context_length(self) -> int:
        return self.context.n

    def extend(self, tokens: list[int]) -> None:
        cal = self.cache.calibration
        if cal is not None and self.pending:
            emitted = np.asarray(tokens, np.int64)
            for scored in self.pending:
                cal.learn(scored, emitted)
        self.pending = []
        self.context.extend(tokens)
        if self.started or self.cache.config.cache_prompts:
            self.cache.extend(self.scope, self.key, tokens)
        self.started = True

    def propose(self, max_nodes: int | None = None, max_depth: int | None = None) -> Proposal:
        cfg = self.cache.config
        nodes = min(max_nodes or cfg.max_nodes, cfg.max_nodes)
        depth = min(max_depth or cfg.max_depth, cfg.max_depth)
        ctx = self.context.view()
        # One tree per source, then their union (a node as probable as its likelier source says): a
        # request copying its own prompt is not outvoted by the many global occurrences of a short
        # match, nor the reverse, and the verifier's gate cuts the union by those probabilities.
        own = best_tree(self.context.matches(ctx, cfg), "request", cfg, nodes, depth)
        shared = best_tree(self.cache.matches(self.scope, ctx, self.key), "global", cfg, nodes, depth)
        cal = self.cache.calibration
        if cal is not None:
            (own, a), (shared, b) = cal.apply(own), cal.apply(shared)
            self.pending = [x for x in (a, b) if x is not None]
        return union(own, shared, nodes)

    def close(self) -> np.ndarray:
        return self.cache.finish(self.scope, self.key)
