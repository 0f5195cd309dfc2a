"""Decayed acceptance statistics: in process, and shared through a real Redis (Lua decay-and-add)."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import redis

from specmesh_router.redis_stats import RedisStats, decay_add, redis_key
from specmesh_router.stats import AcceptanceStats, InProcessStats, StatsConfig, StatsKey

NGRAM = StatsKey("SmolLM2-135M-Instruct", "ngram", "code")
DRAFT = StatsKey("SmolLM2-135M-Instruct", "draft", "chat")


def step(accepted: int, drafted: int = 8, wait: float = 0.001) -> AcceptanceStats:
    return AcceptanceStats.of_step(drafted, accepted, rejected=accepted < drafted, proposer_s=wait)


def redis_config(target, **kw) -> StatsConfig:
    return StatsConfig(redis_url=target.url, key_prefix=target.prefix, half_life_s=10.0, **kw)


def test_of_step_counts_a_miss_only_where_the_walk_stopped_at_a_node_with_children():
    assert step(3, drafted=3).trials == (1.0, 1.0, 1.0)  # a full chain accepted: censored, no miss
    rejected = step(3, drafted=8)
    assert rejected.hits == (1.0, 1.0, 1.0) and rejected.trials == (1.0, 1.0, 1.0, 1.0)
    total = step(0) + step(2) + step(8)
    assert total.steps == 3 and total.accepted == 10 and total.drafted == 24
    assert total.position_acceptance()[:3] == [2 / 3, 1.0, 0.5]  # depth 3: step(2) missed, step(8) hit


def test_in_process_stats_halve_every_half_life_of_simulated_time(clock):
    stats = InProcessStats(StatsConfig(half_life_s=10.0), clock)
    for _ in range(100):
        stats.record(NGRAM, step(4))
    clock.advance(10.0)
    s = stats.snapshot()[NGRAM]
    assert s.steps == pytest.approx(50.0) and s.accepted == pytest.approx(200.0)
    assert s.accepted_per_step == pytest.approx(4.0)  # ratios do not decay
    for _ in range(50):
        stats.record(NGRAM, step(0))
    clock.advance(10.0)
    s = stats.snapshot()[NGRAM]
    assert s.steps == pytest.approx(50.0) and s.accepted == pytest.approx(100.0)
    assert s.hits[0] == pytest.approx(25.0) and s.trials[0] == pytest.approx(50.0)  # 100/4 hits, + 50/2 misses


def test_lua_script_decays_the_stored_value_to_the_time_of_the_write(shared_redis):
    cfg = redis_config(shared_redis)
    client = shared_redis.client
    decay_add(client, shared_redis.prefix, NGRAM, AcceptanceStats(steps=100.0, accepted=300.0), 0.0, cfg)
    decay_add(client, shared_redis.prefix, NGRAM, AcceptanceStats(steps=10.0), 20.0, cfg)  # two half-lives later
    stored = client.hgetall(redis_key(shared_redis.prefix, NGRAM))
    assert float(stored["steps"]) == pytest.approx(35.0) and float(stored["accepted"]) == pytest.approx(75.0)
    assert float(stored["_t"]) == 20.0
    # A delta stamped before the stored time (another replica's clock) is decayed back to it.
    decay_add(client, shared_redis.prefix, NGRAM, AcceptanceStats(steps=8.0), 10.0, cfg)
    stored = client.hgetall(redis_key(shared_redis.prefix, NGRAM))
    assert float(stored["steps"]) == pytest.approx(39.0) and float(stored["_t"]) == 20.0
    assert 0 < client.pttl(redis_key(shared_redis.prefix, NGRAM)) <= cfg.ttl_s * 1000


def test_two_instances_sharing_redis_converge_on_the_same_statistics(shared_redis, clock):
    cfg = redis_config(shared_redis, flush_interval_s=0.05, refresh_interval_s=0.05)
    a, b = RedisStats(cfg, clock), RedisStats(cfg, clock)
    try:
        for _ in range(30):
            a.record(NGRAM, step(6))
        clock.advance(5.0)
        for _ in range(10):
            b.record(NGRAM, step(2))
            b.record(DRAFT, step(1))
        assert a.snapshot()[NGRAM].steps == pytest.approx(30 * 0.5**0.5)  # local, before any flush
        assert a.sync() and b.sync() and a.sync()  # both written, then both read the other's
        clock.advance(10.0)
        sa, sb = a.snapshot(), b.snapshot()
        assert sa.keys() == sb.keys() == {NGRAM, DRAFT}
        for key in sa:
            assert _close(sa[key], sb[key])
        want = (30 * 0.5**1.5) + 10 * 0.5
        assert sa[NGRAM].steps == pytest.approx(want) and sa[DRAFT].steps == pytest.approx(5.0)
        assert sa[NGRAM].accepted == pytest.approx(6 * 30 * 0.5**1.5 + 2 * 10 * 0.5)
        # A third replica that starts later reads the same from Redis alone.
        c = RedisStats(cfg, clock)
        try:
            assert c.sync()
            assert _close(c.snapshot()[NGRAM], sa[NGRAM])
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def _close(x: AcceptanceStats, y: AcceptanceStats) -> bool:
    fx, fy = x.to_fields(), y.to_fields()
    return fx.keys() == fy.keys() and all(fx[k] == pytest.approx(fy[k], rel=1e-9) for k in fx)


def test_decay_and_add_loses_no_update_under_8_concurrent_writers(shared_redis):
    """Out-of-order timestamps from 8 threads, each on its own connection: the total must equal
    Σ 0.5^((T − t_i) / h), whatever order Redis applied them in."""
    cfg = redis_config(shared_redis)
    per_writer = 250
    stamps: list[list[float]] = [[random.Random(w).uniform(0.0, 30.0) for _ in range(per_writer)] for w in range(8)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def writer(w: int) -> None:
        client = redis.Redis.from_url(shared_redis.url)
        try:
            barrier.wait()
            for t in stamps[w]:
                decay_add(client, shared_redis.prefix, NGRAM, AcceptanceStats(steps=1.0, accepted=3.0), t, cfg)
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    last = max(max(s) for s in stamps)
    want = sum(0.5 ** ((last - t) / cfg.half_life_s) for s in stamps for t in s)
    stored = shared_redis.client.hgetall(redis_key(shared_redis.prefix, NGRAM))
    assert float(stored["_t"]) == last
    assert float(stored["steps"]) == pytest.approx(want, rel=1e-9)  # one lost update would be off by ≥ 0.5^3
    assert float(stored["accepted"]) == pytest.approx(3 * want, rel=1e-9)


def test_8_concurrent_batched_instances_sum_exactly(shared_redis, clock):
    """The full path: 8 RedisStats (own threads, own flush cycles, small batches) on one key.
    The clock stays frozen: the sum must be exact."""
    cfg = redis_config(shared_redis, flush_interval_s=0.01, flush_steps=8)
    instances = [RedisStats(cfg, clock) for _ in range(8)]

    def work(s: RedisStats) -> None:
        for i in range(400):
            s.record(NGRAM, step(i % 5))

    threads = [threading.Thread(target=work, args=(s,)) for s in instances]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for s in instances:
        s.close()  # final flush
    stored = shared_redis.client.hgetall(redis_key(shared_redis.prefix, NGRAM))
    assert float(stored["steps"]) == 3200.0
    assert float(stored["accepted"]) == 8 * 80 * (0 + 1 + 2 + 3 + 4)
    assert float(stored["h0"]) == 8 * 320 and float(stored["n0"]) == 3200.0


@pytest.mark.slow  # starts redis-server processes
def test_redis_down_at_start_then_killed_and_restarted_never_raises_and_resumes(caplog, throwaway_redis, clock):
    from specmesh.deploy import free_port

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    cfg = StatsConfig(
        redis_url=url,
        key_prefix="specmesh-test:outage",
        flush_interval_s=0.02,
        refresh_interval_s=0.05,
        backoff_min_s=0.02,
        backoff_max_s=0.2,
        socket_timeout_s=0.2,
    )
    caplog.set_level(logging.INFO, logger="specmesh_router.redis_stats")

    def warnings() -> int:
        return sum(r.levelno == logging.WARNING and "unavailable" in r.message for r in caplog.records)

    def record_timed(n: int) -> float:
        worst = 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            stats.record(NGRAM, step(3))
            worst = max(worst, time.perf_counter() - t0)
        return worst

    def wait_for(cond, what: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    def stored_steps(key: StatsKey = NGRAM) -> float:
        client = redis.Redis(port=port, decode_responses=True)
        try:
            return float(client.hget(redis_key(cfg.key_prefix, key), "steps") or 0)
        except redis.exceptions.ConnectionError:
            return -1.0
        finally:
            client.close()

    stats = RedisStats(cfg, clock)  # nothing listens on the port yet; frozen clock: exact counts
    try:
        assert record_timed(10) < 0.05
        assert stats.snapshot()[NGRAM].steps == 10  # served locally
        time.sleep(0.5)  # several failed cycles with backoff
        assert not stats.status().connected and warnings() == 1  # logged once, not per retry

        proc = throwaway_redis.start(port)
        wait_for(lambda: stored_steps() == 10, "the deltas kept while Redis was down")
        wait_for(lambda: stats.status().connected, "reconnection")

        throwaway_redis.kill(proc)  # dies mid-run
        assert record_timed(20) < 0.05
        stats.record(DRAFT, step(1))
        wait_for(lambda: not stats.status().connected, "the outage to be noticed")
        time.sleep(0.3)
        assert stats.snapshot()[NGRAM].steps == 30  # the last Redis view + local deltas
        assert warnings() == 2  # one per outage

        proc = throwaway_redis.start(port)  # same port, empty (not persisted)
        wait_for(lambda: stored_steps() == 20, "the outage's deltas to reach the new server")
        assert stored_steps(DRAFT) == 1  # every key of the batch, after loading the script once
        record_timed(5)
        wait_for(lambda: stored_steps() == 25, "new records to flow again")
        assert any("reachable again" in r.message for r in caplog.records)
        reader = RedisStats(cfg, clock)
        try:
            assert reader.sync() and reader.snapshot()[NGRAM].steps == 25
        finally:
            reader.close()
    finally:
        stats.close()


@pytest.mark.slow  # starts a redis-server process; SCRIPT FLUSH must not touch the shared server
def test_writes_still_land_after_script_flush_empties_the_servers_script_cache(throwaway_redis, clock):
    from specmesh.deploy import free_port

    port = free_port()
    throwaway_redis.start(port)
    url = f"redis://127.0.0.1:{port}/0"
    cfg = StatsConfig(redis_url=url, key_prefix="specmesh-test:noscript", flush_interval_s=60.0)
    client = redis.Redis(port=port, decode_responses=True)
    stats = RedisStats(cfg, clock)
    try:
        stats.record(NGRAM, step(3))
        assert stats.sync()
        client.script_flush()
        stats.record(NGRAM, step(3))
        assert stats.sync() and stats.status().connected  # the batched path reloaded the script
        client.script_flush()
        decay_add(client, cfg.key_prefix, NGRAM, AcceptanceStats(steps=1.0), clock(), cfg)  # so did the unbatched one
        assert float(client.hget(redis_key(cfg.key_prefix, NGRAM), "steps")) == 3.0
    finally:
        stats.close()
        client.close()
