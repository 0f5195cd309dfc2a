"""Suffix replicas sharing finished outputs through a Redis stream: the entry format, one replica's
outputs reaching another (never itself), a late replica warming up from the whole stream, and a
Redis outage that neither raises nor blocks and loses nothing."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
from support import start_redis, stop_redis

from proposer_svc.suffix.cache import SuffixCache
from proposer_svc.suffix.config import SuffixConfig
from proposer_svc.suffix.index import MAX_VOCAB
from proposer_svc.suffix.request import SuffixRequest
from proposer_svc.suffix.share import OutputSharing, ShareConfig, decode, encode
from specmesh.deploy import free_port

SHARED_REDIS = "redis://127.0.0.1:6379/0"

# ---------------------------------------------------------------------------------------------
# the entry format


@pytest.mark.parametrize(
    ("scope", "tokens"),
    [("", []), ("a", [0]), ("tenant/α β", [MAX_VOCAB - 1, 0, 123, 7]), ("x" * 300, list(range(5000)))],
)
def test_encode_decode_round_trip(scope, tokens):
    fields = encode(scope, np.array(tokens, np.int64), "replica-1")
    assert all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in fields.items())
    replica, got_scope, got = decode(fields)
    assert (replica, got_scope, got.tolist()) == ("replica-1", scope, tokens)
    assert got.dtype == np.int32
    assert len(fields[b"t"]) == 4 * len(tokens)


@pytest.mark.parametrize(
    "fields",
    [
        {b"s": b"a", b"t": b"\x01\x00\x00\x00"},  # no replica
        {b"r": b"r1", b"t": b"\x01\x00\x00\x00"},  # no scope
        {b"r": b"r1", b"s": b"a"},  # no tokens
        {b"r": b"r1", b"s": b"a", b"t": b"\x01\x00\x00"},  # not whole int32s
        {b"r": b"r1", b"s": b"a", b"t": b"\x01\x00\x00\x00\x02"},
        {b"r": b"\xff\xfe", b"s": b"a", b"t": b""},  # not UTF-8
        {b"r": b"r1", b"s": b"\xc3", b"t": b""},
        {},
    ],
)
def test_decode_raises_value_error_on_malformed_entries(fields):
    with pytest.raises(ValueError):
        decode(fields)


# ---------------------------------------------------------------------------------------------
# replicas on one Redis


class Received:
    """An ``ingest`` callback that records (scope, tokens) and optionally feeds a suffix cache."""

    def __init__(self, cache: SuffixCache | None = None) -> None:
        self.items: list[tuple[str, list[int]]] = []
        self.lock = threading.Lock()
        self.cache = cache

    def __call__(self, scope: str, tokens: np.ndarray) -> None:
        with self.lock:
            self.items.append((scope, tokens.tolist()))
        if self.cache is not None:
            self.cache.ingest(scope, tokens)

    def get(self) -> list[tuple[str, list[int]]]:
        with self.lock:
            return list(self.items)


def _share(url: str, prefix: str, ingest, replica: str) -> OutputSharing:
    config = ShareConfig(url, prefix=prefix, replica=replica, block_ms=100, socket_timeout_s=1.0, backoff_max_s=0.3)
    return OutputSharing(config, ingest)


def _wait(predicate, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.02)


def _redis_client(url: str = SHARED_REDIS):
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        client.close()
        pytest.skip(f"no redis at {url}")
    return client


def _stream(client, key: str) -> list[tuple[str, str, list[int]]]:
    """The stream's well-formed entries, decoded, in order."""
    out = []
    for _id, fields in client.xrange(key):
        try:
            r, s, t = decode(fields)
        except ValueError:
            continue
        out.append((r, s, t.tolist()))
    return out


def _last_id(client, key: str) -> bytes:
    return client.xrevrange(key, count=1)[0][0]


def test_a_replicas_outputs_reach_the_other_replica_and_never_itself():
    client = _redis_client()
    prefix = f"specmesh-test-{uuid.uuid4().hex}"
    key = f"{prefix}:outputs"
    cache_b = SuffixCache(SuffixConfig(), background=False)
    got_a, got_b = Received(), Received(cache_b)
    a = b = None
    try:
        a = _share(SHARED_REDIS, prefix, got_a, "replica-a")
        b = _share(SHARED_REDIS, prefix, got_b, "replica-b")
        _wait(lambda: a.connected and b.connected, what="both replicas connected")

        a_outputs = [("s1", list(range(100, 140))), ("s2", [5, 6, 7]), ("s1", [MAX_VOCAB - 1, 0])]
        for scope, tokens in a_outputs:
            a.publish(scope, np.array(tokens, np.int32))
        a.publish("s1", np.array([], np.int32))  # nothing to share: no entry
        b.publish("s9", np.array([9, 9, 9], np.int32))

        _wait(lambda: len(got_b.get()) == 3, what="B ingesting A's outputs")
        assert got_b.get() == a_outputs  # in A's order
        _wait(lambda: a.last_id == _last_id(client, key) and b.last_id == a.last_id, what="both read the stream")
        assert got_a.get() == [("s9", [9, 9, 9])]  # B's, not its own
        assert got_b.get() == a_outputs
        assert (a.published, a.ingested, b.published, b.ingested) == (3, 1, 1, 3)
        assert sorted(_stream(client, key)) == sorted(
            [("replica-a", s, t) for s, t in a_outputs] + [("replica-b", "s9", [9, 9, 9])]
        )

        # what B ingested, its suffix cache proposes (scope s1 only)
        req = SuffixRequest(cache_b, "s1")
        req.extend([1, 2, *range(110, 116)])
        proposal = req.propose()
        assert proposal.source == "global" and proposal.tokens[:3] == [116, 117, 118]
        req.close()
        other = SuffixRequest(cache_b, "s2")
        other.extend([1, 2, *range(110, 116)])
        assert other.propose().source == ""
        other.close()

        # a malformed entry is skipped; the entries after it still arrive
        client.xadd(key, {b"r": b"someone", b"t": b"\x01\x02\x03"})
        a.publish("s3", np.array([42, 43], np.int32))
        _wait(lambda: len(got_b.get()) == 4, what="B ingesting past a malformed entry")
        assert got_b.get()[-1] == ("s3", [42, 43])
        assert b.skipped == 1
    finally:
        for replica in (a, b):
            if replica is not None:
                replica.close()
        client.delete(key)
        client.close()
    assert not a._thread.is_alive() and not b._thread.is_alive()


def test_a_replica_started_later_warms_up_from_the_whole_stream():
    client = _redis_client()
    prefix = f"specmesh-test-{uuid.uuid4().hex}"
    key = f"{prefix}:outputs"
    got_a, got_b, got_late = Received(), Received(), Received()
    a = b = late = None
    try:
        a = _share(SHARED_REDIS, prefix, got_a, "replica-a")
        b = _share(SHARED_REDIS, prefix, got_b, "replica-b")
        for i in range(30):
            (a if i % 3 else b).publish(f"scope-{i % 4}", np.arange(i, i + 10, dtype=np.int32))
        _wait(lambda: a.published + b.published == 30, what="30 outputs published")
        assert client.xlen(key) == 30

        late = _share(SHARED_REDIS, prefix, got_late, "replica-late")
        _wait(lambda: len(got_late.get()) == 30, what="the late replica's warm-up")
        assert got_late.get() == [(s, t) for _r, s, t in _stream(client, key)]  # everything, in stream order
        assert sorted(map(str, got_late.get())) == sorted(
            str((f"scope-{i % 4}", list(range(i, i + 10)))) for i in range(30)
        )
        # and from then on it follows the stream like the others
        a.publish("scope-new", np.array([1, 2, 3], np.int32))
        _wait(lambda: len(got_late.get()) == 31, what="the late replica following the stream")
        assert got_late.get()[-1] == ("scope-new", [1, 2, 3])
    finally:
        for replica in (a, b, late):
            if replica is not None:
                replica.close()
        client.delete(key)
        client.close()


# ---------------------------------------------------------------------------------------------
# outages


def test_publishing_during_a_redis_outage_neither_raises_nor_blocks_and_arrives_after_restart():
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    prefix = f"specmesh-test-{uuid.uuid4().hex}"
    proc = start_redis(port)
    got_a, got_b, got_c = Received(), Received(), Received()
    a = b = c = None
    try:
        a = _share(url, prefix, got_a, "replica-a")
        b = _share(url, prefix, got_b, "replica-b")
        _wait(lambda: a.connected and b.connected, what="both replicas connected")
        a.publish("s", np.array([1, 2, 3], np.int32))
        _wait(lambda: got_b.get() == [("s", [1, 2, 3])], what="the first output")

        stop_redis(proc)
        _wait(lambda: not a.connected and not b.connected, what="the replicas noticing the outage")
        t0 = time.monotonic()
        a.publish("s", np.array([4, 5, 6], np.int32))
        for i in range(200):
            a.publish("bulk", np.array([i, i + 1], np.int32))
        assert time.monotonic() - t0 < 0.1  # queued, not sent: no waiting on Redis
        t0 = time.monotonic()
        c = _share(url, prefix, got_c, "replica-c")  # a replica starting during the outage
        assert time.monotonic() - t0 < 0.5
        time.sleep(0.5)  # several failed retries
        assert a._thread.is_alive() and b._thread.is_alive() and c._thread.is_alive()
        assert not a.connected and a.published == 1 and got_b.get() == [("s", [1, 2, 3])]

        proc = start_redis(port)  # same port, empty (not persistent)
        _wait(lambda: len(got_b.get()) == 202, what="the queued outputs reaching B")
        want = [("s", [1, 2, 3]), ("s", [4, 5, 6])] + [("bulk", [i, i + 1]) for i in range(200)]
        assert got_b.get() == want  # in order, nothing lost or repeated
        _wait(lambda: a.connected, what="A reconnected")
        assert a.published == 202
        _wait(lambda: len(got_c.get()) == 201, what="C's warm-up from the new stream")
        assert got_c.get() == want[1:]  # the restarted Redis holds only what was sent after it
        assert got_a.get() == []
    finally:
        for replica in (a, b, c):
            if replica is not None:
                replica.close()
        stop_redis(proc)
