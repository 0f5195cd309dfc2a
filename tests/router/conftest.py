"""Redis for the router tests: the shared server at 127.0.0.1:6379 under a unique key prefix
(removed afterwards), or throwaway ``redis-server`` processes on their own ports."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

SHARED_URL = "redis://127.0.0.1:6379/0"


class FakeClock:
    """Simulated wall time for decay tests."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def start_redis(port: int) -> subprocess.Popen:
    """A throwaway, non-persistent redis-server on ``port``; returns once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not on PATH")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"redis-server on port {port} did not start") from None
            time.sleep(0.05)
        finally:
            client.close()


def stop_redis(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


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
