"""The acceptance model: per-depth Beta posteriors, shared across requests and refined per request.

α_d is the probability that a draft token at depth d is accepted given its parent was. One model
serves every decision:

- the shared statistics (decayed sums per proposer and workload tag, ``stats.py``) give each
  proposer a :class:`Posterior` (:func:`posterior`): what the router knows before a request starts;
- a request's :class:`RequestEstimate` starts from that posterior's means and adds the request's
  own decayed evidence, every verified tree and every skipped tree scored against the emitted
  tokens. Its means feed the verifier's per-step width gate (``expected_accepted`` over the
  tree's depth).

Evidence is censored: a path accepted to the end of a (cut) tree counts no miss at the next
depth, so cutting trees never biases the estimate down.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from specmesh_router.stats import BATCH_BUCKETS, MAX_POSITIONS, AcceptanceStats, batch_bucket, one_at, value_at

MAX_ALPHA = 0.99  # the gate never plans on certain acceptance


@dataclass(frozen=True)
class Served:
    """What a proposer's requests got per step in batches of one size (``BATCH_BUCKETS``), measured
    over every step they spent on it (a tree verified, none, or one the gate skipped): tokens
    emitted, draft nodes verified, and what the step cost the request.

    >>> s = AcceptanceStats.served(3, 6, 0.08) + AcceptanceStats.served(1, 0, 0.06)
    >>> Served.of(s, min_steps=2, rows=1)
    Served(tokens=2.0, nodes=3.0, seconds=0.07, steps=2.0, rows=1)
    >>> Served.of(s, min_steps=2, rows=8) is None    # nothing served in batches of 8
    True
    >>> Served.of(AcceptanceStats.served(3, 6, 0.08), min_steps=2, rows=1) is None    # too little to go by
    True
    >>> Served.of(s + AcceptanceStats.served(2, 0, 0.1, rows=8), min_steps=3, rows=None)    # pooled over sizes
    Served(tokens=2.0, nodes=2.0, seconds=0.08, steps=3.0, rows=0)
    """

    tokens: float
    nodes: float
    seconds: float
    steps: float  # decayed steps behind the means
    rows: int = 1  # a batch size of the bucket they were measured in (0: pooled over every batch size)

    @classmethod
    def of(cls, stats: AcceptanceStats | None, min_steps: float, rows: int | None) -> Served | None:
        """The figures at ``rows``' batch bucket (None: pooled over every batch size), where there
        are ``min_steps`` steps of them."""
        if stats is None:
            return None
        n, tokens, nodes, _, seconds = stats.served_in(None if rows is None else batch_bucket(rows))
        if n < min_steps or n <= 0:
            return None
        return cls(tokens / n, nodes / n, seconds / n, n, rows or 0)


def ranking_rows(evidence: Sequence[Sequence[AcceptanceStats | None]], min_steps: float, rows: int) -> int:
    """The batch size whose measured figures rank the candidates: ``rows`` where every candidate has
    served ``min_steps`` steps in its bucket, else the nearest bucket where every one has (larger
    batches first on a tie), else ``rows``. Each candidate is ranked by measurements or all by the
    α model, never some by one and some by the other: the α chain misprices trees sized by their
    own probabilities, so a proposer not yet measured at one batch size would be set against the
    others' measurements on another scale, where its figures at a nearby size rank it on theirs.

    ``evidence``: per candidate, its statistics in the order they are read (its tag's, the pooled).

    >>> ngram = AcceptanceStats.served(2, 8, 0.05, rows=8).scaled(100.0)    # measured at 8 rows only
    >>> suffix = ngram + AcceptanceStats.served(3, 6, 0.05, rows=1).scaled(100.0)
    >>> ranking_rows([[suffix], [ngram]], min_steps=64, rows=1)    # n-gram: no 1-row figures yet
    8
    >>> ranking_rows([[suffix], [None, ngram]], min_steps=64, rows=12), ranking_rows([[suffix]], 64, rows=3)
    (12, 1)
    >>> ranking_rows([[suffix], [None]], min_steps=64, rows=3)    # one has no figures at all: the α model
    3
    """
    here = batch_bucket(rows)
    order = sorted(range(len(BATCH_BUCKETS)), key=lambda b: (abs(b - here), -b))

    def measured(stats: Sequence[AcceptanceStats | None], b: int) -> bool:
        return any(Served.of(s, min_steps, BATCH_BUCKETS[b]) is not None for s in stats)

    for b in order:
        if all(measured(stats, b) for stats in evidence):
            return rows if b == here else BATCH_BUCKETS[b]
    return rows


@dataclass(frozen=True)
class Posterior:
    """Beta(a[d], b[d]) over the acceptance of one proposer's draft token at depth d + 1."""

    proposer: str
    a: tuple[float, ...]
    b: tuple[float, ...]
    wait_s: float = 0.0  # mean verifier wait for this proposer's draft, per step
    evidence: float = 0.0  # decayed steps behind the posterior
    coverage: float = 1.0  # share of steps the proposer had a tree for (the others cost a plain step)
    served: Served | None = None  # measured per step in batches of ``ranking_rows``' size, where there is enough

    def means(self) -> list[float]:
        return [a / (a + b) for a, b in zip(self.a, self.b, strict=True)]


def posterior(
    proposer: str,
    stats: AcceptanceStats | None,
    pooled: AcceptanceStats | None,
    prior_mean: float,
    strength: float,
    depth: int,
    count_ends: bool = True,
    min_served: float = math.inf,
    rows: int | None = 1,
) -> Posterior:
    """Per-depth Beta posteriors from shared statistics. Prior mean at depth d: the pooled (all
    workload tags) statistics where they exist, else the posterior mean one level up (depth 1:
    ``prior_mean``), worth ``strength`` trials. ``served``: the tag's measured steps in batches of
    ``rows``' bucket (None: in batches of every size) where it has ``min_served`` of them, else the
    pooled ones', else None.

    ``count_ends``: where the proposer's own trees ended (``AcceptanceStats.ends``) counts as a miss,
    so α is per step, whatever the proposer had: what the router compares proposers by. Without,
    α is given that a node is there: what the width gate prices a tree by.

    >>> p = posterior("ngram", AcceptanceStats(steps=10.0, hits=(8.0,), trials=(10.0,)), None, 0.5, 2.0, depth=2)
    >>> p.a, p.b    # depth 2: no data, prior mean = depth 1's 9/12
    ((9.0, 1.5), (3.0, 0.5))
    >>> shallow = AcceptanceStats(steps=10.0, hits=(8.0, 8.0), trials=(10.0, 8.0), ends=(0.0, 0.0, 8.0))
    >>> [round(m, 2) for m in posterior("head", shallow, None, 0.5, 2.0, depth=3).means()]  # trees end at 2
    [0.75, 0.95, 0.19]
    >>> [round(m, 2) for m in posterior("head", shallow, None, 0.5, 2.0, depth=3, count_ends=False).means()]
    [0.75, 0.95, 0.95]
    """
    stats = stats or AcceptanceStats()
    a: list[float] = []
    b: list[float] = []
    mean = prior_mean
    for d in range(depth):
        if pooled is not None and (n := _trials(pooled, d, count_ends)) > 0:
            mean = (value_at(pooled.hits, d) + mean * strength) / (n + strength)
        hits, trials = value_at(stats.hits, d), _trials(stats, d, count_ends)
        a.append(mean * strength + hits)
        b.append((1 - mean) * strength + max(trials - hits, 0.0))
        mean = a[-1] / (a[-1] + b[-1])
    served = Served.of(stats, min_served, rows) or Served.of(pooled, min_served, rows)
    return Posterior(proposer, tuple(a), tuple(b), stats.proposer_s_per_step, stats.steps, stats.coverage, served)


def _trials(stats: AcceptanceStats, d: int, count_ends: bool) -> float:
    return value_at(stats.trials, d) + (value_at(stats.ends, d) if count_ends else 0.0)


def levels_sample(first_depth: int, accepted: int, rejected: bool, ended: bool = False) -> AcceptanceStats:
    """Per-depth evidence of ``accepted`` levels taken from depth ``first_depth + 1`` on, then a miss
    if ``rejected`` (else censored, or an end where the proposer's tree ``ended``): a verified
    tree starts at depth 1, a skipped tree's walk resumes where the previous step left it.

    >>> s = levels_sample(1, 2, True)    # depths 2 and 3 accepted, depth 4 missed
    >>> s.hits, s.trials
    ((0.0, 1.0, 1.0), (0.0, 1.0, 1.0, 1.0))
    """
    hit = min(first_depth + accepted, MAX_POSITIONS)
    tried = min(first_depth + accepted + bool(rejected), MAX_POSITIONS)
    skip = min(first_depth, MAX_POSITIONS)
    ends = one_at(first_depth + accepted) if ended and not rejected else ()
    return AcceptanceStats(
        hits=(0.0,) * skip + (1.0,) * (hit - skip), trials=(0.0,) * skip + (1.0,) * (tried - skip), ends=ends
    )


@dataclass
class RequestEstimate:
    """One request's per-depth acceptance: the shared posterior's means as the prior, then the
    request's own evidence. Both decay by ``keep`` per observation, so the prior fades as the
    request shows what it is (a request whose trees always match climbs to ``MAX_ALPHA`` within a
    few steps, whatever the shared statistics said).

    Mean at depth d = (m_d · w + hits_d) / (w + trials_d), with m_d the prior mean (beyond the
    prior's depth: the estimate one level up) and w the prior's weight, ``strength`` at the start.

    >>> est = RequestEstimate((0.2, 0.2, 0.2))
    >>> [round(a, 2) for a in est.alphas(3)]
    [0.2, 0.2, 0.2]
    >>> for _ in range(6):
    ...     est.observe(levels_sample(0, 3, False))    # a chain of 3 accepted to its end, 6 times
    >>> [round(a, 2) for a in est.alphas(4)]    # depth 4 untried: the estimate one level up
    [0.83, 0.83, 0.83, 0.83]
    >>> est.observe(levels_sample(0, 0, True))    # then a miss at depth 1
    >>> [round(a, 2) for a in est.alphas(2)]
    [0.6, 0.83]
    """

    prior: tuple[float, ...]  # prior mean per depth (the shared posterior's means)
    strength: float = 2.0 / 0.3  # prior weight in trials at the start (2 steps' worth of EWMA 0.3)
    keep: float = 0.7  # weight left to older evidence (and the prior) per observation
    seen: AcceptanceStats = field(default_factory=AcceptanceStats)
    weight: float = field(init=False)  # the prior's current weight

    def __post_init__(self) -> None:
        self.weight = self.strength

    @classmethod
    def from_posterior(cls, post: Posterior | None, prior_mean: float = 0.5) -> RequestEstimate:
        return cls(tuple(post.means()) if post is not None and post.a else (prior_mean,))

    def observe(self, sample: AcceptanceStats) -> None:
        self.weight *= self.keep
        self.seen = self.seen.scaled(self.keep) + sample

    def observe_no_tree(self) -> None:
        """A step the proposer had no tree for: counted for its coverage, without aging the
        per-depth evidence (the gate's α's say what a tree is worth when there is one)."""
        self.seen = self.seen + AcceptanceStats.no_tree()

    def alphas(self, depth: int) -> list[float]:
        """Posterior mean α per depth 1 … ``depth`` (at most ``MAX_ALPHA``), given a node is there:
        what the width gate prices a tree it holds by."""
        w, out = self.weight, []
        mean = self.prior[0]
        for d in range(depth):
            mean = self.prior[d] if d < len(self.prior) else mean
            hits, trials = value_at(self.seen.hits, d), value_at(self.seen.trials, d)
            a, b = mean * w + hits, (1 - mean) * w + max(trials - hits, 0.0)
            mean = a / (a + b) if a + b > 0 else mean
            out.append(min(mean, MAX_ALPHA))
        return out


def expected_accepted(alphas: Sequence[float]) -> list[float]:
    """E(k) for k = 0 … len(alphas): draft tokens a k-token chain gets accepted on average,
    Σ_{d=1..k} Π_{j=1..d} α_j.

    >>> expected_accepted([0.5, 0.5, 0.5])
    [0.0, 0.5, 0.75, 0.875]
    """
    out, reach = [0.0], 1.0
    for alpha in alphas:
        reach *= alpha
        out.append(out[-1] + reach)
    return out
