"""The retrieval lookup core on tiny token arrays: suffix array, longest suffix match,
continuations merged into a frequency-weighted trie, budget / depth / topological order."""

import numpy as np
import pytest

from proposer_svc.core.continuation_trie import heaviest_nodes
from proposer_svc.rag.lookup import (
    SEP,
    CorpusIndex,
    RagConfig,
    RagRequest,
    build_suffix_array,
    concat_documents,
    longest_suffix_match,
    propose_tree,
)


def _index(*docs: list[int]) -> CorpusIndex:
    return CorpusIndex.build(concat_documents(docs))


def _naive_sa(t: np.ndarray) -> list[int]:
    return sorted(range(len(t)), key=lambda i: t[i:].tolist())


@pytest.mark.parametrize("alphabet", [1, 2, 3, 50])
def test_suffix_array_equals_naive_sort_on_random_and_repetitive_arrays(alphabet):
    rng = np.random.default_rng(alphabet)
    for _ in range(60):
        t = rng.integers(0, alphabet, int(rng.integers(1, 80)))
        assert build_suffix_array(t).tolist() == _naive_sa(t)
    periodic = np.tile(np.array([3, 1, 2]), 40)  # long repeats need many doubling rounds
    assert build_suffix_array(periodic).tolist() == _naive_sa(periodic)


def test_suffix_array_with_separators_sorts_them_after_every_token():
    t = concat_documents([[2, 1], [2, 1, 0]])
    assert build_suffix_array(t).tolist() == _naive_sa(t)
    assert t[build_suffix_array(t)[-1]] == SEP


def test_longest_suffix_match_prefers_the_longest_and_respects_the_caps():
    idx = _index([1, 2, 3, 4, 5], [9, 3, 4, 6], [4, 7])
    key, sa = idx._key, idx._sa_view
    assert longest_suffix_match(key, sa, [0, 2, 3, 4], 1, 8)[0] == 3  # "2 3 4" (doc 0)
    assert longest_suffix_match(key, sa, [0, 2, 3, 4], 1, 2)[0] == 2  # capped at 2: "3 4" twice
    length, lo, hi = longest_suffix_match(key, sa, [8, 8, 3, 4], 1, 8)
    assert (length, hi - lo) == (2, 2)  # "3 4" occurs in doc 0 and doc 1
    assert longest_suffix_match(key, sa, [8, 4], 2, 8) == (0, 0, 0)  # only a 1-token match: below min
    assert longest_suffix_match(key, sa, [4], 2, 8) == (0, 0, 0)  # context shorter than min_match


def test_matches_never_span_documents():
    idx = _index([1, 2], [3, 4])
    # "2 3" exists only across the document boundary: the longest real match is "3".
    assert longest_suffix_match(idx._key, idx._sa_view, [2, 3], 1, 8)[0] == 1


def test_continuations_from_several_occurrences_merge_into_a_trie_heaviest_first():
    idx = _index([5, 1, 2, 7], [6, 1, 2, 8, 9], [1, 2, 8, 3], [1, 2, 8, 9, 4])
    tokens, parents = propose_tree(idx, [0, 1, 2], RagConfig(min_match=2), max_nodes=8, max_depth=3)
    # after "1 2": 8 (x3; then 9 x2 with 4 after it, 3 x1) and 7 (x1); equal weights: shallower first
    assert tokens == [8, 9, 7, 3, 4] and parents == [-1, 0, -1, 0, 1]


def test_continuations_stop_at_the_end_of_their_document():
    idx = _index([1, 2, 3], [4, 5, 6, 7])
    tokens, parents = propose_tree(idx, [1, 2], RagConfig(), max_nodes=8, max_depth=5)
    assert tokens == [3] and parents == [-1]  # not "3 4 5 …" from the next document


def test_budget_depth_and_topological_order_are_respected():
    rng = np.random.default_rng(0)
    docs = [[1, 2, *rng.integers(3, 7, 10).tolist()] for _ in range(40)]
    idx = _index(*docs)
    for max_nodes, max_depth in ((1, 1), (5, 2), (16, 12), (64, 4)):
        tokens, parents = propose_tree(idx, [1, 2], RagConfig(), max_nodes, max_depth)
        assert 0 < len(tokens) <= max_nodes and len(parents) == len(tokens)
        depth = []
        for i, p in enumerate(parents):
            assert -1 <= p < i  # topological: a parent precedes its children
            depth.append(0 if p < 0 else depth[p] + 1)
        assert max(depth) < max_depth
        siblings = {(p, t) for p, t in zip(parents, tokens, strict=True)}
        assert len(siblings) == len(tokens)  # merged: no two children of a node carry the same token


def continuation_trie(conts: np.ndarray, max_nodes: int) -> tuple[list[int], list[int]]:
    """The RAG proposer's tree of -1 padded continuations, as ``propose_tree`` builds it."""
    top = heaviest_nodes(conts, max_nodes, stop=-1)
    return top.tokens.tolist(), top.parents.tolist()


def test_trie_keeps_the_heaviest_subtree_within_the_node_budget():
    conts = np.array([[1, 2, 3], [1, 2, 4], [1, 5, -1], [6, -1, -1], [6, 7, -1], [6, 7, 8]])
    assert continuation_trie(conts, 3) == ([1, 6, 2], [-1, -1, 0])  # weights 3, 3, 2 (1 before 6: row order)
    assert continuation_trie(conts, 100) == ([1, 6, 2, 7, 5, 3, 4, 8], [-1, -1, 0, 1, 0, 2, 2, 3])
    assert continuation_trie(np.zeros((0, 4), dtype=np.int64), 8) == ([], [])
    assert continuation_trie(np.full((3, 2), -1), 8) == ([], [])


def test_occurrences_beyond_the_cap_are_sampled_in_proportion():
    # 300 documents continue "1 2" with 9, 100 with 8. The 8s come first in suffix order; a cap of
    # 8 occurrences taken evenly keeps the 3:1 ratio (taking the first 8 would see only 8s).
    idx = _index(*([[1, 2, 9]] * 300 + [[1, 2, 8]] * 100))
    cfg = RagConfig(max_occurrences=8)
    assert propose_tree(idx, [1, 2], cfg, max_nodes=2, max_depth=1) == ([9, 8], [-1, -1])


def test_no_match_or_empty_corpus_proposes_nothing():
    assert propose_tree(_index([1, 2, 3]), [7, 8], RagConfig(), 8, 4) == ([], [])
    assert propose_tree(CorpusIndex.build(concat_documents([])), [1, 2], RagConfig(), 8, 4) == ([], [])
    assert propose_tree(_index([1, 2, 3]), [1, 2], RagConfig(), 0, 4) == ([], [])


def test_request_state_grows_with_advances_and_matches_a_direct_lookup():
    idx = _index([10, 11, 12, 13, 14, 15, 16], [20, 11, 12, 30])
    cfg = RagConfig(min_match=2, max_match=4, max_nodes=8, max_depth=3)
    req = RagRequest(idx, cfg)
    req.extend([99, 10, 11])
    assert req.context_length == 3
    assert req.propose() == ([12, 13, 14], [-1, 0, 1])  # "10 11" is unique: its own continuation
    req.extend([12, 13])
    assert req.propose() == propose_tree(idx, [99, 10, 11, 12, 13], cfg, 8, 3) == ([14, 15, 16], [-1, 0, 1])
    req.extend(list(range(100, 120)))
    assert req.context_length == 25 and req.propose() == ([], [])
