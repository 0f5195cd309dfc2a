"""Admission against the KV memory budget, and how long a prefill chunk may be.

The cache is paged (``specmesh_server.paged_kv``): a request holds the blocks its positions fill, so
the running set takes the sum of its requests' blocks, not rows × the longest. A request's *need* is
the blocks it must add before its next forward: a joining request its whole prompt (less the blocks a
prefix-cache hit brings) plus room for one verification step (the pending token and a full tree), a
running one room for one step past what it holds. The engine keeps the needs within the free blocks
(never used, or evictable: cached blocks no running request holds):

- a waiting request joins only when its need and the running requests' fit the free blocks with
  ``margin`` blocks per row to spare, so the running requests can grow a while before the newest must
  leave again (first come, first served: the head of the queue waits, nobody overtakes it);
- when the running requests' needs pass the free blocks, the youngest leave (*preemption*): their
  blocks go back (their full ones stay cached, so on return they find them if nobody evicted them) and
  their KV is recomputed from their tokens, so their output does not change;
- a request that could not fit even alone is refused when it arrives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from verifier_svc.events import NeverFits

if TYPE_CHECKING:
    from specmesh_server.kv_blocks import BlockManager
    from verifier_svc import sequence


def check_fits(prompt_tokens: int, max_tokens: int, max_context: int, step_room: int, budget: int) -> None:
    """Refuse (:class:`NeverFits`) a request that could not fit the KV budget of ``budget`` positions
    even alone: its prompt and ``max_tokens`` (within ``max_context``) plus one verification step's
    ``step_room``.

    >>> check_fits(100, 50, 8192, step_room=129, budget=279)   # 100 + 50 + 129 = 279: it fits
    >>> check_fits(100, 51, 8192, step_room=129, budget=279)
    Traceback (most recent call last):
    ...
    verifier_svc.events.NeverFits: the request needs up to 280 KV cache positions (prompt 100 + max_tokens 51 + ...
    """
    need = min(prompt_tokens + max_tokens, max_context) + step_room
    if need > budget:
        raise NeverFits(
            f"the request needs up to {need} KV cache positions (prompt {prompt_tokens} + max_tokens "
            f"{max_tokens} + {step_room} for a verification step), over this verifier's KV "
            f"budget of {budget} positions (--kv-cache-memory); send a shorter prompt or a lower max_tokens"
        )


def need_blocks(blocks: BlockManager, seq: sequence.Sequence, step_room: int) -> int:
    """Blocks ``seq`` must add before its next step, past those it holds: room for its cache target
    (a joining request's whole prompt) and one step (``step_room`` positions)."""
    held = len(seq.blocks.blocks) if seq.blocks is not None else 0
    return max(blocks.blocks_for(seq.cache_target + step_room) - held, 0)


def admits(free_blocks: int, running_needs: Sequence[int], candidate: int, margin: int) -> bool:
    """Whether a waiting request needing ``candidate`` blocks may join running requests needing
    ``running_needs`` blocks for their next step, each row keeping ``margin`` blocks to grow into.

    >>> admits(100, [2, 2], 60, margin=10)    # 60 + 4 + 3 × 10 = 94
    True
    >>> admits(100, [2, 2], 70, margin=10)
    False
    >>> admits(100, [], 100, margin=10)       # alone, a request joins if it fits at all
    True
    """
    if not running_needs:
        return candidate <= free_blocks
    return candidate + sum(running_needs) + margin * (len(running_needs) + 1) <= free_blocks


def chunk_tokens(budget: int, start: int, keys_per_token: float, least: int = 16) -> int:
    """Prompt tokens for a prefill chunk beginning at position ``start`` so that its work stays near
    that of ``budget`` tokens at the start of a prompt: each token's work grows with the keys it
    attends, one token's linear layers costing as much as attending ``keys_per_token`` keys. This
    bounds the gap a prefill puts between the running requests' tokens, however long the prompt.

    >>> chunk_tokens(512, 0, 3000), chunk_tokens(512, 3000, 3000), chunk_tokens(512, 9000, 3000)
    (512, 256, 128)
    """
    return max(least, int(budget * keys_per_token / (keys_per_token + start)))
