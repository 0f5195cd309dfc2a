"""The n-gram proposal core on tiny token arrays."""

import pytest

from specmesh.server.ngram import NgramConfig, NgramIndex, propose_tree
from specmesh.server.tree import validate_tree


def _index(tokens: list[int], **cfg) -> NgramIndex:
    idx = NgramIndex(NgramConfig(**cfg))
    idx.extend(tokens)
    return idx


def _shape(idx: NgramIndex, **budget) -> tuple[list[int], list[int]]:
    tree = idx.propose(**budget)
    return tree.tokens, tree.parents


def test_longest_suffix_match_wins_over_shorter_ones():
    # suffix "8 1 2": the 3-gram occurred once (→ 9), the 2-gram "1 2" also before 3 and 4.
    ctx = [1, 2, 3, 1, 2, 4, 8, 1, 2, 9, 5, 8, 1, 2]
    tokens, parents = _shape(_index(ctx, min_n=2, max_n=3), max_nodes=8, max_depth=1)
    assert tokens == [9] and parents == [-1]


def test_one_to_many_matches_become_sibling_branches_heaviest_first():
    ctx = [7, 1, 5, 7, 1, 6, 7, 1, 6, 7, 1]  # after "7 1": 5 once, 6 twice (and more recent)
    tokens, parents = _shape(_index(ctx, min_n=2, max_n=2), max_nodes=2, max_depth=1)
    assert tokens == [6, 5] and parents == [-1, -1]


def test_budget_depth_and_topological_order_are_respected():
    ctx = list(range(20)) + list(range(5))
    tokens, parents = _shape(_index(ctx, min_n=2, max_n=4), max_nodes=6, max_depth=4)
    assert tokens == [5, 6, 7, 8] and parents == [-1, 0, 1, 2]  # a chain, cut at depth 4
    tokens, parents = _shape(_index([*ctx, 0, 1], min_n=2, max_n=4), max_nodes=3, max_depth=10)
    assert len(tokens) == 3 and all(p < i for i, p in enumerate(parents))


def test_no_match_proposes_nothing():
    assert _shape(_index([1, 2, 3, 4, 5])) == ([], [])
    assert _shape(_index([3])) == ([], [])


def test_incremental_index_equals_one_built_at_once():
    ctx = [4, 5, 6, 4, 5, 7, 4, 5, 6, 1, 4, 5]
    grown = NgramIndex(NgramConfig())
    for i in range(0, len(ctx), 3):
        grown.extend(ctx[i : i + 3])
    whole = _index(ctx)
    assert grown.table == whole.table
    assert grown.propose() == whole.propose()
    cfg = NgramConfig()
    assert whole.propose() == propose_tree(
        ctx, whole.table, cfg.min_n, cfg.max_n, cfg.max_occurrences, cfg.max_nodes, cfg.max_depth
    )


def test_path_probabilities_are_the_occurrence_weight_through_each_node():
    """An occurrence weighs 1 + its recency (start / context length); a node's path probability is
    the weight through it over all the occurrences': siblings share their parent's, a child never
    exceeds its parent, and the tree is one the verifier accepts."""
    ctx = [7, 1, 5, 2, 7, 1, 6, 3, 7, 1, 6, 4, 7, 1]  # after "7 1": 5 2 (start 2), 6 3 (6), 6 4 (10)
    tree = _index(ctx, min_n=2, max_n=2).propose(max_nodes=5, max_depth=2)
    w = {s: 1 + s / len(ctx) for s in (2, 6, 10)}
    total = sum(w.values())
    assert tree.tokens == [6, 4, 3, 5, 2] and tree.parents == [-1, 0, 0, -1, 3]  # heaviest first
    assert tree.probs == pytest.approx(
        [(w[6] + w[10]) / total, w[10] / total, w[6] / total, w[2] / total, w[2] / total]
    )
    assert tree.probs[1] + tree.probs[2] == pytest.approx(tree.probs[0])  # the children split their parent
    validate_tree(tree, vocab_size=10, max_nodes=5, max_depth=2)
