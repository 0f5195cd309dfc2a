"""Live acceptance statistics per (target model, proposer, workload_tag), exponentially decayed.

Every value is a sum over verification steps that decays with a half-life, so the router follows
drift: ``v(now) = v(t) · 0.5 ** ((now - t) / half_life)``. This module holds the value type, its
keys and batch buckets, the backend interface and the in-process backend; two backends share it:

- ``InProcessStats`` (here): a dict in this process (the embedded default, no Redis configured);
- ``RedisStats`` (``router.redis_stats``): shared by every verifier replica through Redis.

``open_stats`` picks one from the configuration.

Decayed sums are order-independent: a delta stamped at ``s`` adds ``d · 0.5 ** ((T - s) / h)`` to
the total at the latest stamp ``T``, whichever update arrives first, so replicas converge.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

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
            *(x + y for x, y in zip(self._scalars(), other._scalars(), strict=True)),
            *(_add(x, y) for x, y in zip(self._tuples(), other._tuples(), strict=True)),
        )

    def scaled(self, f: float) -> AcceptanceStats:
        if f == 1.0:
            return self
        return AcceptanceStats(*(x * f for x in self._scalars()), *(tuple(v * f for v in x) for x in self._tuples()))

    def _scalars(self) -> tuple[float, ...]:
        return self.steps, self.drafted, self.accepted, self.proposer_s

    def _tuples(self) -> tuple[tuple[float, ...], ...]:  # in field order, after the scalars
        return (self.hits, self.trials, self.ends, *(getattr(self, name) for name in SERVED_FIELDS))

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


class DecayedTable:
    """key → (decayed sums, the time they refer to). Not thread-safe: callers hold a lock."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.rows: dict[StatsKey, tuple[AcceptanceStats, float]] = {}

    def add(self, key: StatsKey, stats: AcceptanceStats, t: float) -> None:
        old = self.rows.get(key)
        self.rows[key] = (stats, t) if old is None else combine(*old, stats, t, self.half_life_s)

    def merge(self, other: DecayedTable) -> None:
        for key, (stats, t) in other.rows.items():
            self.add(key, stats, t)


def decayed_sums(
    tables: list[dict[StatsKey, tuple[AcceptanceStats, float]]],
    now: float,
    keys: Iterable[StatsKey] | None,
    half_life_s: float,
) -> dict[StatsKey, AcceptanceStats]:
    """Every table's rows decayed to ``now`` and summed per key (``keys``: only those; None: all)."""
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
        self._table = DecayedTable(self.config.half_life_s)

    def record(self, key: StatsKey, sample: AcceptanceStats) -> None:
        now = self._clock()
        with self._lock:
            self._table.add(key, sample, now)

    def snapshot(self, keys: Iterable[StatsKey] | None = None) -> dict[StatsKey, AcceptanceStats]:
        now = self._clock()
        with self._lock:
            rows = dict(self._table.rows)
        return decayed_sums([rows], now, keys, self.config.half_life_s)

    def status(self) -> BackendStatus:
        return BackendStatus("in-process", True)

    def close(self) -> None:
        pass


def open_stats(config: StatsConfig, clock: Clock = time.time) -> StatsBackend:
    """RedisStats when a Redis URL is configured, else InProcessStats. Never connects eagerly."""
    if not config.redis_url:
        return InProcessStats(config, clock)
    from specmesh_router.redis_stats import RedisStats  # here: it imports this module (and redis)

    return RedisStats(config, clock)
