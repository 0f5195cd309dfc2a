"""A drafted tree as the ``ProposeResponse`` that carries it: what the batching proposers (draft, head)
send for each tree their event thread drafts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from specmesh.v1 import proposer_pb2


class DraftedTree(Protocol):
    """A tree as a drafter leaves it (``DraftTree``, ``SearchTree``): nodes best first, parent -1 = the
    root; ``dists``, for sampled requests, the distribution each node was drawn from."""

    tokens: list[int]
    parents: list[int]
    dists: list[tuple[list[int], list[float]]] | None


def tree_response(
    context_length: int, tree: DraftedTree, path_probs: Sequence[float] = ()
) -> proposer_pb2.ProposeResponse:
    """The response carrying ``tree`` for the context of ``context_length`` tokens; ``path_probs``: each
    node's path probability under the drafter (sent for greedy trees the verifier may cut by value).

    >>> from types import SimpleNamespace as T
    >>> r = tree_response(12, T(tokens=[5, 6], parents=[-1, 0], dists=[([5, 9], [0.75, 0.25]), ([6], [1.0])]))
    >>> r.context_length, list(r.tree.tokens), list(r.tree.parents), list(r.tree.distributions[0].ids)
    (12, [5, 6], [-1, 0], [5, 9])
    >>> list(tree_response(3, T(tokens=[7], parents=[-1], dists=None), [0.5]).tree.path_probs)
    [0.5]
    """
    dists = [proposer_pb2.NodeDistribution(ids=i, probs=p) for i, p in tree.dists or ()]
    msg = proposer_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents, distributions=dists, path_probs=path_probs)
    return proposer_pb2.ProposeResponse(context_length=context_length, tree=msg)
