"""A request's KV blocks around a decode step (``kv_bookkeeping``) and what it reads from and writes
to the prefix cache (``prefix_cache``), on a real block pool: growth for the tree, the accepted path
moved into order, the rejected tail's blocks back, the full blocks committed and found again."""

import torch

from specmesh_server.paged_kv import PagedKVCache
from specmesh_server.tree import TokenTree
from verifier_svc import kv_bookkeeping, prefix_cache
from verifier_svc.requests import GenerationRequest, SpecParams
from verifier_svc.sequence import Sequence


def _seq(prompt: list[int], output: list[int] = (), scope: str = "", salt: str = "", **kw) -> Sequence:
    spec = SpecParams("none", 0, 0, "", "", cache_scope=scope, cache_salt=salt)
    req = GenerationRequest("r", prompt, 0.0, 1.0, 0, 1, 64, (), False, spec, **kw)
    return Sequence(key=0, req=req, sink=print, detok=None, stopper=None, arrival=0.0, output=list(output))


def _cache(num_blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(1, 1, 2, torch.float32, torch.device("cpu"), num_blocks=num_blocks, block_size=4)


class Runner:
    def __init__(self) -> None:
        self.moves = []

    def move_positions(self, moves) -> None:
        self.moves.append(moves)


def test_the_tokens_a_request_caches_are_its_cache_target_and_it_reads_none_it_has_not_scored():
    seq = _seq([1, 2, 3], [7, 8, 9])  # after a preemption: the output but the pending 9
    assert prefix_cache.cache_tokens(seq) == [1, 2, 3, 7, 8] and seq.cache_target == 5
    assert prefix_cache.cache_tokens(_seq([1, 2, 3])) == [1, 2, 3]
    assert prefix_cache.readable(seq) == [1, 2, 3, 7, 8]
    scoring = _seq([1, 2, 3, 4, 5], prompt_logprobs=0)
    assert prefix_cache.readable(scoring) == [1]  # nothing scored yet: only the first token's KV
    scoring.prompt_logprobs = [None, None]
    assert prefix_cache.readable(scoring) == [1, 2, 3]


def test_requests_share_cached_prefixes_only_within_one_model_scope_and_salt():
    scopes = [("a", "", ""), ("b", "", ""), ("a", "x", ""), ("a", "", "y")]  # (model, cache_scope, cache_salt)
    seeds = {prefix_cache.seed(m, _seq([1], scope=s, salt=t)) for m, s, t in scopes}
    assert len(seeds) == 4
    assert prefix_cache.seed("a", _seq([1])) == prefix_cache.seed("a", _seq([2]))


def test_a_step_grows_for_the_tree_then_keeps_the_accepted_path_in_order_and_gives_the_rest_back():
    cache = _cache()
    blocks, pool = cache.manager, cache.manager.pool
    seq = _seq([1, 2, 3, 4, 5, 6], [10])  # prompt of 6 cached, 10 pending
    seq.blocks = blocks.open(prefix_cache.seed("m", seq), prefix_cache.readable(seq))
    rows = kv_bookkeeping.grow_for_prefill(cache, [seq], [seq.uncached(6)])
    assert len(seq.blocks.blocks) == 2 and len(rows.blocks[0]) == 2
    seq.length = 6
    tree = TokenTree([11, 12, 13, 14, 15], [-1, 0, 1, 1, 3])
    rows = kv_bookkeeping.grow_for_trees(cache, [seq], [tree])
    assert len(seq.blocks.blocks) == 3 and len(rows.blocks[0]) == 3  # positions 6…11: 12 in all
    runner = Runner()
    kv_bookkeeping.keep_accepted(runner, [seq], [[0, 2]])
    table = seq.blocks
    assert runner.moves == [[(table, [7, 9], 7)]]  # node 2's KV (at 9) goes to 8
    kv_bookkeeping.settle(blocks, seq, [0, 2])
    assert seq.length == 9 and len(seq.blocks.blocks) == 3
    seq.output += [11, 13, 20]  # the accepted tokens and the bonus (pending now)
    kv_bookkeeping.commit(blocks, seq)
    assert len(seq.blocks.hashes) == 2  # [1 2 3 4] [5 6 10 11] are full
    kv_bookkeeping.close(blocks, seq)
    assert seq.blocks is None and pool.free_blocks == pool.num_blocks
    again = _seq([1, 2, 3, 4, 5, 6, 10, 11, 99])
    assert blocks.open(prefix_cache.seed("m", again), prefix_cache.readable(again)).cached_tokens == 8


def test_a_path_already_in_order_moves_nothing_and_a_rejected_tail_gives_its_blocks_back():
    cache = _cache()
    blocks = cache.manager
    seq = _seq([1, 2, 3], [4])
    seq.blocks = blocks.open(b"", [1, 2, 3])
    seq.length = 3
    kv_bookkeeping.grow_for_trees(cache, [seq], [TokenTree(list(range(8)), list(range(-1, 7)))])
    assert len(seq.blocks.blocks) == 3  # 3 + 1 + 8 = 12 positions
    runner = Runner()
    kv_bookkeeping.keep_accepted(runner, [seq], [[0]])
    assert runner.moves == [[]]
    kv_bookkeeping.settle(blocks, seq, [0])
    assert seq.length == 5 and len(seq.blocks.blocks) == 2
