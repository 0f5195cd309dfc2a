"""The block pool and its prefix cache, without a model: hits that end mid-block, at a block boundary and
on a whole prompt; isolation between tenants; eviction order and that it never takes a block in use;
and the accounting after many mixed requests (every block free or evictable, no reference left)."""

from __future__ import annotations

import random

import pytest

from specmesh_server.kv_blocks import BlockManager, BlockPool, BlockTable, NoFreeBlocks, block_hashes, namespace

BS = 4


def manager(blocks: int = 32, caching: bool = True) -> BlockManager:
    return BlockManager(BlockPool(blocks, BS, caching))


def serve(m: BlockManager, seed: bytes, prompt: list[int], output: list[int]):
    """A request's life as the engine leads it: open, prefill, decode token by token, close."""
    t = m.open(seed, prompt)
    tokens = list(prompt)
    m.grow(t, len(tokens))
    m.commit(t, tokens)
    for tok in output:
        tokens.append(tok)
        m.grow(t, len(tokens))
        m.commit(t, tokens)
    return t


@pytest.mark.parametrize(
    ("shared", "prompt_len", "hit"),
    [
        (10, 12, 8),  # the shared prefix ends mid-block: only its full blocks hit
        (8, 12, 8),  # it ends at a block boundary
        (12, 12, 8),  # a whole-prompt repeat: the last token is always computed, so block 3 is not a hit
        (13, 13, 12),  # 13 tokens: blocks 0-2 hit, token 12 is computed
        (3, 12, 0),  # shorter than a block: nothing
    ],
)
def test_a_hit_is_the_longest_run_of_full_blocks_short_of_the_last_token(shared: int, prompt_len: int, hit: int):
    m, ns = manager(), namespace("m")
    first = list(range(100, 100 + prompt_len))
    m.close(serve(m, ns, first, [1, 2, 3]))
    second = first[:shared] + list(range(500, 500 + prompt_len - shared))
    t = m.open(ns, second)
    assert t.cached_tokens == hit
    assert len(t.blocks) == hit // BS
    m.close(t)
    m.pool.check()


def test_the_same_prompt_in_two_tenants_never_hits_across_them():
    m = manager()
    prompt = list(range(40))
    m.close(serve(m, namespace("m", "alice"), prompt, [7]))
    hits = m.pool.counters.hits
    assert m.open(namespace("m", "bob"), prompt).cached_tokens == 0
    assert m.open(namespace("m", "alice", salt="s"), prompt).cached_tokens == 0  # a per-request salt too
    assert m.pool.counters.hits == hits
    assert m.open(namespace("m", "alice"), prompt).cached_tokens == 36


def test_a_second_turn_hits_the_first_turns_prompt_and_output():
    m, ns = manager(), namespace("m")
    turn1 = list(range(13))
    out1 = [50, 51, 52, 53, 54]
    m.close(serve(m, ns, turn1, out1))
    t = m.open(ns, turn1 + out1 + [60, 61, 62])  # 21 tokens: 16 of them are full blocks of turn 1
    assert t.cached_tokens == 16


def test_speculative_positions_are_never_hashed_before_they_are_accepted():
    m, ns = manager(), namespace("m")
    t = m.open(ns, list(range(6)))
    m.grow(t, 6)
    m.commit(t, list(range(6)))
    m.grow(t, 6 + 1 + 7)  # the pending token and a 7-node tree: positions up to 13
    assert len(t.hashes) == 1  # block 1 is written by the tree but holds accepted tokens 4, 5 only
    m.shrink(t, 8)  # 2 nodes accepted: 8 positions hold accepted tokens
    assert len(t.blocks) == 2
    m.commit(t, [*range(6), 90, 91])
    assert len(t.hashes) == 2
    m.close(t)
    m.pool.check()


def test_eviction_takes_the_least_recently_released_blocks_and_never_one_in_use():
    m, ns = manager(blocks=6), namespace("m")
    running = serve(m, ns, list(range(8)), [])  # 2 blocks in use, both registered
    old = serve(m, ns, list(range(100, 108)), [])
    old_blocks = list(old.blocks)
    m.close(old)  # 2 evictable
    fresh = m.pool.allocate(2)  # 2 never-used blocks come first in the queue
    assert not set(fresh) & set(running.blocks + old_blocks)
    assert m.pool.allocate(1) == old_blocks[-1:]  # now the evictable ones, the tail block first
    assert m.pool.allocate(1) == old_blocks[:1] and m.pool.counters.evictions == 2
    with pytest.raises(NoFreeBlocks):
        m.pool.allocate(1)  # the running request's blocks are not in the queue
    assert m.open(ns, [*range(8), 1]).cached_tokens == 8  # and still cached
    m.pool.check()


def test_a_table_gets_its_blocks_in_runs_and_a_released_run_comes_back_as_one():
    """Blocks go to tables as runs of consecutive ids (attention reads a run where it lies): growth
    continues after a table's last block where that one is free and caches nothing, and a batch taken
    from the queue comes in ascending order, though a table's blocks are released last one first."""
    m, ns = manager(blocks=12), namespace("m")
    a, b = BlockTable(ns), BlockTable(ns)
    m.grow(a, 3 * BS)  # blocks 0-2
    m.grow(b, 2 * BS)  # 3-4
    m.grow(a, 4 * BS)  # 3 is taken: a jumps to the oldest free block, 5
    m.grow(a, 5 * BS)  # and goes on from there: 6
    assert (a.blocks, b.blocks) == ([0, 1, 2, 5, 6], [3, 4])
    m.close(a)  # queue: 7..11, then a's blocks tail first: 6, 5, 2, 1, 0
    m.pool.allocate(5)  # 7..11
    c = BlockTable(ns)
    m.grow(c, 5 * BS)
    assert c.blocks == [0, 1, 2, 5, 6]  # one batch, ascending: two runs again, not five
    m.pool.check()


def test_a_hit_on_an_evictable_block_takes_it_out_of_the_queue():
    m, ns = manager(blocks=4), namespace("m")
    m.close(serve(m, ns, list(range(9)), []))
    t = m.open(ns, list(range(9)))
    assert t.cached_tokens == 8 and m.pool.free_blocks == 2
    with pytest.raises(NoFreeBlocks):
        m.pool.allocate(3)


def test_two_requests_computing_the_same_prefix_at_once_keep_one_cached_copy():
    m, ns = manager(), namespace("m")
    a, b = m.open(ns, list(range(9))), m.open(ns, list(range(9)))
    for t in (a, b):
        m.grow(t, 9)
        m.commit(t, list(range(9)))
    assert len(m.pool.cached) == 2
    m.close(a)
    m.close(b)
    m.pool.check()
    again = m.open(ns, list(range(9)))
    assert again.cached_tokens == 8 and again.blocks == m.pool.lookup(block_hashes(list(range(8)), BS, ns))


def test_caching_off_never_hits():
    m, ns = manager(caching=False), namespace("m")
    m.close(serve(m, ns, list(range(20)), [1]))
    assert m.open(ns, list(range(20))).cached_tokens == 0 and not m.pool.cached


def test_after_a_thousand_mixed_requests_every_block_is_free_or_evictable():
    """Finished, cancelled mid-prefill, preempted and reopened, failed: whatever the way out, the
    blocks come back; refcounts end at zero; the pool never hands out more than it holds."""
    rng = random.Random(7)
    m = manager(blocks=64)
    tenants = [namespace("m", t) for t in ("a", "b", "c")]
    docs = [[rng.randrange(1000) for _ in range(rng.randrange(10, 60))] for _ in range(12)]
    live: list[tuple] = []
    for i in range(1000):
        if live and (rng.random() < 0.5 or len(live) > 6):
            t, tokens, fate = live.pop(rng.randrange(len(live)))
            if fate == "preempt":  # back later from its own tokens: it finds its blocks if still cached
                m.close(t)
                t2 = m.open(t.seed, tokens)
                assert t2.cached_tokens % BS == 0 and t2.cached_tokens <= len(tokens) - 1
                m.close(t2)
            else:
                m.close(t)
            continue
        seed = rng.choice(tenants)
        prompt = rng.choice(docs)[: rng.randrange(5, 60)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        t = m.open(seed, prompt)
        tokens = list(prompt)
        fate = rng.choice(["finish", "cancel", "preempt", "fail"])
        try:
            m.grow(t, len(tokens) + 1 + rng.randrange(8))  # prompt, pending token, a tree
            m.shrink(t, len(tokens))
            if fate != "cancel":
                m.commit(t, tokens)
                for _ in range(rng.randrange(0, 12)):
                    tokens.append(rng.randrange(1000))
                    m.grow(t, len(tokens))
                    m.commit(t, tokens)
        except NoFreeBlocks:  # refused for memory: what it holds goes back
            m.close(t)
            continue
        assert m.pool.used_blocks <= m.pool.num_blocks
        live.append((t, tokens, fate))
        if i % 100 == 0:
            m.pool.check()
    for t, _, _ in live:
        m.close(t)
    m.pool.check()
    assert all(r == 0 for r in m.pool.refs) and m.pool.free_blocks == m.pool.num_blocks
    assert m.pool.counters.hits > 0 and m.pool.counters.evictions > 0  # the run exercised both
