"""Prompt-lookup (n-gram) proposal: continuations of the longest recent suffix match, as a tree.

The index maps every n-gram (min_n ≤ n ≤ max_n) of the context to the positions right after
its occurrences, and is extended token by token as the context grows (never rebuilt).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NgramConfig:
    min_n: int = 2  # shortest suffix worth matching; 1-grams propose noise on prose
    max_n: int = 5
    max_occurrences: int = 32  # most recent occurrences of the matched n-gram considered
    max_nodes: int = 16
    max_depth: int = 12


@dataclass
class NgramIndex:
    """Context tokens plus, per n-gram, where its occurrences end (the continuation start)."""

    config: NgramConfig
    tokens: list[int] = field(default_factory=list)
    table: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    @property
    def context_length(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens, indexing each n-gram that now ends at the new positions."""
        for tok in new_tokens:
            self.tokens.append(tok)
            end = len(self.tokens)
            for n in range(self.config.min_n, self.config.max_n + 1):
                if end - n < 0:
                    break
                # The n-gram ending here continues at `end` (known once more tokens arrive).
                self.table.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def propose(self, max_nodes: int | None = None, max_depth: int | None = None) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the proposal tree for the current context; empty when nothing matches."""
        cfg = self.config
        return propose_tree(
            self.tokens,
            self.table,
            cfg.min_n,
            cfg.max_n,
            cfg.max_occurrences,
            max_nodes if max_nodes is not None else cfg.max_nodes,
            max_depth if max_depth is not None else cfg.max_depth,
        )


def propose_tree(
    tokens: list[int],
    table: dict[tuple[int, ...], list[int]],
    min_n: int,
    max_n: int,
    max_occurrences: int,
    max_nodes: int,
    max_depth: int,
) -> tuple[list[int], list[int]]:
    """Tree of the continuations after the longest suffix n-gram that occurred before.

    Each earlier occurrence contributes its continuation (up to ``max_depth`` tokens) to a trie;
    an occurrence weighs 1 + its relative recency (0..1), a trie node the sum over the
    occurrences through it. Nodes are taken best-first (a child only after its parent) until
    ``max_nodes``; siblings come out heaviest first. Returns topologically ordered (tokens, parents).

    Worked example: context ``a b c d a b c e a b`` (a=1 … e=5), suffix ``a b`` occurred at
    positions 0 and 4, continuing ``c d a`` (weight 1.2) and ``c e a`` (weight 1.6). Both share
    ``c`` (2.8); best-first then takes ``e``, the ``a`` after it, and last ``d``:

    >>> ctx = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    >>> idx = NgramIndex(NgramConfig(min_n=2, max_n=3)); idx.extend(ctx)
    >>> idx.propose(max_nodes=4, max_depth=3)
    ([3, 5, 1, 4], [-1, 0, 1, 0])
    """
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        starts = [s for s in table.get(tuple(tokens[end - n :]), ()) if s < end]
        if starts:
            break
    else:
        return [], []
    starts = starts[-max_occurrences:]
    # Trie over continuations: node = (token, parent trie id); weights accumulate.
    trie_children: list[dict[int, int]] = [{}]  # trie id 0 is the root
    trie_token, trie_parent, weight = [-1], [-1], [0.0]
    for s in starts:
        w = 1.0 + s / end
        node = 0
        for tok in tokens[s : s + max_depth]:
            child = trie_children[node].get(tok)
            if child is None:
                child = len(trie_token)
                trie_children[node][tok] = child
                trie_children.append({})
                trie_token.append(tok)
                trie_parent.append(node)
                weight.append(0.0)
            weight[child] += w
            node = child
    # Best-first selection within the node budget; parents always precede their children.
    out_tokens: list[int] = []
    out_parents: list[int] = []
    out_index = {0: -1}
    frontier = [(-weight[c], c) for c in trie_children[0].values()]
    heapq.heapify(frontier)
    while frontier and len(out_tokens) < max_nodes:
        _, node = heapq.heappop(frontier)
        out_index[node] = len(out_tokens)
        out_tokens.append(trie_token[node])
        out_parents.append(out_index[trie_parent[node]])
        for c in trie_children[node].values():
            heapq.heappush(frontier, (-weight[c], c))
    return out_tokens, out_parents
