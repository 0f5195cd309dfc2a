"""The n-gram proposal core on tiny token arrays."""

from specmesh_server.ngram import NgramConfig, NgramIndex, propose_tree


def _index(tokens: list[int], **cfg) -> NgramIndex:
    idx = NgramIndex(NgramConfig(**cfg))
    idx.extend(tokens)
    return idx


def test_longest_suffix_match_wins_over_shorter_ones():
    # suffix "8 1 2": the 3-gram occurred once (→ 9), the 2-gram "1 2" also before 3 and 4.
    ctx = [1, 2, 3, 1, 2, 4, 8, 1, 2, 9, 5, 8, 1, 2]
    tokens, parents = _index(ctx, min_n=2, max_n=3).propose(max_nodes=8, max_depth=1)
    assert tokens == [9] and parents == [-1]


def test_one_to_many_matches_become_sibling_branches_heaviest_first():
    ctx = [7, 1, 5, 7, 1, 6, 7, 1, 6, 7, 1]  # after "7 1": 5 once, 6 twice (and more recent)
    tokens, parents = _index(ctx, min_n=2, max_n=2).propose(max_nodes=2, max_depth=1)
    assert tokens == [6, 5] and parents == [-1, -1]


def test_budget_depth_and_topological_order_are_respected():
    ctx = list(range(20)) + list(range(5))
    tokens, parents = _index(ctx, min_n=2, max_n=4).propose(max_nodes=6, max_depth=4)
    assert tokens == [5, 6, 7, 8] and parents == [-1, 0, 1, 2]  # a chain, cut at depth 4
    tokens, parents = _index([*ctx, 0, 1], min_n=2, max_n=4).propose(max_nodes=3, max_depth=10)
    assert len(tokens) == 3 and all(p < i for i, p in enumerate(parents))


def test_no_match_proposes_nothing():
    assert _index([1, 2, 3, 4, 5]).propose() == ([], [])
    assert _index([3]).propose() == ([], [])


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
