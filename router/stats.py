"""Live acceptance statistics per (target model, proposer, workload_tag), exponentially decayed.

Every value is a sum over verification steps that decays with a half-life, so the router follows
drift: ``v(now) = v(t) · 0.5 ** ((now - t) / half_life)``. Two backends share one interface:

- ``InProcessStats``: a dict in this process (the embedded default, no Redis configured);
- ``RedisStats``: shared by every verifier replica. ``record`` and ``snapshot`` touch only local
  tables; a background thread sends batched, pipelined decay-and-add updates (one Lua script per
  key, atomic in Redis) every ``flush_interval_s`` or ``flush_steps`` records, and refreshes a
  local copy of every key under the prefix. Redis down at start or dying later: the thread logs
  once, keeps the deltas locally, retries with exponential backoff and flushes them when Redis
  is back; callers never block on Redis and never see its errors.

Decayed sums are order-independent: a delta stamped at ``s`` adds ``d · 0.5 ** ((T - s) / h)`` to
the total at the latest stamp ``T``, whichever update arrives first, so replicas converge.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote, unquote, urlsplit

log = logging.getLogger(__name__)

MAX_POSITIONS = 32  # draft depths tracked per key; deeper positions are not counted
# Lower bounds of the batch-size buckets the served sums are kept per: rows 1, 2–3, 4–7, 8 and more.
# A row's step costs what the whole batch's forward costs, so tokens per second per row measured in
# a batch of 8 and in a batch of 1 are not comparable: proposers are compared within a bucket.
BATCH_BUCKETS = (1, 2, 4, 8)
Clock = Callable[[], float]


@dataclass(frozen=True)
class StatsKey:
    model: str
    proposer: str
    workload_tag: str = ""  # "" = every tag of this proposer (the pooled key)


@dataclass(frozen=True)
class AcceptanceStats:
    """Sums over verification steps that carried a draft: one step's sample, or decayed totals.

    ``ends`` is what the chain model alone cannot see: where a proposer has nothing more to offer.
    A path accepted to a leaf the proposer ended by itself (its tree smaller than the verifier's
    budget, not cut by the verifier), or a step it answered with no tree at all (d = 0), is a miss
    for the router, which compares proposers per step, but not for the verifier's width gate, which
    prices a tree it already holds. Without it, a proposer of shallow trees looks as if its
    acceptance went on at every depth below them, and one that rarely has a tree as good as one
    that always has.
    """

    steps: float = 0.0
    drafted: float = 0.0  # draft tokens verified
    accepted: float = 0.0  # draft tokens accepted
    proposer_s: float = 0.0  # seconds the verifier waited for this proposer's drafts
    hits: tuple[float, ...] = ()  # [d]: steps that accepted the draft token at depth d + 1
    trials: tuple[float, ...] = ()  # [d]: steps that decided a draft token at depth d + 1 (hit or miss)
    ends: tuple[float, ...] = ()  # [d]: steps whose path reached a leaf the proposer ended at depth d
    # Every step a request spent on this proposer, whatever it had: a verified tree, none, or one
    # the verifier's gate skipped. What the proposer delivered as it runs, gate and all: the router
    # ranks proposers by it once there is enough (the per-depth sums above price a k it chooses).
    # [b]: steps in a batch of batch_bucket(rows) == b.
    served_steps: tuple[float, ...] = ()
    served_tokens: tuple[float, ...] = ()  # tokens those steps emitted (accepted + bonus)
    served_nodes: tuple[float, ...] = ()  # draft nodes those steps verified
    served_trees: tuple[float, ...] = ()  # those steps the proposer had a tree for (verified or cut by the gate)
    served_s: tuple[float, ...] = ()  # what those steps took, measured: forward with acceptance + the wait for trees

    @classmethod
    def of_step(
        cls, drafted: int, accepted: int, rejected: bool, proposer_s: float = 0.0, ended: bool = False
    ) -> AcceptanceStats:
        """One verification step: ``accepted`` draft tokens taken; ``rejected``: the walk stopped at a
        node that had children (a miss at depth ``accepted + 1``), not at a leaf (censored: no miss).
        ``ended``: that leaf is where the proposer's own tree ended (an end at depth ``accepted``).

        >>> s = AcceptanceStats.of_step(drafted=5, accepted=2, rejected=True)
        >>> s.steps, s.drafted, s.accepted, s.hits, s.trials, s.ends
        (1.0, 5.0, 2.0, (1.0, 1.0), (1.0, 1.0, 1.0), ())
        >>> AcceptanceStats.of_step(drafted=3, accepted=3, rejected=False, ended=True).ends
        (0.0, 0.0, 0.0, 1.0)
        """
        hit = min(accepted, MAX_POSITIONS)
        tried = min(accepted + bool(rejected), MAX_POSITIONS)
        ends = one_at(accepted) if ended and not rejected else ()
        return cls(1.0, float(drafted), float(accepted), proposer_s, (1.0,) * hit, (1.0,) * tried, ends)

    @classmethod
    def no_tree(cls) -> AcceptanceStats:
        """A step the proposer answered with an empty tree: an end at depth 0 and nothing else (the
        verifier decoded plainly; the step is not one that carried a draft)."""
        return cls(ends=(1.0,))

    def __add__(self, other: AcceptanceStats) -> AcceptanceStats:
        return AcceptanceStats(
            self.steps + other.steps,
            self.drafted + other.drafted,
            self.accepted + other.accepted,
            self.proposer_s + other.proposer_s,
            _add(self.hits, other.hits),
            _add(self.trials, other.trials),
            _add(self.ends, other.ends),
            _add(self.served_steps, other.served_steps),
            _add(self.served_tokens, other.served_tokens),
            _add(self.served_nodes, other.served_nodes),
            _add(self.served_trees, other.served_trees),
            _add(self.served_s, other.served_s),
        )

    def scaled(self, f: float) -> AcceptanceStats:
        if f == 1.0:
            return self
        return AcceptanceStats(
            self.steps * f,
            self.drafted * f,
            self.accepted * f,
            self.proposer_s * f,
            tuple(x * f for x in self.hits),
            tuple(x * f for x in self.trials),
            tuple(x * f for x in self.ends),
            tuple(x * f for x in self.served_steps),
            tuple(x * f for x in self.served_tokens),
            tuple(x * f for x in self.served_nodes),
            tuple(x * f for x in self.served_trees),
            tuple(x * f for x in self.served_s),
        )

    @classmethod
    def served(
        cls, tokens: int, nodes: int, seconds: float, rows: int = 1, tree: bool | None = None
    ) -> AcceptanceStats:
        """One step of a request on this proposer: ``tokens`` emitted, ``nodes`` draft nodes verified
        (0 where the step had no tree, or one the gate skipped), costing the request ``seconds``, in
        a batch of ``rows``; ``tree``: the proposer had a tree for it, verified or cut by the gate
        (None: whether nodes were verified).

        >>> AcceptanceStats.served(3, 6, 0.08, rows=5).served_tokens
        (0.0, 0.0, 3.0)
        """
        b = batch_bucket(rows)

        def at_b(v: float) -> tuple[float, ...]:  # dense, as long as its last non-zero (as from_fields reads it)
            return (0.0,) * b + (float(v),) if v else ()

        return cls(
            served_steps=at_b(1),
            served_tokens=at_b(tokens),
            served_nodes=at_b(nodes),
            served_trees=at_b(1 if (nodes > 0 if tree is None else tree) else 0),
            served_s=at_b(seconds),
        )

    def served_in(self, bucket: int | None = None) -> tuple[float, float, float, float, float]:
        """(steps, tokens, nodes, trees, seconds) served in batches of ``bucket``, or in all (None)."""
        sums = (self.served_steps, self.served_tokens, self.served_nodes, self.served_trees, self.served_s)
        if bucket is None:
            return tuple(sum(xs) for xs in sums)  # type: ignore[return-value]
        return tuple(value_at(xs, bucket) for xs in sums)  # type: ignore[return-value]

    @property
    def served_tokens_per_step(self) -> float:
        steps, tokens, *_ = self.served_in()
        return tokens / steps if steps else 0.0

    @property
    def served_tokens_per_s(self) -> float:
        """Tokens per second per row the proposer's requests got, in batches of every size (0 with
        no evidence).

        >>> round((AcceptanceStats.served(3, 6, 0.08) + AcceptanceStats.served(1, 0, 0.06)).served_tokens_per_s, 2)
        28.57
        """
        _, tokens, _, _, seconds = self.served_in()
        return tokens / seconds if seconds else 0.0

    def served_tokens_per_s_by_batch(self) -> list[float]:
        """``served_tokens_per_s`` per batch bucket (0 where none was served).

        >>> s = AcceptanceStats.served(3, 6, 0.05) + AcceptanceStats.served(1, 0, 0.1, rows=8)
        >>> s.served_tokens_per_s_by_batch()
        [60.0, 0.0, 0.0, 10.0]
        """
        return [value_at(self.served_tokens, b) / x if x else 0.0 for b, x in enumerate(self.served_s)]

    @property
    def accepted_per_step(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def drafted_per_step(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0

    @property
    def coverage(self) -> float:
        """Share of the proposer's steps that had a tree: trees decided at depth 1 over those and
        the steps it answered with none (1 with no evidence either way).

        >>> (AcceptanceStats(trials=(3.0,)) + AcceptanceStats.no_tree()).coverage
        0.75
        """
        trees = self.trials[0] if self.trials else 0.0
        empty = self.ends[0] if self.ends else 0.0
        return trees / (trees + empty) if trees + empty > 0 else 1.0

    @property
    def proposer_s_per_step(self) -> float:
        return self.proposer_s / self.steps if self.steps else 0.0

    def position_acceptance(self) -> list[float]:
        """Observed acceptance rate at each depth (hits / trials; 0 where nothing was tried)."""
        return [(self.hits[d] if d < len(self.hits) else 0.0) / n if n else 0.0 for d, n in enumerate(self.trials)]

    def to_fields(self) -> dict[str, float]:
        """Flat field → value map (the Redis hash layout), non-zero entries only."""
        out = {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted, "proposer_s": self.proposer_s}
        for name in SERVED_FIELDS:
            out.update({f"{name}.{b}": v for b, v in enumerate(getattr(self, name))})
        out.update({f"h{d}": v for d, v in enumerate(self.hits)})
        out.update({f"n{d}": v for d, v in enumerate(self.trials)})
        out.update({f"e{d}": v for d, v in enumerate(self.ends)})
        return {k: v for k, v in out.items() if v}

    @classmethod
    def from_fields(cls, fields: dict[str, float | str]) -> AcceptanceStats:
        """Inverse of ``to_fields``; unknown fields are ignored.

        >>> s = AcceptanceStats.of_step(4, 1, True, 0.002) + AcceptanceStats.no_tree()
        >>> s += AcceptanceStats.served(2, 4, 0.07) + AcceptanceStats.served(1, 0, 0.2, rows=8)
        >>> AcceptanceStats.from_fields({k: str(v) for k, v in s.to_fields().items()}) == s
        True
        """
        hits: dict[int, float] = {}
        trials: dict[int, float] = {}
        ends: dict[int, float] = {}
        per_depth = {"h": hits, "n": trials, "e": ends}
        per_batch: dict[str, dict[int, float]] = {name: {} for name in SERVED_FIELDS}
        scalars = dict.fromkeys(("steps", "drafted", "accepted", "proposer_s"), 0.0)
        for name, raw in fields.items():
            base, _, b = name.partition(".")
            if name in scalars:
                scalars[name] = float(raw)
            elif name[:1] in per_depth and name[1:].isdigit() and int(name[1:]) < MAX_POSITIONS:
                per_depth[name[0]][int(name[1:])] = float(raw)
            elif base in per_batch and b.isdigit() and int(b) < len(BATCH_BUCKETS):
                per_batch[base][int(b)] = float(raw)
        served = {name: _dense(v) for name, v in per_batch.items()}
        return cls(**scalars, hits=_dense(hits), trials=_dense(trials), ends=_dense(ends), **served)


SERVED_FIELDS = ("served_steps", "served_tokens", "served_nodes", "served_trees", "served_s")


def batch_bucket(rows: int) -> int:
    """Which ``BATCH_BUCKETS`` entry a step of ``rows`` rows counts under.

    >>> [batch_bucket(r) for r in (1, 2, 3, 4, 7, 8, 64)]
    [0, 1, 1, 2, 2, 3, 3]
    """
    return max(b for b, low in enumerate(BATCH_BUCKETS) if rows >= low or b == 0)


def value_at(xs: tuple[float, ...], i: int) -> float:
    """``xs[i]``, 0 past the end (the sums are dense tuples, as long as their last non-zero)."""
    return xs[i] if i < len(xs) else 0.0


def one_at(d: int) -> tuple[float, ...]:
    """A per-depth tuple counting one at depth index ``d`` (the deepest tracked, past it).

    >>> one_at(2)
    (0.0, 0.0, 1.0)
    """
    d = min(d, MAX_POSITIONS - 1)
    return (0.0,) * d + (1.0,)


def _add(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    if len(a) < len(b):
        a, b = b, a
    return tuple(x + (b[i] if i < len(b) else 0.0) for i, x in enumerate(a))


def _dense(sparse: dict[int, float]) -> tuple[float, ...]:
    return tuple(sparse.get(d, 0.0) for d in range(max(sparse, default=-1) + 1))


def decay_factor(dt: float, half_life_s: float) -> float:
    """Weight left after ``dt`` seconds.

    >>> decay_factor(20.0, 10.0)
    0.25
    """
    return 0.5 ** (dt / half_life_s) if dt > 0 else 1.0


def combine(
    a: AcceptanceStats, ta: float, b: AcceptanceStats, tb: float, half_life_s: float
) -> tuple[AcceptanceStats, float]:
    """Sum of two decayed values, stamped at the later of their times (the Lua script's rule).

    >>> s, t = combine(AcceptanceStats(steps=8.0), 0.0, AcceptanceStats(steps=1.0), 10.0, half_life_s=10.0)
    >>> s.steps, t
    (5.0, 10.0)
    """
    if ta <= tb:
        return a.scaled(decay_factor(tb - ta, half_life_s)) + b, tb
    return a + b.scaled(decay_factor(ta - tb, half_life_s)), ta


@dataclass(frozen=True)
class StatsConfig:
    redis_url: str = ""  # "" = in-process statistics (the embedded default)
    key_prefix: str = "specmesh:stats"
    half_life_s: float = 300.0
    ttl_s: float = 86_400.0  # keys not written for this long expire
    flush_interval_s: float = 0.1
    flush_steps: int = 64  # records that trigger a flush before the interval ends
    refresh_interval_s: float = 0.5  # how often the local snapshot re-reads Redis
    socket_timeout_s: float = 0.5
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0


@dataclass(frozen=True)
class BackendStatus:
    backend: str  # "in-process" | "redis"
    connected: bool  # in-process: always True
    detail: str = ""  # redis: address, and the last error while disconnected
    pending_keys: int = 0  # keys with deltas not yet written to Redis


class StatsBackend(Protocol):
    """What the router and the engine use; both backends implement it. Never raises on I/O."""

    config: StatsConfig

    def record(self, key: StatsKey, sample: AcceptanceStats) -> None:
        """Add a sample (one step, or several summed) stamped now. Non-blocking."""
        ...

    def snapshot(self, keys: Iterable[StatsKey] | None = None) -> dict[StatsKey, AcceptanceStats]:
        """Decayed totals as of now, for ``keys`` (those with data) or every known key. Non-blocking."""
        ...

    def status(self) -> BackendStatus: ...

    def close(self) -> None: ...


class _Table:
    """key → (decayed sums, the time they refer to). Not thread-safe: callers hold a lock."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.rows: dict[StatsKey, tuple[AcceptanceStats, float]] = {}

    def add(self, key: StatsKey, stats: AcceptanceStats, t: float) -> None:
        old = self.rows.get(key)
        self.rows[key] = (stats, t) if old is None else combine(*old, stats, t, self.half_life_s)

    def merge(self, other: _Table) -> None:
        for key, (stats, t) in other.rows.items():
            self.add(key, stats, t)


def _decayed(tables: list[dict], now: float, keys: Iterable[StatsKey] | None, half_life_s: float) -> dict:
    wanted = None if keys is None else set(keys)
    out: dict[StatsKey, AcceptanceStats] = {}
    for rows in tables:
        for key, (stats, t) in rows.items():
            if wanted is not None and key not in wanted:
                continue
            value = stats.scaled(decay_factor(now - t, half_life_s)) if now >= t else stats
            out[key] = out[key] + value if key in out else value
    return out


class InProcessStats:
    """Statistics of this process only (no Redis configured)."""

    def __init__(self, config: StatsConfig | None = None, clock: Clock = time.time) -> None:
        self.config = config or StatsConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._table = _Table(self.config.half_life_s)

    def record(self, key: StatsKey, sample: AcceptanceStats) -> None:
        now = self._clock()
        with self._lock:
            self._table.add(key, sample, now)

    def snapshot(self, keys: Iterable[StatsKey] | None = None) -> dict[StatsKey, AcceptanceStats]:
        now = self._clock()
        with self._lock:
            rows = dict(self._table.rows)
        return _decayed([rows], now, keys, self.config.half_life_s)

    def status(self) -> BackendStatus:
        return BackendStatus("in-process", True)

    def close(self) -> None:
        pass


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
        self._pending = _Table(hl)  # recorded, not yet sent
        self._inflight = _Table(hl)  # being sent now: still counted until it is written or put back
        self._unseen = _Table(hl)  # sent, not yet in a refreshed view
        self._view = _Table(hl)  # Redis' content at the last refresh
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
        return _decayed(tables, now, keys, self.config.half_life_s)

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
            batch, self._pending = self._pending, _Table(hl)
            self._inflight = batch  # snapshots keep counting it while it is on the wire
            self._since_flush = 0
        if not batch.rows:
            return
        try:
            failed, error = self._send(batch)
        except BaseException:  # connection lost mid-pipeline: nothing known written, all resent
            with self._lock:
                batch.merge(self._pending)
                self._pending, self._inflight = batch, _Table(hl)
            raise
        with self._lock:
            kept = _Table(hl)
            for key in failed:
                kept.rows[key] = batch.rows.pop(key)
            self._unseen.merge(batch)  # written: in the snapshot until the next refresh reads it
            kept.merge(self._pending)
            self._pending, self._inflight = kept, _Table(hl)
        if error is not None:
            raise error

    def _send(self, batch: _Table) -> tuple[list[StatsKey], Exception | None]:
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
        view = _Table(self.config.half_life_s)
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
            self._unseen = _Table(self.config.half_life_s)
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


def open_stats(config: StatsConfig, clock: Clock = time.time) -> StatsBackend:
    """RedisStats when a Redis URL is configured, else InProcessStats. Never connects eagerly."""
    return RedisStats(config, clock) if config.redis_url else InProcessStats(config, clock)
