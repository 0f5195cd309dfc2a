"""Suffix replicas share what they learn through one Redis stream.

Each replica appends every finished output (scope + token ids, int32 little-endian) to the
stream ``{prefix}:outputs`` (``XADD … MAXLEN ~ max_len``: bounded, the oldest trimmed) and
reads everyone's entries from the start of the stream, ingesting the other replicas' into its
own global cache. A replica that joins late therefore warms up from the whole stream; one that
cannot reach Redis keeps serving from what it has and catches up (from the last entry it read)
when Redis returns. All Redis I/O runs on one background thread: a stream never waits on it.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np

log = logging.getLogger("specmesh.suffix.share")


@dataclass(frozen=True)
class ShareConfig:
    redis_url: str
    prefix: str = "specmesh:suffix"
    max_len: int = 100_000  # entries (outputs) the stream keeps, approximately
    replica: str = ""  # this replica's name in the stream; "" = a random one
    block_ms: int = 500  # XREAD blocks this long for new entries
    socket_timeout_s: float = 2.0
    backoff_max_s: float = 5.0


def encode(scope: str, tokens: np.ndarray, replica: str) -> dict[bytes, bytes]:
    """One stream entry.

    >>> sorted(encode("a", np.array([1, 2], np.int32), "r1"))
    [b'r', b's', b't']
    """
    return {b"r": replica.encode(), b"s": scope.encode(), b"t": np.asarray(tokens, "<i4").tobytes()}


def decode(fields: dict[bytes, bytes]) -> tuple[str, str, np.ndarray]:
    """(replica, scope, tokens) of an entry; a malformed one raises ValueError.

    >>> r, s, t = decode(encode("a", np.array([1, 2], np.int32), "r1")); r, s, t.tolist()
    ('r1', 'a', [1, 2])
    """
    try:
        raw = fields[b"t"]
        if len(raw) % 4:
            raise ValueError("token bytes not a multiple of 4")
        return fields[b"r"].decode(), fields[b"s"].decode(), np.frombuffer(raw, "<i4").astype(np.int32)
    except (KeyError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed entry: {exc!r}") from exc


class OutputSharing:
    """Publishes this replica's finished outputs and ingests the others' (``ingest(scope, tokens)``)."""

    def __init__(self, config: ShareConfig, ingest: Callable[[str, np.ndarray], None]) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.config = config
        self.replica = config.replica or uuid.uuid4().hex[:12]
        self.key = f"{config.prefix}:outputs"
        self._ingest = ingest
        self._errors = (redis.exceptions.RedisError, OSError)
        self._client = redis.Redis.from_url(
            config.redis_url,
            socket_timeout=config.socket_timeout_s + config.block_ms / 1000,
            socket_connect_timeout=config.socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        u = urlsplit(config.redis_url)
        self._where = f"{u.hostname}:{u.port or 6379}{u.path or ''}"  # no credentials in logs
        self._outbox: queue.SimpleQueue[tuple[str, np.ndarray]] = queue.SimpleQueue()
        self.last_id = b"0-0"  # the next read starts after it: "0-0" = the whole stream (warm-up)
        self.published = self.ingested = self.skipped = 0
        self.connected = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specmesh-suffix-share", daemon=True)
        self._thread.start()

    def publish(self, scope: str, tokens: np.ndarray) -> None:
        """Queue a finished output (any thread; never blocks). Unsent entries wait out an outage."""
        if len(tokens):
            self._outbox.put((scope, tokens))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.config.socket_timeout_s + self.config.block_ms / 1000 + 1)
        self._client.close()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                self._flush()
                self._read()
                if not self.connected:
                    log.info("suffix sharing: connected to redis at %s (stream %s)", self._where, self.key)
                self.connected, backoff = True, 0.1
            except self._errors as exc:
                if self.connected or backoff == 0.1:
                    log.warning("suffix sharing: redis at %s unreachable (%s); serving from the local cache",
                                self._where, exc)  # fmt: skip
                self.connected = False
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.config.backoff_max_s)

    def _flush(self) -> None:
        pending: list[tuple[str, np.ndarray]] = []
        while True:
            try:
                pending.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        if not pending:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for scope, tokens in pending:
                pipe.xadd(self.key, encode(scope, tokens, self.replica), maxlen=self.config.max_len, approximate=True)
            pipe.execute()
            self.published += len(pending)
        except self._errors:
            for item in pending:  # kept for the next try, in order
                self._outbox.put(item)
            raise

    def _read(self) -> None:
        got = self._client.xread({self.key: self.last_id}, count=512, block=self.config.block_ms)
        for _stream, entries in got or ():
            for entry_id, fields in entries:
                self.last_id = entry_id
                try:
                    replica, scope, tokens = decode(fields)
                except ValueError as exc:
                    self.skipped += 1
                    log.warning("suffix sharing: skipped entry %s: %s", entry_id, exc)
                    continue
                if replica != self.replica:
                    try:
                        self._ingest(scope, tokens)
                    except Exception:  # one bad entry must not end the sharing thread
                        self.skipped += 1
                        log.exception("suffix sharing: could not ingest entry %s", entry_id)
                        continue
                    self.ingested += 1
