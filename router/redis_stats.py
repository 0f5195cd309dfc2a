"""The Redis backend of the router's statistics: shared by every verifier replica.

``record`` and ``snapshot`` touch only local tables; a background thread sends batched, pipelined
decay-and-add updates (one Lua script per key, atomic in Redis) every ``flush_interval_s`` or
``flush_steps`` records, and refreshes a local copy of every key under the prefix. Redis down at
start or dying later: the thread logs once, keeps the deltas locally, retries with exponential
backoff and flushes them when Redis is back; callers never block on Redis and never see its errors.
The value type, the decay rule and the in-process backend are ``router.stats``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from urllib.parse import quote, unquote, urlsplit

from specmesh_router.stats import (
    AcceptanceStats,
    BackendStatus,
    Clock,
    DecayedTable,
    StatsConfig,
    StatsKey,
    decayed_sums,
)

log = logging.getLogger(__name__)

# KEYS[1]: the key's hash, KEYS[2]: the prefix's index set. ARGV: now, half-life (s), TTL (ms),
# then field, delta pairs. Decays every stored field to `now` (or the delta back to the stored
# time, if that is later: clocks of replicas differ), adds the deltas, stamps the time.
DECAY_ADD_LUA = """
local now = tonumber(ARGV[1])
local half_life = tonumber(ARGV[2])
local stored = redis.call('HGETALL', KEYS[1])
local values = {}
local t = nil
for i = 1, #stored, 2 do
  if stored[i] == '_t' then t = tonumber(stored[i + 1]) else values[stored[i]] = tonumber(stored[i + 1]) end
end
local keep, add = 1.0, 1.0
if t ~= nil then
  if now >= t then keep = 0.5 ^ ((now - t) / half_life) else add = 0.5 ^ ((t - now) / half_life); now = t end
end
for f, v in pairs(values) do values[f] = v * keep end
for i = 4, #ARGV, 2 do
  values[ARGV[i]] = (values[ARGV[i]] or 0) + tonumber(ARGV[i + 1]) * add
end
local out = {'_t', string.format('%.17g', now)}
for f, v in pairs(values) do
  out[#out + 1] = f
  out[#out + 1] = string.format('%.17g', v)
end
redis.call('HSET', KEYS[1], unpack(out))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[2], KEYS[1])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return #out / 2
"""


def redis_key(prefix: str, key: StatsKey) -> str:
    """The hash of one key; each part is percent-quoted, so ':' in a model name is safe.

    >>> redis_key("specmesh:stats", StatsKey("org/Model:v1", "ngram", "code"))
    'specmesh:stats:org%2FModel%3Av1:ngram:code'
    """
    return ":".join([prefix, *(quote(part, safe="") for part in (key.model, key.proposer, key.workload_tag))])


def parse_redis_key(prefix: str, name: str) -> StatsKey | None:
    """Inverse of ``redis_key``; None for a name of another layout.

    >>> parse_redis_key("specmesh:stats", "specmesh:stats:org%2FModel%3Av1:ngram:")
    StatsKey(model='org/Model:v1', proposer='ngram', workload_tag='')
    """
    if not name.startswith(prefix + ":"):
        return None
    parts = name[len(prefix) + 1 :].split(":")
    return StatsKey(*(unquote(p) for p in parts)) if len(parts) == 3 else None


def index_key(prefix: str) -> str:
    return f"{prefix}:__index__"


def decay_add_args(stats: AcceptanceStats, t: float, config: StatsConfig) -> list[str]:
    """ARGV of one ``DECAY_ADD_LUA`` call."""
    args = [repr(t), repr(config.half_life_s), str(max(int(config.ttl_s * 1000), 1))]
    for name, value in stats.to_fields().items():
        args += [name, repr(value)]
    return args


def decay_add(client, prefix: str, key: StatsKey, stats: AcceptanceStats, t: float, config: StatsConfig) -> None:
    """One atomic decay-and-add, unbatched (tests, tools). ``client``: a ``redis.Redis``; its
    ``Script`` loads the script when the server lacks it."""
    script = client.register_script(DECAY_ADD_LUA)
    script(keys=[redis_key(prefix, key), index_key(prefix)], args=decay_add_args(stats, t, config))


class RedisStats:
    """Statistics shared through Redis; local tables serve every call, a thread does all I/O."""

    def __init__(self, config: StatsConfig, clock: Clock = time.time) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if not config.redis_url:
            raise ValueError("RedisStats needs config.redis_url (use InProcessStats without Redis)")
        self.config = config
        self._clock = clock
        self._errors = (redis.exceptions.RedisError, OSError)
        # No client-side retries: this class backs off itself and never blocks a caller.
        self._client = redis.Redis.from_url(
            config.redis_url,
            socket_timeout=config.socket_timeout_s,
            socket_connect_timeout=config.socket_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        # The pipeline checks SCRIPT EXISTS before each flush and loads it if the server lost it.
        self._decay_add = self._client.register_script(DECAY_ADD_LUA)
        u = urlsplit(config.redis_url)
        self._where = f"{u.hostname}:{u.port or 6379}{u.path or ''}"  # no credentials in logs
        hl = config.half_life_s
        self._lock = threading.Lock()  # guards the tables and counters below, briefly
        self._pending = DecayedTable(hl)  # recorded, not yet sent
        self._inflight = DecayedTable(hl)  # being sent now: still counted until it is written or put back
        self._unseen = DecayedTable(hl)  # sent, not yet in a refreshed view
        self._view = DecayedTable(hl)  # Redis' content at the last refresh
        self._since_flush = 0
        self._io_lock = threading.Lock()  # one I/O cycle at a time (background thread or sync())
        self._connected = False
        self._outage_logged = False
        self._last_error = "not connected yet"
        self._backoff = config.backoff_min_s
        self._next_try = 0.0
        self._last_refresh = float("-inf")
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specmesh-stats-redis", daemon=True)
        self._thread.start()

    # --- any thread, never blocks on Redis ------------------------------------------------
    def record(self, key: StatsKey, sample: AcceptanceStats) -> None:
        now = self._clock()
        with self._lock:
            self._pending.add(key, sample, now)
            self._since_flush += 1
            due = self._since_flush >= self.config.flush_steps
        if due:
            self._wake.set()

    def snapshot(self, keys: Iterable[StatsKey] | None = None) -> dict[StatsKey, AcceptanceStats]:
        now = self._clock()
        with self._lock:
            tables = [dict(t.rows) for t in (self._view, self._unseen, self._inflight, self._pending)]
        return decayed_sums(tables, now, keys, self.config.half_life_s)

    def status(self) -> BackendStatus:
        with self._lock:
            pending = len(self._pending.rows)
        detail = self._where if self._connected else f"{self._where}: {self._last_error}"
        return BackendStatus("redis", self._connected, detail, pending)

    def sync(self) -> bool:
        """Flush and refresh now, ignoring the backoff (tests, tools); False when Redis is unreachable."""
        return self._cycle(refresh=True, force=True)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if self._connected:
            self._cycle(refresh=False, force=True)  # last deltas, best effort
        self._client.close()

    # --- background thread ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.flush_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            due = time.monotonic() - self._last_refresh >= self.config.refresh_interval_s
            try:
                self._cycle(refresh=due, force=False)
            except Exception:  # a bug must not kill the thread silently and stop all flushing
                log.exception("router statistics: flush cycle failed")

    def _cycle(self, refresh: bool, force: bool) -> bool:
        with self._io_lock:
            if not self._connected and not force and time.monotonic() < self._next_try:
                return False
            try:
                self._flush()
                if refresh:
                    self._refresh()
            except self._errors as exc:
                self._failed(exc)
                return False
            self._succeeded()
            return True

    def _flush(self) -> None:
        hl = self.config.half_life_s
        with self._lock:
            batch, self._pending = self._pending, DecayedTable(hl)
            self._inflight = batch  # snapshots keep counting it while it is on the wire
            self._since_flush = 0
        if not batch.rows:
            return
        try:
            failed, error = self._send(batch)
        except BaseException:  # connection lost mid-pipeline: nothing known written, all resent
            with self._lock:
                batch.merge(self._pending)
                self._pending, self._inflight = batch, DecayedTable(hl)
            raise
        with self._lock:
            kept = DecayedTable(hl)
            for key in failed:
                kept.rows[key] = batch.rows.pop(key)
            self._unseen.merge(batch)  # written: in the snapshot until the next refresh reads it
            kept.merge(self._pending)
            self._pending, self._inflight = kept, DecayedTable(hl)
        if error is not None:
            raise error

    def _send(self, batch: DecayedTable) -> tuple[list[StatsKey], Exception | None]:
        """Write every key of ``batch`` in one pipeline (redis-py sends a SCRIPT EXISTS first, and a
        SCRIPT LOAD when the server lost the script); returns the keys Redis refused and the first
        refusal."""
        prefix = self.config.key_prefix
        keys = list(batch.rows)
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            stats, t = batch.rows[key]
            args = decay_add_args(stats, t, self.config)
            self._decay_add(keys=[redis_key(prefix, key), index_key(prefix)], args=args, client=pipe)
        results = pipe.execute(raise_on_error=False)
        failed = [(key, r) for key, r in zip(keys, results, strict=True) if isinstance(r, Exception)]
        return [key for key, _ in failed], (failed[0][1] if failed else None)

    def _refresh(self) -> None:
        prefix = self.config.key_prefix
        names = sorted(self._client.smembers(index_key(prefix)))
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        hashes = pipe.execute() if names else []
        view = DecayedTable(self.config.half_life_s)
        gone = []
        for name, fields in zip(names, hashes, strict=True):
            key = parse_redis_key(prefix, name)
            if not fields:
                gone.append(name)  # expired: drop it from the index
            elif key is not None:
                view.rows[key] = (AcceptanceStats.from_fields(fields), float(fields.get("_t", 0.0)))
        if gone:
            self._client.srem(index_key(prefix), *gone)
        with self._lock:
            self._view = view
            self._unseen = DecayedTable(self.config.half_life_s)
        self._last_refresh = time.monotonic()

    def _failed(self, exc: BaseException) -> None:
        self._connected = False
        self._last_error = f"{type(exc).__name__}: {exc}"
        if not self._outage_logged:
            log.warning(
                "router statistics: Redis at %s unavailable (%s); using local statistics, retrying with backoff",
                self._where,
                self._last_error,
            )
            self._outage_logged = True
        self._next_try = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.config.backoff_max_s)

    def _succeeded(self) -> None:
        if self._outage_logged:
            log.info("router statistics: Redis at %s reachable again; resuming shared statistics", self._where)
            self._outage_logged = False
        self._connected = True
        self._backoff = self.config.backoff_min_s
