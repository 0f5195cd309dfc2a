"""Redis for the router tests: the shared server at 127.0.0.1:6379 under a unique key prefix
(removed afterwards), or throwaway ``redis-server`` processes on their own ports."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from support import start_redis, stop_redis

SHARED_URL = "redis://127.0.0.1:6379/0"


class FakeClock:
    """Simulated wall time for decay tests."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class ThrowawayRedis:
    """Starts and kills redis-server processes of one test; kills what is left at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, port: int) -> subprocess.Popen:
        self.procs.append(start_redis(port))
        return self.procs[-1]

    def kill(self, proc: subprocess.Popen) -> None:
        stop_redis(proc)


@pytest.fixture
def throwaway_redis() -> Iterator[ThrowawayRedis]:
    servers = ThrowawayRedis()
    yield servers
    for proc in servers.procs:
        stop_redis(proc)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@dataclass
class RedisTarget:
    url: str
    prefix: str
    client: redis.Redis


@pytest.fixture
def shared_redis() -> Iterator[RedisTarget]:
    """The shared Redis (a throwaway one if it is not running) under a prefix of this test only."""
    proc = None
    url = SHARED_URL
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, decode_responses=True)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        from specmesh.deploy import free_port

        port = free_port()
        proc = start_redis(port)
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(url, decode_responses=True)
    prefix = f"specmesh-test:{uuid.uuid4().hex[:12]}"
    try:
        yield RedisTarget(url, prefix, client)
    finally:
        stale = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if stale:
            client.delete(*stale)
        client.close()
        if proc is not None:
            stop_redis(proc)
