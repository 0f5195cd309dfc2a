"""Admission against the KV memory budget, and how long a prefill chunk may be.

The slot cache is dense: every running request's row is as long as the longest one's need, so
the running set takes ``len(running) × max(need)`` positions. A request's *need* is the positions
it holds now plus room for one verification step (the pending token and a full tree); a request
still in prefill needs its whole prompt. The engine keeps that product within the budget:

- a waiting request joins only when the product with it stays within the budget, with
  ``margin`` positions per row to spare so the running requests can grow a while before the newest
  must leave again (first come, first served: the head of the queue waits, nobody overtakes it);
- when the running requests grow past the budget, the youngest leave (*preemption*): their KV is
  dropped and recomputed from their tokens when they rejoin, so their output does not change;
- a request that could not fit even alone is refused when it arrives.
"""

from __future__ import annotations

from collections.abc import Sequence


def fits(needs: Sequence[int], budget: int | None) -> bool:
    """Whether rows needing ``needs`` positions fit a dense cache of ``budget`` positions.

    >>> fits([300, 1200], 2400), fits([300, 1200, 10], 2400), fits([5] * 9, None)
    (True, False, True)
    """
    return budget is None or not needs or len(needs) * max(needs) <= budget


def admits(needs: Sequence[int], candidate: int, budget: int | None, margin: int) -> bool:
    """Whether a waiting request needing ``candidate`` positions may join rows needing ``needs``,
    each row keeping ``margin`` positions to grow into.

    >>> admits([300], 900, 2400, margin=256)   # 2 × (900 + 256) = 2312
    True
    >>> admits([300], 1000, 2400, margin=256)  # 2 × 1256 = 2512
    False
    >>> admits([], 2300, 2400, margin=256)     # alone, a request joins if it fits at all
    True
    """
    if budget is None:
        return True
    rows = [*needs, candidate]
    if len(rows) == 1:
        return candidate <= budget
    return len(rows) * (max(rows) + margin) <= budget


def preemptions(needs_oldest_first: Sequence[int], budget: int | None) -> int:
    """How many of the youngest rows must leave so the rest fit; the oldest always stays.

    >>> preemptions([1000, 200, 900, 300], 2400)  # 4 × 1000 and 3 × 1000 are over, 2 × 1000 fits
    2
    >>> preemptions([3000], 2400)  # alone it stays (it was refused at arrival if it can never fit)
    0
    """
    n = len(needs_oldest_first)
    while n > 1 and not fits(needs_oldest_first[:n], budget):
        n -= 1
    return len(needs_oldest_first) - n


def chunk_tokens(budget: int, start: int, keys_per_token: float, least: int = 16) -> int:
    """Prompt tokens for a prefill chunk beginning at position ``start`` so that its work stays near
    that of ``budget`` tokens at the start of a prompt: each token's work grows with the keys it
    attends, one token's linear layers costing as much as attending ``keys_per_token`` keys. This
    bounds the gap a prefill puts between the running requests' tokens, however long the prompt.

    >>> chunk_tokens(512, 0, 3000), chunk_tokens(512, 3000, 3000), chunk_tokens(512, 9000, 3000)
    (512, 256, 128)
    """
    return max(least, int(budget * keys_per_token / (keys_per_token + start)))
