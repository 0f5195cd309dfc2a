"""Tree validation rejects every malformed shape; the verification layout encodes ancestry."""

import pytest
import torch

from specmesh_server.tree import InvalidTree, TokenTree, validate_tree, verification_layout


@pytest.mark.parametrize(
    ("tree", "why"),
    [
        (TokenTree([1, 2], [-1, 1]), "parent 1 is not an earlier node"),  # self-loop
        (TokenTree([1, 2, 3], [-1, 2, 1]), "not an earlier node"),  # cycle 1 → 2 → 1
        (TokenTree([1], [-2]), "not an earlier node"),
        (TokenTree([1, 99], [-1, 0]), "outside the vocabulary"),
        (TokenTree([1, -3], [-1, 0]), "outside the vocabulary"),
        (TokenTree(list(range(9)), [-1] * 9), "9 nodes, limit 8"),
        (TokenTree([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3]), "depth 5, limit 4"),
        (TokenTree([1, 2], [-1]), "2 tokens but 1 parents"),
        (TokenTree([1], [-1], [([1, 2], [0.7, 0.7])]), "sum to 1"),
        (TokenTree([1], [-1], [([1, 2], [-0.5, 1.5])]), "non-negative"),
        (TokenTree([3], [-1], [([1, 2], [0.5, 0.5])]), "zero proposal probability"),
        (TokenTree([1, 2], [-1, 0], [([1], [1.0])]), "1 distributions for 2 nodes"),
        (TokenTree([1, 2], [-1, 0], probs=[0.5]), "1 path probabilities for 2 nodes"),
        (TokenTree([1], [-1], probs=[1.5]), r"lie in \[0, 1\]"),
        (TokenTree([1], [-1], probs=[float("nan")]), r"lie in \[0, 1\]"),
    ],
)
def test_malformed_trees_are_rejected_with_the_reason(tree, why):
    with pytest.raises(InvalidTree, match=why):
        validate_tree(tree, vocab_size=10, max_nodes=8, max_depth=4)


def test_layout_each_node_sees_prefix_pending_and_ancestors_only():
    parents = [-1, 0, 0, 1, -1]
    pos, mask = verification_layout(parents, prefix_len=3)
    assert pos.tolist() == [3, 4, 5, 5, 6, 4]
    new = mask[:, 3:]  # [pending, nodes] part
    assert new[4].tolist() == [True, True, True, False, True, False]  # node 3: root, 0, 1, itself
    assert new[5].tolist() == [True, False, False, False, False, True]
    assert mask[:, :3].all()
    assert torch.equal(new.diagonal(), torch.ones(6, dtype=torch.bool))
