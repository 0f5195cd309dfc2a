"""A proposer run inside the verifier process, behind the same session interface as a stream.

``--proposer ngram-local=inprocess:ngram`` gives the verifier the n-gram algorithm without gRPC:
the tree for a context is computed on the engine thread the moment the accepted tokens arrive.
It exists to measure what the service boundary costs (``specmesh bench`` reports n-gram
in-process vs through its service, same run) and for single-box set-ups that want no extra
process. The proposer services remain the scalable path.
"""

from __future__ import annotations

import threading
import time

from specmesh_server.ngram import NgramConfig, NgramIndex
from specmesh_server.tree import TokenTree
from verifier_svc.proposer_client import ProposerLimits, Stored, serve_tree

INPROCESS_PREFIX = "inprocess:"
INPROCESS_KINDS = ("ngram",)


def inprocess_kind(address: str) -> str | None:
    """The proposer kind of an ``inprocess:KIND`` address, else None.

    >>> inprocess_kind("inprocess:ngram"), inprocess_kind("127.0.0.1:50061")
    ('ngram', None)
    """
    if not address.startswith(INPROCESS_PREFIX):
        return None
    kind = address.removeprefix(INPROCESS_PREFIX)
    if kind not in INPROCESS_KINDS:
        raise ValueError(f"in-process proposer {kind!r} not available (known: {', '.join(INPROCESS_KINDS)})")
    return kind


class LocalProposerSession:
    """The n-gram proposer as a ``speculation.ProposerSession``, computed on the engine thread."""

    def __init__(self, name: str, prompt: list[int], limits: ProposerLimits, arrived: threading.Condition) -> None:
        self.name, self.limits = name, limits
        self.failed: str | None = None
        self.invalid_trees = 0
        self.last_invalid = ""
        self._arrived = arrived
        self._index = NgramIndex(NgramConfig(max_nodes=limits.max_nodes, max_depth=limits.max_depth))
        self._tree: Stored = None
        self.sent: TokenTree | None = None
        self.last_response = time.perf_counter()
        self.hidden_dtype: int | None = None  # n-gram needs no hidden states
        self.advance(prompt)

    def take(self, context_length: int, recent: list[int] | None = None) -> TokenTree | None:
        got = self._tree
        tree, self._tree = serve_tree(got, context_length, recent)
        self.sent = got[1] if tree is not None and got is not None else None
        return tree

    def has_tree_for(self, context_length: int) -> bool:
        return self._tree is not None and self._tree[0] == context_length

    def advance(self, tokens: list[int], hidden: object = None) -> None:
        self._index.extend(tokens)
        toks, parents = self._index.propose(self.limits.max_nodes, self.limits.max_depth)
        self._tree = (self._index.context_length, TokenTree(toks, parents))
        self.last_response = time.perf_counter()

    def fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = f"proposer {self.name!r} failed: {reason}"

    def close(self) -> None:
        pass
