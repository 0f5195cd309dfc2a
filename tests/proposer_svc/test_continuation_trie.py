"""The proposers' shared continuation trie reproduces, on tiny worked examples, what the two builders
it replaced returned: the suffix proposer's numba trie (``continuation_tree``: tokens, parents,
count / rows, nodes below ``min_prob`` dropped) and the RAG proposer's vectorised one
(``continuation_trie``: -1 padded rows in suffix-array order; tokens, parents). The expected values
below were printed by those builders before they were deleted."""

from __future__ import annotations

import numpy as np
import pytest

from proposer_svc.core.continuation_trie import continuations, heaviest_nodes
from proposer_svc.rag.lookup import SEP as RAG_SEP
from proposer_svc.rag.lookup import concat_documents
from proposer_svc.suffix.index import SEP as SUFFIX_SEP
from proposer_svc.suffix.trees import continuation_tree

# rows (-1 ends a row), max_nodes → the former builders' (tokens, parents) and the suffix one's probs
EXAMPLES = [
    ([[7, 8], [7, 8], [7, 9], [5, -1]], 2, [7, 8], [-1, 0], [0.75, 0.5]),
    ([[7, 8], [7, 8], [7, 9], [5, -1]], 3, [7, 8, 5], [-1, 0, -1], [0.75, 0.5, 0.25]),
    ([[7, 8], [7, 8], [7, 9], [5, -1]], 100, [7, 8, 5, 9], [-1, 0, -1, 0], [0.75, 0.5, 0.25, 0.25]),
    ([[5, 6, 7], [8, 9, -1]], 3, [5, 8, 6], [-1, -1, 0], [0.5, 0.5, 0.5]),
    ([[5, 6, 7], [8, 9, -1]], 100, [5, 8, 6, 9, 7], [-1, -1, 0, 1, 2], [0.5] * 5),
    ([[3, 4, -1], [3, 4, 6], [3, 5, -1]], 2, [3, 4], [-1, 0], [1.0, 2 / 3]),
    ([[3, 4, -1], [3, 4, 6], [3, 5, -1]], 100, [3, 4, 5, 6], [-1, 0, 0, 1], [1.0, 2 / 3, 1 / 3, 1 / 3]),
    ([[1, 2, 3], [1, 2, 4], [1, 5, -1], [6, -1, -1], [6, 7, -1], [6, 7, 8]], 3, [1, 6, 2], [-1, -1, 0],
     [0.5, 0.5, 1 / 3]),
    ([[1, 2, 3], [1, 2, 4], [1, 5, -1], [6, -1, -1], [6, 7, -1], [6, 7, 8]], 100, [1, 6, 2, 7, 5, 3, 4, 8],
     [-1, -1, 0, 1, 0, 2, 2, 3], [0.5, 0.5, 1 / 3, 1 / 3, 1 / 6, 1 / 6, 1 / 6, 1 / 6]),
    ([[4, 4, 4, 4]], 3, [4, 4, 4], [-1, 0, 1], [1.0, 1.0, 1.0]),
    ([[-1, -1], [-1, -1]], 100, [], [], []),
]  # fmt: skip


@pytest.mark.parametrize(("rows", "max_nodes", "tokens", "parents", "probs"), EXAMPLES)
def test_the_shared_trie_reproduces_the_former_suffix_and_rag_builders(rows, max_nodes, tokens, parents, probs):
    conts = np.array(rows, np.int64)
    # the RAG builder's form: -1 padded rows
    top = heaviest_nodes(conts, max_nodes, stop=-1)
    assert (top.tokens.tolist(), top.parents.tolist()) == (tokens, parents)
    assert top.shares.tolist() == probs
    # as the RAG proposer now calls it: uint32 rows padded with the corpus separator
    rag = heaviest_nodes(np.where(conts < 0, RAG_SEP, conts).astype(np.uint32), max_nodes, stop=RAG_SEP)
    assert (rag.tokens.tolist(), rag.parents.tolist()) == (tokens, parents)
    # the suffix builder's form: int32 rows padded with its separator, probabilities count / rows
    tree = continuation_tree(np.where(conts < 0, SUFFIX_SEP, conts).astype(np.int32), max_nodes, 0.0)
    assert (tree.tokens, tree.parents, tree.probs) == (tokens, parents, probs)


def test_the_shared_trie_drops_what_the_former_suffix_builder_dropped_below_min_prob():
    rows = [[1, 2, 3], [1, 2, 4], [1, 5, -1], [6, -1, -1], [6, 7, -1], [6, 7, 8]]
    conts = np.where(np.array(rows) < 0, SUFFIX_SEP, rows).astype(np.int32)
    tree = continuation_tree(conts, 100, 0.3)
    assert (tree.tokens, tree.parents, tree.probs) == ([1, 6, 2, 7], [-1, -1, 0, 1], [0.5, 0.5, 1 / 3, 1 / 3])
    assert heaviest_nodes(conts, 100, stop=SUFFIX_SEP, min_share=2 / 6).tokens.tolist() == [1, 6, 2, 7]


def test_continuations_reproduce_the_former_gatherers():
    # the suffix proposer's: int32 buffer, SEP-padded rows written from a row offset, stopped at the out rows
    out = np.zeros((3, 3), np.int32)
    assert continuations(np.array([1, 2, SUFFIX_SEP, 3], np.int32), np.array([0, 3, 2]), 3, out, 0, SUFFIX_SEP) == 3
    assert out.tolist() == [[1, 2, SUFFIX_SEP], [3, SUFFIX_SEP, SUFFIX_SEP], [SUFFIX_SEP] * 3]
    assert continuations(np.array([1, 2], np.int32), np.array([0, 1]), 2, out, 2, SUFFIX_SEP) == 3
    assert out[2].tolist() == [1, 2, SUFFIX_SEP]  # depth 2: the third column kept
    # the RAG proposer's gather_continuations gave [[2, 3, -1], [4, -1, -1]]: the same rows, SEP-padded
    corpus = concat_documents([[1, 2, 3], [1, 4]])
    rag = np.empty((2, 3), np.uint32)
    assert continuations(corpus, np.array([1, 5], np.int64), 3, rag, 0, RAG_SEP) == 2
    assert rag.tolist() == [[2, 3, RAG_SEP], [4, RAG_SEP, RAG_SEP]]


def test_rows_need_not_be_sorted_and_empty_inputs_give_no_nodes():
    rows = np.array([[6, 7], [1, 2], [6, 7], [1, 5], [1, 2]])
    top = heaviest_nodes(rows, 8, stop=-1)  # 1: 3/5, 6, 7 and 2: 2/5 — ties shallower, then first seen
    assert (top.tokens.tolist(), top.parents.tolist(), top.shares.tolist()) == (
        [1, 6, 7, 2, 5], [-1, -1, 1, 0, 0], [3 / 5, 2 / 5, 2 / 5, 2 / 5, 1 / 5]
    )  # fmt: skip
    assert heaviest_nodes(np.zeros((0, 4), np.int64), 8, stop=-1).tokens.tolist() == []
    assert heaviest_nodes(rows, 0, stop=-1).tokens.tolist() == []
