"""The suffix-proposal core on tiny arrays, checked against brute force: the truncated suffix
array, the bigram hash chains, the continuation trie; then the global cache: incremental updates
propose what a rebuilt cache proposes, FIFO eviction keeps counts exact, scopes stay apart, and
memory stays bounded over 10,000 requests."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from proposer_svc.suffix.buffer import TokenBuffer
from proposer_svc.suffix.cache import SuffixCache
from proposer_svc.suffix.calibration import Calibration
from proposer_svc.suffix.config import SuffixConfig
from proposer_svc.suffix.index import MAX_VOCAB, SEP, SealedIndex
from proposer_svc.suffix.request import SuffixRequest
from proposer_svc.suffix.trees import Proposal, best_tree, continuation_tree, union

# ---------------------------------------------------------------------------------------------
# brute force


def _random_buffer(rng, n: int, vocab: int, sep_rate: float = 0.08) -> np.ndarray:
    """Random tokens with SEP separators (never two in a row), ending with SEP like a cache buffer."""
    t = rng.integers(0, vocab, n).astype(np.int32)
    t[rng.random(n) < sep_rate] = SEP
    t[-1] = SEP
    return t


def _brute_find(tokens: np.ndarray, pattern: np.ndarray) -> list[int]:
    """Every start of a suffix beginning with ``pattern`` (a scan of all suffixes)."""
    t, p = tokens.tolist(), pattern.tolist()
    return [i for i in range(len(t)) if t[i] != SEP and t[i : i + len(p)] == p]


def _brute_matches(data: np.ndarray, ctx: np.ndarray, max_match: int, max_scan: int, min_end: int):
    """(continuation start, match length) of every occurrence of ctx's suffix (>= 2 tokens) that ends
    at or after ``min_end`` and is followed by a token, most recent first, at most ``max_scan``."""
    d, c = data.tolist(), ctx.tolist()
    if len(c) < 2:
        return []
    m = min(max_match, len(c))
    out = []
    for end in range(len(d) - 2, max(min_end, 1) - 1, -1):  # end < len - 1: a next token exists
        if d[end - 1 : end + 1] != c[-2:]:
            continue
        length = max(ell for ell in range(2, m + 1) if end - ell + 1 >= 0 and d[end - ell + 1 : end + 1] == c[-ell:])
        out.append((end + 1, length))
        if len(out) == max_scan:
            break
    return out


def _brute_tree(conts: np.ndarray, max_nodes: int, min_prob: float):
    """The trie of the rows (cut at the first SEP) built with a dict of paths; the nodes at or above
    ``min_prob`` by probability, then shallower, then first seen; at most ``max_nodes``."""
    rows = len(conts)
    count: dict[tuple[int, ...], int] = {}
    seen: dict[tuple[int, ...], int] = {}
    for row in conts.tolist():
        path: tuple[int, ...] = ()
        for t in row:
            if t == SEP:
                break
            path += (t,)
            count[path] = count.get(path, 0) + 1
            seen.setdefault(path, len(seen))
    eligible = [p for p in count if count[p] / rows >= min_prob]
    eligible.sort(key=lambda p: (-count[p], len(p), seen[p]))
    kept = eligible[:max_nodes]
    index = {p: i for i, p in enumerate(kept)}
    tokens = [p[-1] for p in kept]
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in kept]
    probs = [count[p] / rows for p in kept]
    return tokens, parents, probs, count


def _paths(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for i, (t, p) in enumerate(zip(tokens, parents, strict=True)):
        assert -1 <= p < i, f"node {i}'s parent {p} does not precede it"
        paths.append((*paths[p], t) if p >= 0 else (t,))
    return paths


def _canonical(proposal) -> tuple:
    """A proposal as (source, match length, {path: probability}): the same tree whatever the order of
    nodes that tie (which depends on the order the occurrences were read in)."""
    paths = _paths(proposal.tokens, proposal.parents)
    assert len(set(paths)) == len(paths), "a path appears twice"
    tree = dict(zip(paths, proposal.probs, strict=True))
    return proposal.source, proposal.match_length, {p: round(q, 12) for p, q in tree.items()}


# ---------------------------------------------------------------------------------------------
# SealedIndex


@pytest.mark.parametrize("vocab", [2, 4, 50])
def test_sealed_index_find_equals_brute_force_scan_of_all_suffixes(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(40):
        tokens = _random_buffer(rng, int(rng.integers(1, 120)), vocab)
        levels = int(rng.integers(1, 5))
        idx = SealedIndex(tokens, levels)
        for _ in range(25):
            ell = int(rng.integers(1, 3 * levels + 1))
            if rng.random() < 0.7 and len(tokens) > ell:  # mostly patterns that occur
                s = int(rng.integers(0, len(tokens) - ell))
                pattern = tokens[s : s + ell].copy()
                pattern[pattern == SEP] = int(rng.integers(0, vocab))
            else:
                pattern = rng.integers(0, vocab, ell).astype(np.int32)
            lo, hi = idx.find(pattern)
            got = idx.sa[lo:hi].tolist()
            assert sorted(got) == _brute_find(tokens, pattern), (tokens.tolist(), pattern.tolist())
            assert got == sorted(got) or ell < 3 * levels  # full-depth ties are ordered by position


def test_sealed_index_sorts_suffixes_by_their_first_3_levels_tokens_then_position():
    rng = np.random.default_rng(7)
    for levels in (1, 2, 4):
        tokens = _random_buffer(rng, 200, 3)
        padded = tokens.tolist() + [SEP] * (3 * levels)
        starts = [i for i in range(len(tokens)) if tokens[i] != SEP]
        want = sorted(starts, key=lambda i: (padded[i : i + 3 * levels], i))
        assert SealedIndex(tokens, levels).sa.tolist() == want


def test_sealed_index_orders_token_ids_at_both_ends_of_the_vocabulary():
    top = MAX_VOCAB - 1
    tokens = np.array([top, 0, top, top, 0, SEP, 0, top, SEP, top, 0, 1, SEP], np.int32)
    idx = SealedIndex(tokens, levels=2)
    for pattern in ([top, 0], [0, top], [top], [0], [top, top, 0], [top, 0, top, top], [top, 0, 1], [1, top]):
        p = np.array(pattern, np.int32)
        lo, hi = idx.find(p)
        assert sorted(idx.sa[lo:hi].tolist()) == _brute_find(tokens, p)


# ---------------------------------------------------------------------------------------------
# TokenBuffer


def _check_matches(buf: TokenBuffer, ctx: np.ndarray, cfg: SuffixConfig, min_end: int = 0) -> int:
    want = _brute_matches(buf.view(), ctx, cfg.max_match, cfg.max_scan, min_end)
    m = buf.matches(ctx, cfg, min_end)
    assert m.longest == max((ell for _, ell in want), default=0)
    for ell in range(2, cfg.max_match + 2):
        groups = m.at_least(ell)
        got = [int(s) for data, starts in groups for s in starts]
        assert got == [s for s, length in want if length >= ell], (ell, ctx.tolist())
        for data, _ in groups:
            assert np.array_equal(data, buf.view())
    return len(want)


def _context(rng, data: np.ndarray, vocab: int) -> np.ndarray:
    """A context ending in a piece of ``data`` (or random), after a random prefix."""
    prefix = rng.integers(0, vocab, int(rng.integers(0, 6))).astype(np.int32)
    if rng.random() < 0.8 and len(data) > 2:
        ell = int(rng.integers(2, 15))
        s = int(rng.integers(0, max(1, len(data) - ell)))
        piece = data[s : s + ell]
        piece = piece[piece != SEP]
    else:
        piece = rng.integers(0, vocab, int(rng.integers(0, 15))).astype(np.int32)
    return np.concatenate([prefix, piece]).astype(np.int32)


@pytest.mark.parametrize("vocab", [2, 5, 40])
def test_token_buffer_matches_equal_brute_force_most_recent_first(vocab):
    rng = np.random.default_rng(100 + vocab)
    cfg = SuffixConfig(max_match=12, max_scan=1 << 20)
    found = 0
    for _ in range(30):
        data = _random_buffer(rng, int(rng.integers(2, 150)), vocab)
        if rng.random() < 0.5:
            data = data[:-1]  # ending mid-request, like a live buffer
        buf = TokenBuffer(16)
        buf.extend(data)
        for _ in range(20):
            ctx = _context(rng, data, vocab)
            found += _check_matches(buf, ctx, cfg)
            found += _check_matches(buf, ctx, cfg, min_end=int(rng.integers(0, len(data) + 1)))
    assert found > 100  # the comparisons were not all empty


def test_token_buffer_keeps_only_the_most_recent_max_scan_occurrences():
    rng = np.random.default_rng(3)
    data = _random_buffer(rng, 400, 3, sep_rate=0.02)
    buf = TokenBuffer()
    buf.extend(data)
    for max_scan in (1, 2, 7, 30):
        for max_match in (2, 3, 6):
            cfg = SuffixConfig(max_scan=max_scan, max_match=max_match)
            for _ in range(10):
                _check_matches(buf, _context(rng, data, 3), cfg)


def test_token_buffer_matches_stay_exact_across_growth_and_rehash():
    rng = np.random.default_rng(11)
    cfg = SuffixConfig(max_match=12, max_scan=1 << 20)
    buf = TokenBuffer(16)
    data: list[int] = []
    sizes = {len(buf.keys)}
    phrases = [rng.integers(0, 300, int(rng.integers(3, 12))).tolist() for _ in range(20)]
    for step in range(400):  # many small extends: the table is rehashed at every doubling
        chunk = phrases[int(rng.integers(0, 20))] if rng.random() < 0.5 else rng.integers(0, 300, 7).tolist()
        if rng.random() < 0.1:
            chunk = [*chunk, SEP]
        buf.extend(chunk)
        data += chunk
        sizes.add(len(buf.keys))
        assert buf.view().tolist() == data
        if step % 20 == 0 or step == 399:
            view = buf.view()
            for _ in range(15):
                _check_matches(buf, _context(rng, view, 300), cfg)
            for phrase in phrases:
                _check_matches(buf, np.array(phrase, np.int32), cfg, min_end=len(data) // 3)
    assert len(sizes) >= 6, sizes  # the bigram table grew (and was rehashed) several times
    assert len(buf.keys) >= 4 * buf.n  # load stays at most 1/4


def test_token_buffer_short_context_and_separator_bigrams_never_match():
    cfg = SuffixConfig()
    buf = TokenBuffer()
    buf.extend([1, 2, SEP, 1, 2, 3])
    assert buf.matches(np.array([2], np.int32), cfg).longest == 0
    assert buf.matches(np.array([2, 3], np.int32), cfg).longest == 0  # at the end: nothing follows
    m = buf.matches(np.array([1, 2], np.int32), cfg)
    assert m.longest == 2 and [s.tolist() for _, s in m.at_least(2)] == [[5, 2]]
    assert buf.matches(np.array([2, SEP], np.int32), cfg).longest == 0


# ---------------------------------------------------------------------------------------------
# continuation_tree


def _tree(conts: np.ndarray, max_nodes: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
    t = continuation_tree(conts, max_nodes, min_prob)
    return t.tokens, t.parents, t.probs


def _random_conts(rng, rows: int, depth: int, vocab: int) -> np.ndarray:
    conts = rng.integers(0, vocab, (rows, depth)).astype(np.int32)
    common = rng.integers(0, vocab, depth)
    shared = rng.random(rows) < 0.6  # most rows share a prefix of a common continuation
    for r in np.flatnonzero(shared):
        k = int(rng.integers(1, depth + 1))
        conts[r, :k] = common[:k]
    for r in range(rows):  # some rows end early (the request ended)
        if rng.random() < 0.3:
            conts[r, int(rng.integers(0, depth)) :] = SEP
    return conts


@pytest.mark.parametrize("min_prob", [0.0, 0.137, 0.29, 0.61])
def test_continuation_tree_equals_brute_force_trie(min_prob):
    rng = np.random.default_rng(int(min_prob * 1000))
    for _ in range(150):
        rows, depth, vocab = int(rng.integers(1, 65)), int(rng.integers(1, 9)), int(rng.integers(1, 6))
        conts = _random_conts(rng, rows, depth, vocab)
        max_nodes = int(rng.integers(1, 40))
        tokens, parents, probs = _tree(conts, max_nodes, min_prob)
        want_tokens, want_parents, want_probs, count = _brute_tree(conts, max_nodes, min_prob)
        assert (tokens, parents) == (want_tokens, want_parents), conts.tolist()
        assert probs == pytest.approx(want_probs, abs=1e-12)
        # the properties, stated directly
        paths = _paths(tokens, parents)  # parents precede children
        assert len(tokens) <= max_nodes
        assert all(q >= min_prob for q in probs)
        assert all(q == pytest.approx(count[p] / rows) for p, q in zip(paths, probs, strict=True))
        keys = [(-q, len(p)) for p, q in zip(paths, probs, strict=True)]
        assert keys == sorted(keys)  # most probable first, ties shallower first
        eligible = sum(c / rows >= min_prob for c in count.values())
        assert len(tokens) == min(max_nodes, eligible)


def test_continuation_tree_ties_go_shallower_first_then_first_seen():
    conts = np.array([[5, 6, 7], [8, 9, SEP]], np.int32)  # every node: 1/2
    tokens, parents, probs = _tree(conts, max_nodes=4, min_prob=0.0)
    assert tokens == [5, 8, 6, 9] and parents == [-1, -1, 0, 1] and probs == [0.5] * 4
    assert _tree(np.empty((0, 3), np.int32), 4, 0.0) == ([], [], [])
    assert _tree(np.full((3, 2), SEP, np.int32), 4, 0.0) == ([], [], [])


def test_continuation_tree_keeps_nodes_exactly_at_min_prob_and_drops_those_below():
    conts = np.array([[7, 8], [7, 8], [7, 9], [5, SEP]], np.int32)  # 7: 3/4, 8: 2/4, 9 and 5: 1/4
    assert _tree(conts, 10, 0.25) == ([7, 8, 5, 9], [-1, 0, -1, 0], [0.75, 0.5, 0.25, 0.25])
    assert _tree(conts, 10, 0.26) == ([7, 8], [-1, 0], [0.75, 0.5])
    assert _tree(conts, 10, 0.75) == ([7], [-1], [0.75])
    assert _tree(conts, 10, 0.76) == ([], [], [])


def test_union_of_two_trees_equals_brute_force_max_over_paths_best_first_and_ancestor_closed():
    rng = np.random.default_rng(3)
    for _ in range(200):
        trees = []
        for source in ("request", "global"):
            rows, depth = int(rng.integers(1, 20)), int(rng.integers(1, 6))
            tokens, parents, probs = _tree(_random_conts(rng, rows, depth, 4), 32, 0.0)
            trees.append(Proposal(tokens, parents, probs, source, 2, sum(probs)))
        max_nodes = int(rng.integers(1, 40))
        got = union(*trees, max_nodes)
        want: dict[tuple[int, ...], float] = {}
        for t in trees:
            for path, q in zip(_paths(t.tokens, t.parents), t.probs, strict=True):
                want[path] = max(want.get(path, 0.0), q)
        paths = _paths(got.tokens, got.parents)  # parents precede children
        assert len(paths) == len(set(paths)) == min(max_nodes, len(want))
        assert all(want[p] == q for p, q in zip(paths, got.probs, strict=True))
        keys = [(-q, len(p)) for p, q in zip(paths, got.probs, strict=True)]
        assert keys == sorted(keys)  # most probable first, ties shallower first
        left_out = set(want) - set(paths)
        assert all((-want[p], len(p)) >= keys[-1] for p in left_out)  # the best max_nodes kept
        assert got.score == pytest.approx(sum(got.probs))
        if trees[0].tokens and trees[1].tokens:
            assert got.source == "request+global"


# ---------------------------------------------------------------------------------------------
# SuffixCache: incremental == rebuilt

# occurrence caps out of reach: every source counts every occurrence, so only the counts decide
EXACT = SuffixConfig(max_nodes=4096, max_occurrences=4096, max_scan=4096, min_token_prob=0.05, min_match=2)


def _outputs(rng, n: int, vocab: int = 40, lo: int = 10, hi: int = 60) -> list[np.ndarray]:
    """Outputs with repeated phrases (so contexts recur with varied continuations)."""
    phrases = [rng.integers(0, vocab, int(rng.integers(3, 9))) for _ in range(8)]
    outs = []
    for _ in range(n):
        parts, length = [], int(rng.integers(lo, hi))
        while sum(map(len, parts)) < length:
            parts.append(phrases[int(rng.integers(0, 8))] if rng.random() < 0.5 else rng.integers(0, vocab, 3))
        outs.append(np.concatenate(parts)[:length].astype(np.int32))
    return outs


def _queries(rng, outputs: list[np.ndarray], n: int, vocab: int = 40) -> list[np.ndarray]:
    qs = []
    for _ in range(n):
        out = outputs[int(rng.integers(0, len(outputs)))]
        ell = int(rng.integers(2, 15))
        s = int(rng.integers(0, max(1, len(out) - ell - 1)))
        prefix = rng.integers(0, vocab, int(rng.integers(0, 4)))
        qs.append(np.concatenate([prefix, out[s : s + ell]]).astype(np.int32))
    return qs


def _propose(cache: SuffixCache, scope: str, ctx: np.ndarray, exclude: int | None = None):
    cfg = cache.config
    return best_tree(cache.matches(scope, ctx, exclude), "global", cfg, cfg.max_nodes, cfg.max_depth)


def _trees(cache: SuffixCache, scope: str, queries: list[np.ndarray]) -> list[tuple]:
    return [_canonical(_propose(cache, scope, q)) for q in queries]


def _feed(cache: SuffixCache, scope: str, outputs: list[np.ndarray], rng=None) -> None:
    """Each output through begin / extend (in chunks) / finish, as a stream feeds it."""
    for out in outputs:
        key = cache.begin(scope)
        cuts = sorted(rng.integers(0, len(out), 3).tolist()) if rng is not None else []
        for a, b in zip([0, *cuts], [*cuts, len(out)], strict=True):
            cache.extend(scope, key, out[a:b])
        cache.finish(scope, key)


def _wait_built(cache: SuffixCache, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with cache.lock:
            if not any(s.building for s in cache.scopes.values()):
                return
        assert time.monotonic() < deadline, "the background re-index did not finish"
        time.sleep(0.005)


def _tail_only(outputs: list[np.ndarray], scope: str = "s", config: SuffixConfig = EXACT) -> SuffixCache:
    cache = SuffixCache(replace(config, index_every=1 << 40), background=False)
    _feed(cache, scope, outputs)
    return cache


def _rebuilt(outputs: list[np.ndarray], scope: str = "s", config: SuffixConfig = EXACT) -> SuffixCache:
    cache = _tail_only(outputs, scope, config)
    cache.reindex(cache.scope(scope), force=True)
    return cache


@pytest.mark.parametrize("index_every", [1, 16, 97, 400])
def test_incremental_cache_proposes_the_same_trees_as_a_rebuilt_one_and_an_unindexed_one(index_every):
    rng = np.random.default_rng(index_every)
    outputs = _outputs(rng, 80)
    queries = _queries(rng, outputs, 60)
    cfg = replace(EXACT, index_every=index_every)
    incremental = SuffixCache(cfg, background=False)
    rebuilt, tail_only = _rebuilt(outputs), _tail_only(outputs)
    s = rebuilt.scopes["s"]
    assert s.tail.n == 0 and s.sealed is not None and s.sealed.size == sum(len(o) + 1 for o in outputs)
    assert tail_only.scopes["s"].sealed is None and tail_only.builds == 0

    want = _trees(rebuilt, "s", queries)
    assert want == _trees(tail_only, "s", queries)
    assert sum(src == "global" for src, _, _ in want) > 40  # most queries do find a tree

    # fed request by request, compared at several points against caches holding the same prefix
    checkpoints = {10, 33, 57, 80}
    for i in range(0, 80, 1):
        _feed(incremental, "s", outputs[i : i + 1], rng)
        if i + 1 in checkpoints:
            qs = queries[:20]
            expected = _trees(_rebuilt(outputs[: i + 1]), "s", qs)
            assert _trees(incremental, "s", qs) == expected
            assert _trees(_tail_only(outputs[: i + 1]), "s", qs) == expected
    assert incremental.builds > (1 if index_every < 400 else 0)  # the re-index ran between feeds
    inc = incremental.scopes["s"]
    assert (inc.sealed is not None and inc.tail.n > 0) or index_every == 1  # both sources in use
    assert _trees(incremental, "s", queries) == want


def test_incremental_cache_with_background_reindexing_matches_the_rebuilt_one():
    rng = np.random.default_rng(5)
    outputs = _outputs(rng, 120)
    queries = _queries(rng, outputs, 40)
    cache = SuffixCache(replace(EXACT, index_every=64), background=True)
    for i, out in enumerate(outputs):
        cache.ingest("s", out)
        if i % 10 == 9:
            _propose(cache, "s", queries[i % 40])  # proposing while a build may run
        if i % 40 == 39:
            _wait_built(cache)  # so that several builds happen, whatever the timing
    _wait_built(cache)
    assert cache.builds >= 3
    cache.reindex(cache.scopes["s"], force=True)  # a last build over the final tail
    _wait_built(cache)
    assert cache.scopes["s"].tail.n == 0
    assert _trees(cache, "s", queries) == _trees(_rebuilt(outputs), "s", queries)


def test_live_request_output_is_proposed_while_running_and_the_same_after_it_finishes():
    rng = np.random.default_rng(9)
    others = _outputs(rng, 30)
    live_out = np.arange(1000, 1040, dtype=np.int32)  # tokens no other output has
    cache = SuffixCache(replace(EXACT, index_every=128), background=False)
    _feed(cache, "s", others)

    writer = SuffixRequest(cache, "s")
    writer.extend([1, 2, 3])  # the prompt (not cached)
    writer.extend(live_out[:20].tolist())
    writer.extend(live_out[20:].tolist())

    reader = SuffixRequest(cache, "s")
    reader.extend([7, 7, *live_out[10:15].tolist()])
    running = reader.propose()
    # one occurrence, in the running output: the chain that follows it, each node certain
    assert running.source == "global" and running.match_length == 5
    cfg = cache.config
    depth = min(cfg.max_depth, int(cfg.spec_factor * 5) + cfg.spec_offset)  # grows with the match length
    assert running.tokens == list(range(1015, 1015 + depth))
    assert running.parents == list(range(-1, depth - 1)) and running.probs == [1.0] * depth
    # the writer does not propose from its own live entry (its context has no repeat either)
    assert writer.propose().source == ""

    # the same tree from the running request as from the finished one, in the tail and once indexed
    query = np.array([7, 7, *live_out[10:15].tolist()], np.int32)
    while_running = _canonical(_propose(cache, "s", query, exclude=reader.key))
    assert writer.close().tolist() == live_out.tolist()
    assert _canonical(_propose(cache, "s", query, exclude=reader.key)) == while_running
    cache.reindex(cache.scopes["s"], force=True)
    assert cache.scopes["s"].tail.n == 0
    assert _canonical(reader.propose()) == while_running
    reader.close()

    # mixed with the other outputs' occurrences: running == finished == rebuilt (the queries never
    # end at the running output's last token, which has no continuation yet)
    queries = _queries(rng, [*others, live_out], 40)
    cache2 = SuffixCache(replace(EXACT, index_every=128), background=False)
    _feed(cache2, "s", others)
    key = cache2.begin("s")
    cache2.extend("s", key, live_out[:25])
    cache2.extend("s", key, live_out[25:])
    running_trees = _trees(cache2, "s", queries)
    assert any(tree and min(path[0] for path in tree) >= 1000 for _, _, tree in running_trees)
    cache2.finish("s", key)
    rebuilt = _trees(_rebuilt([*others, live_out]), "s", queries)
    assert running_trees == rebuilt
    assert _trees(cache2, "s", queries) == rebuilt


# ---------------------------------------------------------------------------------------------
# eviction


@pytest.mark.parametrize("index_every", [16, 1 << 40])
def test_eviction_proposes_exactly_what_a_fresh_cache_of_the_survivors_proposes(index_every):
    rng = np.random.default_rng(21 + index_every % 1000)
    outputs = _outputs(rng, 70, lo=10, hi=40)
    queries = _queries(rng, outputs, 25)
    cfg = replace(EXACT, index_every=index_every, max_cached_tokens=400)
    cache = SuffixCache(cfg, background=False)
    states = set()
    for i, out in enumerate(outputs):
        builds = cache.builds
        _feed(cache, "s", [out])
        assert cache.cached_tokens <= cfg.max_cached_tokens
        survivors = len(cache.fifo)
        assert cache.cached_tokens == sum(len(o) for o in outputs[i + 1 - survivors : i + 1])
        s = cache.scopes["s"]
        dead = s.watermark - s.sealed_start
        states.add("dead tokens still stored" if dead > 0 else "compacted")
        if cache.builds > builds:
            states.add("re-indexed")
        if i % 3 == 0 or dead > 0:
            fresh = outputs[i + 1 - survivors : i + 1]
            want = _trees(_tail_only(fresh), "s", queries)
            assert _trees(cache, "s", queries) == want, i
            assert _trees(_rebuilt(fresh), "s", queries) == want
    assert states == {"dead tokens still stored", "compacted", "re-indexed"}, states


def test_evicted_outputs_are_never_proposed():
    rng = np.random.default_rng(4)
    unique = np.arange(5000, 5030, dtype=np.int32)
    query = unique[5:12]
    for index_every in (8, 1 << 40):
        cfg = replace(EXACT, index_every=index_every, max_cached_tokens=300)
        cache = SuffixCache(cfg, background=False)
        cache.ingest("s", unique)
        ingested, evicted_at = 1, None
        for out in _outputs(rng, 40, lo=10, hi=30):
            cache.ingest("s", out)
            ingested += 1
            got = _propose(cache, "s", query)
            if len(cache.fifo) == ingested:  # still cached
                assert got.tokens[:3] == [5012, 5013, 5014]
            else:
                evicted_at = evicted_at or ingested
                assert got.source == "", "an evicted output was proposed"
                for k in (2, 5, 12):  # nor any suffix of it
                    assert _propose(cache, "s", unique[20 - k : 20]).source == ""
        assert evicted_at is not None and evicted_at < ingested - 10
        req = SuffixRequest(cache, "s")
        req.extend([3, *query.tolist()])
        assert "global" not in req.propose().source
        req.close()


def test_eviction_removes_a_scope_whose_outputs_are_all_evicted():
    rng = np.random.default_rng(8)
    cfg = replace(EXACT, max_cached_tokens=200)
    cache = SuffixCache(cfg, background=False)
    cache.ingest("old", np.arange(100, 140, dtype=np.int32))
    for out in _outputs(rng, 20, lo=20, hi=30):
        cache.ingest("new", out)
    assert "old" not in cache.scopes
    assert cache.matches("old", np.arange(100, 110, dtype=np.int32), None).longest == 0


def _evict_scope_a_during_its_build(cache: SuffixCache) -> None:
    """Scope A's only output starts a background re-index; B's outputs evict it before the build
    installs its index (the build needs the lock this thread holds)."""
    with cache.lock:
        cache.ingest("A", np.arange(100, 140, dtype=np.int32))
        assert cache.scopes["A"].building
        for _ in range(3):
            cache.ingest("B", np.arange(200, 240, dtype=np.int32))
        assert [c.scope for c in cache.fifo] == ["B", "B"] and "A" in cache.scopes


def test_a_scope_evicted_while_its_background_reindex_runs_is_dropped_once_built():
    cache = SuffixCache(replace(EXACT, max_cached_tokens=100, index_every=16), background=True)
    _evict_scope_a_during_its_build(cache)
    _wait_built(cache)
    assert "A" not in cache.scopes  # not kept forever with an index of evicted tokens
    assert cache.nbytes() == cache.scopes["B"].nbytes()


def test_a_fully_evicted_scope_kept_by_a_live_request_is_dropped_when_it_finishes_empty():
    cache = SuffixCache(replace(EXACT, max_cached_tokens=100, index_every=16), background=True)
    req = SuffixRequest(cache, "A")
    _evict_scope_a_during_its_build(cache)
    _wait_built(cache)
    assert "A" in cache.scopes  # the live request keeps it
    assert req.propose().source == ""  # but nothing evicted is proposed
    assert req.close().tolist() == []
    assert "A" not in cache.scopes


# ---------------------------------------------------------------------------------------------
# scopes


def test_a_scope_never_proposes_another_scopes_outputs():
    cache = SuffixCache(EXACT, background=False)
    secret = np.arange(300, 340, dtype=np.int32)
    cache.ingest("Y", secret)
    cache.ingest("X", np.arange(10, 50, dtype=np.int32))
    live_y = SuffixRequest(cache, "Y")
    live_y.extend([1])
    live_y.extend(np.arange(600, 640).tolist())  # a running request of scope Y
    for reindexed in (False, True):
        if reindexed:
            for s in list(cache.scopes.values()):
                cache.reindex(s, force=True)
        for ctx in (secret[:8], np.arange(600, 610)):
            in_x = SuffixRequest(cache, "X")
            in_x.extend([1, 2, *ctx.tolist()])
            got = in_x.propose()
            assert "global" not in got.source
            assert not set(got.tokens) & set(range(int(ctx[-1]) + 1, int(ctx[-1]) + 30))
            in_x.close()
            in_y = SuffixRequest(cache, "Y")
            in_y.extend([1, 2, *ctx.tolist()])
            got = in_y.propose()
            assert got.source == "global" and got.tokens[0] == int(ctx[-1]) + 1
            in_y.close()
    live_y.close()


# ---------------------------------------------------------------------------------------------
# bounded memory

BYTES_PER_CACHED_TOKEN = 200  # measured peak ~147 B: index 40 B, tail buffers up to ~112 B, per-scope tables


def test_memory_stays_bounded_over_10k_synthetic_requests():
    rng = np.random.default_rng(0)
    max_cached = 50_000
    cfg = SuffixConfig(max_cached_tokens=max_cached, index_every=4096)
    cache = SuffixCache(cfg, background=False)  # deterministic: a background build lets the tail grow meanwhile
    phrases = [rng.integers(0, 2000, int(rng.integers(4, 16))).tolist() for _ in range(300)]
    lengths = rng.integers(20, 201, 10_000)
    picks = rng.integers(0, len(phrases), (10_000, 20))
    noise = rng.integers(0, 2000, (10_000, 200))
    longest = int(lengths.max())
    peak_bytes = peak_tokens = peak_scopes = 0
    proposed = 0
    for i in range(10_000):
        scope = f"tenant-{i % 7}" if i < 5000 else f"user-{i}"  # then a new scope per request
        out: list[int] = []
        j = 0
        while len(out) < lengths[i]:
            out += phrases[picks[i, j % 20]] if (i + j) % 3 else noise[i, j * 8 % 192 : j * 8 % 192 + 8].tolist()
            j += 1
        out = out[: lengths[i]]
        req = SuffixRequest(cache, scope)
        req.extend(out[:8])  # the prompt
        half = len(out) // 2
        req.extend(out[8:half])
        proposed += bool(req.propose(max_nodes=16, max_depth=8).tokens)
        req.extend(out[half:])
        req.close()
        if i % 50 == 0 or i > 9_990:
            with cache.lock:
                peak_tokens = max(peak_tokens, cache.cached_tokens)
                peak_scopes = max(peak_scopes, len(cache.scopes))
                stored = sum(s.stored_tokens() for s in cache.scopes.values())
                assert not any(s.live for s in cache.scopes.values())
                assert len(cache.scopes) <= len(cache.fifo) + 7  # + the 7 tenants' (being re-indexed)
            assert cache.cached_tokens <= max_cached + longest
            peak_bytes = max(peak_bytes, cache.nbytes())
            assert stored <= 2 * (max_cached + longest)  # evicted tokens are compacted away
    peak_bytes = max(peak_bytes, cache.nbytes())
    print(f"peak {peak_bytes / max_cached:.1f} B/token, {peak_scopes} scopes, {cache.builds} builds, {proposed} trees")
    assert proposed > 2_000  # the repeated phrases were proposed
    assert cache.builds > 10
    assert peak_tokens <= max_cached + longest
    assert peak_bytes <= BYTES_PER_CACHED_TOKEN * max_cached, peak_bytes / max_cached
    # one scope per request: only the scopes still holding a cached output remain
    assert peak_scopes <= max_cached // 20 + 8
    assert len(cache.scopes) <= len(cache.fifo) + 1


# ---------------------------------------------------------------------------------------------
# Calibration: the path probabilities sent are the acceptance measured per node kind

# Root children 7 (3 of 4 occurrences) and 5 (1 of 4); 8 follows 7 in 2 of its 3 occurrences.
FORK = Proposal([7, 5, 8], [-1, -1, 0], [0.75, 0.25, 0.5], "global", 2, 1.5, rows=4)


def test_calibration_converges_to_each_node_kinds_measured_acceptance_not_its_count_ratio():
    """The target continues 7 8 in 20% of steps, 7 9 in 10%, 5 in 10%, something else in 60%: the
    counts said 0.75 / 0.5 / 0.25. After 2000 steps the sent probabilities are what was measured
    (7: 0.3, its child 8: 0.2 along the path, 5: 0.1), within the prior's pull."""
    rng = np.random.default_rng(0)
    cal = Calibration(prior=2.0)
    outcomes = {0: [7, 8], 1: [7, 9], 2: [5, 1], 3: [3, 3]}
    for k in rng.choice(4, size=2000, p=[0.2, 0.1, 0.1, 0.6]):
        cal.learn(cal.apply(FORK)[1], outcomes[int(k)])
    probs = cal.apply(FORK)[0].probs
    assert probs == pytest.approx([0.3, 0.1, 0.2], abs=0.04)


def test_only_nodes_whose_parent_path_was_emitted_are_scored_whatever_the_verifier_cut():
    """Emitted 5 …: both root children are scored (5 right, 7 wrong), 8 under the wrong 7 is not;
    emitted 7 8: 7, 5 and 8 are scored, also if the verifier had cut 8 (the emitted token at depth 2
    is the target's own); emitted tokens stop at depth 1: 8 is not scored."""
    cal = Calibration()
    assert cal.learn(cal.apply(FORK)[1], [5, 6]) == 2
    assert cal.learn(cal.apply(FORK)[1], [7, 8]) == 3
    assert cal.learn(cal.apply(FORK)[1], [7]) == 2
    assert cal.trials.sum() == 7 and cal.hits.sum() == 4  # 5; 7 and 8; 7
    assert cal.learn(None, [7]) == 0 and cal.learn(cal.apply(FORK)[1], []) == 0


def test_a_calibration_bin_follows_the_recent_traffic_in_a_bounded_window():
    cal = Calibration()
    for _ in range(3000):
        cal.learn(cal.apply(FORK)[1], [7, 8])
    for _ in range(2000):
        cal.learn(cal.apply(FORK)[1], [5])
    assert cal.trials.max() <= 1024
    assert cal.apply(FORK)[0].probs[1] > 0.9  # 5 is right now, whatever 3000 steps said before
    assert cal.apply(FORK)[0].probs[0] < 0.1


def test_calibrated_trees_are_ancestor_closed_most_probable_first():
    """Whatever the bins learned, a node's calibrated path probability never exceeds its parent's,
    so the union (sorted by probability) keeps parents before children and the verifier's cut to the
    first w nodes is a tree."""
    rng = np.random.default_rng(3)
    cache = SuffixCache(replace(SuffixConfig(), index_every=64), background=False)
    outputs = _outputs(rng, 80)
    for out in outputs:
        cache.ingest("s", out)
    for out in outputs[:40]:
        req = SuffixRequest(cache, "s")
        req.extend(out[:4].tolist())
        for t in out[4:].tolist():
            tree = req.propose()
            assert all(p < 0 or p < i for i, p in enumerate(tree.parents))
            assert all(p < 0 or tree.probs[i] <= tree.probs[p] + 1e-12 for i, p in enumerate(tree.parents))
            assert tree.probs == sorted(tree.probs, reverse=True)
            req.extend([t])
        req.close()
    assert cache.calibration is not None and cache.calibration.trials.sum() > 0


def test_a_stream_scores_its_last_proposal_when_the_tokens_after_it_arrive():
    cache = SuffixCache(SuffixConfig(), background=False)
    cache.ingest("s", np.array([1, 2, 3, 4, 5], np.int32))
    req = SuffixRequest(cache, "s")
    req.extend([9, 1, 2])
    assert cache.calibration.trials.sum() == 0  # the prompt follows no proposal
    tree = req.propose()
    assert tree.tokens[:3] == [3, 4, 5] and tree.probs[0] == 1.0  # nothing measured yet: the counts
    req.extend([3, 4, 7])  # 3 and 4 right, 5 wrong
    assert (cache.calibration.hits.sum(), cache.calibration.trials.sum()) == (2, 3)
    req.extend([8])  # no proposal since: nothing scored twice
    assert cache.calibration.trials.sum() == 3
    off = SuffixCache(replace(SuffixConfig(), calibrate=False), background=False)
    assert off.calibration is None
