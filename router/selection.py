"""Which proposer, and how many draft tokens per step: the router's policy core.

For proposer p verifying k draft tokens per step in a batch of B rows:

    goodput(p, k) = (1 + E_p(k)) / (c_p · step_time(B, 1 + k) + (1 - c_p) · step_time(B, 1) + wait_p)
    E_p(k)        = Σ_{d=1..k} Π_{j=1..d} α_{p,j}

α_{p,j}: probability that p's draft token at depth j is accepted given its parent was (a Beta
posterior per depth from the decayed statistics), where the end of p's own tree counts as a miss:
a proposer of shallow trees gets nothing for depths it never drafts, and one that often has no
tree gets less at depth 1; c_p: the share of steps p had a tree for (the others are plain steps);
wait_p: the verifier's mean wait for p's draft per step; the 1 is the bonus token. k = 0 (plain
decoding, 1 / step_time(B, 1)) is always a candidate, so speculation switches itself off where
verification is dear (large batches, CPUs) or acceptance poor. A request's k is priced as if
every row of the step drafted as much, step_time(B, 1 + k): with packed steps each row pays for
its own tree only, which the verifier's width gate prices step by step (``choose_widths``).

Which proposer: the goodput above prices k, but ranks proposers only until each has served
enough steps (``min_served_steps``, decayed). From then on a proposer is ranked by what it
measurably delivered per step, every step its requests spent on it counted, gate and all:

    served(p) = Σ tokens / Σ (seconds_s + wait_s)

over the steps s of p's requests in batches of the size decided for (``BATCH_BUCKETS``: a row's
step costs the whole batch's forward, so figures from 8-row steps do not rank 1-row requests)
(decayed sums): tokens emitted; the step's measured time (the forward and acceptance) and the
verifier's wait for trees. Every candidate is ranked at one batch size: where one has not served
enough at the size decided for, all are ranked by their figures at the nearest size where each
has (``ranking_rows``), and all by the model where there is none. Measured, not priced by the cost
model: a step's cost is far from linear in its width, and a start-up table off by a few
milliseconds at one width moves a ranking between proposers a tenth apart. The α chain is a model of
chains; a proposer of wide trees sized by its own probabilities (suffix) is not one, and the
model can rank it below a proposer it beats in every category. A proposer whose evidence decays
below the threshold (unused for a few half-lives) is ranked by the model again, so it is retried.

Exploration: ``thompson`` draws the α's from their posteriors (a seeded ``random.Random``; one
draw per proposer moves every depth together); ``ucb`` adds an optimism bonus that shrinks with
evidence; ``greedy`` uses posterior means. Statistics decay toward the prior, so the evidence
behind a proposer that is not used shrinks and it is tried again.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specmesh_router.cost_model import CostFn
from specmesh_router.estimate import Posterior, RequestEstimate, Served, expected_accepted, posterior, ranking_rows
from specmesh_router.policy import PolicyStore, SpeculationPolicy, resolve_proposer
from specmesh_router.stats import AcceptanceStats, StatsBackend, StatsKey

StepTime = CostFn  # (batch rows, tokens per row) → seconds of one verification forward
EXPLORATION = ("thompson", "ucb", "greedy")


@dataclass(frozen=True)
class SelectionConfig:
    exploration: str = "thompson"  # "thompson" | "ucb" | "greedy"
    ucb_c: float = 0.5
    prior_mean: float = 0.5  # α prior at depth 1 where nothing is known
    prior_strength: float = 2.0  # pseudo-trials behind a prior
    max_k: int = 32  # draft tokens per step, at most
    min_gain: float = 0.02  # speculate only when goodput beats plain decoding by this fraction
    switch_margin: float = 0.05  # mid-request: another proposer must beat the current one by this much
    min_served_steps: float = 64.0  # decayed steps of a proposer before its measured goodput ranks it
    seed: int = 0

    def __post_init__(self) -> None:
        if self.exploration not in EXPLORATION:
            raise ValueError(f"exploration: must be one of {', '.join(EXPLORATION)}, got {self.exploration!r}")


@dataclass(frozen=True)
class Decision:
    proposer: str  # whose stream the request should have ("none": no stream)
    k: int  # draft tokens to verify per step now; 0 = plain decoding (the stream may stay for statistics)
    goodput: float  # expected tokens/s per row of this choice
    baseline: float  # expected tokens/s per row of plain decoding
    expected_accepted: float = 0.0  # draft tokens accepted per step, expected (at k)
    reason: str = ""  # why k == 0, or why no proposer

    @property
    def speculate(self) -> bool:
        return self.k > 0 and self.proposer != "none"


def draw_alphas(
    post: Posterior, config: SelectionConfig, rng: random.Random | None, total_evidence: float
) -> list[float]:
    """One α per depth: a posterior draw (thompson), an optimistic bound (ucb), or the mean (greedy).

    >>> post = Posterior("ngram", (9.0, 3.0), (3.0, 1.0))
    >>> draw_alphas(post, SelectionConfig(exploration="greedy"), None, 0.0)
    [0.75, 0.75]
    >>> thompson = SelectionConfig(exploration="thompson")
    >>> draw_alphas(post, thompson, random.Random(7), 0.0) == draw_alphas(post, thompson, random.Random(7), 0.0)
    True
    """
    means = post.means()
    if config.exploration == "thompson":
        # One standard-normal draw moves every depth by z posterior deviations (a Gaussian view of
        # each Beta, comonotone across depths): a proposer is explored as a whole. Independent
        # draws per depth would almost never make an unproven proposer look good at every depth.
        z = (rng or random.Random(config.seed)).gauss(0.0, 1.0)
        return [
            min(max(m + z * math.sqrt(m * (1 - m) / (a + b + 1)), 0.001), 0.999)
            for m, a, b in zip(means, post.a, post.b, strict=True)
        ]
    if config.exploration == "ucb":
        log_n = math.log(1.0 + total_evidence)
        return [
            min(m + config.ucb_c * math.sqrt(log_n / (a + b)), 0.999)
            for m, a, b in zip(means, post.a, post.b, strict=True)
        ]
    return means


def best_k(
    alphas: Sequence[float], step_time: StepTime, batch: int, wait_s: float, coverage: float = 1.0
) -> tuple[int, float, float]:
    """(k ≥ 1, its goodput, its E(k)) maximising (1 + E(k)) / (cost of the step + wait_s), a step
    with a tree (share ``coverage``) costing step_time(batch, 1 + k), one without step_time(batch, 1).

    >>> from specmesh_router.cost_model import StepCost
    >>> cpu = StepCost.by_tokens((1, 2, 4, 8, 16), (0.066, 0.119, 0.125, 0.139, 0.158))
    >>> k, g, e = best_k([0.9] * 16, cpu, batch=1, wait_s=0.0)
    >>> k, round(g, 1), round(e, 2)
    (16, 52.0, 7.33)
    """
    e = expected_accepted(alphas)
    plain = (1 - coverage) * step_time(batch, 1)
    best = (1, 0.0, 0.0)
    for k in range(1, len(alphas) + 1):
        g = (1 + e[k]) / (coverage * step_time(batch, 1 + k) + plain + wait_s)
        if g > best[1]:
            best = (k, g, e[k])
    return best


def served_goodput(served: Served, config: SelectionConfig, rng: random.Random | None, total_evidence: float) -> float:
    """Tokens/s per row a proposer measurably delivered: tokens per step over seconds per step.
    Thompson draws the tokens per step around their mean with a standard deviation of mean / √steps
    (accepted lengths are heavy-tailed: their spread is about their mean); ucb adds
    c · mean · √(log N / steps); greedy takes the mean.

    >>> round(served_goodput(Served(3.0, 3.0, 0.07, 500.0), SelectionConfig(exploration="greedy"), None, 0.0), 1)
    42.9
    """
    tokens = served.tokens
    if config.exploration == "thompson":
        tokens *= 1.0 + (rng or random.Random(config.seed)).gauss(0.0, 1.0) / math.sqrt(served.steps)
    elif config.exploration == "ucb":
        tokens *= 1.0 + config.ucb_c * math.sqrt(math.log(1.0 + total_evidence) / served.steps)
    return max(tokens, 0.0) / served.seconds if served.seconds > 0 else 0.0


@dataclass(frozen=True)
class _Scored:
    proposer: str
    k: int
    goodput: float  # the α model's, at k
    expected: float  # E(k)
    rank: float  # what proposers are compared by: measured goodput where there is enough, else the model's


def choose(
    posteriors: Sequence[Posterior],
    step_time: StepTime,
    batch: int,
    max_k: int,
    config: SelectionConfig,
    rng: random.Random | None = None,
    current: str | None = None,
) -> Decision:
    """The (proposer, k) with the highest expected goodput; k = 0 unless speculation clearly pays.

    ``posteriors``: the candidates (one for a proposer fixed by the client or the policy).
    ``current``: the request's proposer mid-request; another must beat it by ``switch_margin``.
    Proposers with ``served`` measurements are ranked by them (``served_goodput``); k, and whether
    speculation pays at all, come from the α model of the proposer ranked first.

    >>> cfg = SelectionConfig(exploration="greedy")
    >>> from specmesh_router.cost_model import StepCost
    >>> cpu = StepCost.by_tokens((1, 2, 4, 8, 16, 32, 64, 128), (1.0, 1.8, 1.9, 2.1, 2.4, 3.4, 6.0, 11.5))
    >>> copy = Posterior("ngram", (9.0,) * 8, (1.0,) * 8)    # α = 0.9 per depth
    >>> chat = Posterior("draft", (3.0,) * 8, (7.0,) * 8)    # α = 0.3
    >>> d = choose([chat, copy], cpu, batch=1, max_k=8, config=cfg)
    >>> d.proposer, d.k, round(d.goodput / d.baseline, 2)
    ('ngram', 8, 2.87)
    >>> d = choose([chat, copy], cpu, batch=64, max_k=8, config=cfg)    # verification too dear at batch 64
    >>> d.proposer, d.k
    ('ngram', 0)
    >>> choose([chat], cpu, batch=1, max_k=8, config=cfg).k    # poor acceptance: not worth 1.8x per step
    0
    """
    baseline = 1.0 / step_time(batch, 1)
    if not posteriors:
        return Decision("none", 0, baseline, baseline, reason="no proposer to choose from")
    total = sum(p.evidence for p in posteriors)
    depth = max(0, max_k)
    scored = []
    for post in posteriors:
        trimmed = replace(post, a=post.a[:depth], b=post.b[:depth])
        alphas = draw_alphas(trimmed, config, rng, total) if depth else []
        k, g, e = best_k(alphas, step_time, batch, post.wait_s, post.coverage) if alphas else (0, 0.0, 0.0)
        rank = g
        if k and post.served is not None:
            rank = served_goodput(post.served, config, rng, total)
        scored.append(_Scored(post.proposer, k, g, e, rank))
    best = max(scored, key=lambda x: x.rank)
    if current is not None and current != best.proposer:
        mine = next((x for x in scored if x.proposer == current), None)
        if mine is not None and mine.rank * (1 + config.switch_margin) >= best.rank:
            best = mine
    name, k, g = best.proposer, best.k, best.goodput
    if k and g > baseline * (1 + config.min_gain):
        return Decision(name, k, g, baseline, best.expected)
    why = (
        f"speculation does not pay at batch {batch}: best {name} k={k} {g:.3g} tok/s per row vs {baseline:.3g} plain"
        if k
        else "speculation capped at 0 tokens"
    )
    return Decision(name, 0, baseline, baseline, 0.0, why)


def candidates(requested: str, policy: SpeculationPolicy, available: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    """Proposers the router may choose for a request, and why none when empty.

    The client's own proposer beats the server policy; ``none`` disables speculation.

    >>> candidates("auto", SpeculationPolicy(), ("ngram", "draft"))
    (('ngram', 'draft'), '')
    >>> candidates("draft", SpeculationPolicy(mode="off"), ("ngram", "draft"))
    (('draft',), '')
    >>> candidates("none", SpeculationPolicy(), ("ngram",))
    ((), 'speculation disabled by the request')
    """
    requested = requested or "auto"
    choice = resolve_proposer(requested, policy, available)
    if choice.proposer == "none":
        return (), choice.reason or "speculation disabled by the request"
    if requested == "auto" and policy.mode == "auto":
        return available, ""
    return (choice.proposer,), ""


def k_cap(config: SelectionConfig, *caps: int) -> int:
    """The smallest positive cap (0 = no cap).

    >>> k_cap(SelectionConfig(max_k=16), 0, 4)
    4
    """
    return min([config.max_k, *(c for c in caps if c > 0)])


class Router:
    """The stateful front of the policy: statistics backend, runtime policy, step cost, seeded RNG.

    Thread-safe: ``decide`` runs on the gRPC loop (request start) and the engine thread (every few
    steps); ``record`` on the engine thread. Neither touches Redis (the backend's local tables).
    """

    def __init__(
        self,
        stats: StatsBackend,
        model: str,
        available: tuple[str, ...],
        policy: PolicyStore,
        step_time: StepTime,
        config: SelectionConfig | None = None,
    ) -> None:
        self.stats, self.model, self.available, self.policy = stats, model, available, policy
        self.step_time = step_time  # replace it when the cost model is re-measured
        self.config = config or SelectionConfig()
        self._rng = random.Random(self.config.seed)
        self._rng_lock = threading.Lock()

    def record(self, proposer: str, workload_tag: str, sample: AcceptanceStats) -> None:
        """Add a sample under the request's tag and under the pooled key (tag "")."""
        self.stats.record(StatsKey(self.model, proposer, workload_tag), sample)
        if workload_tag:
            self.stats.record(StatsKey(self.model, proposer, ""), sample)

    def posteriors(
        self, proposers: Sequence[str], workload_tag: str, depth: int, count_ends: bool = True, batch: int = 1
    ) -> list[Posterior]:
        keys = [StatsKey(self.model, p, t) for p in proposers for t in {workload_tag, ""}]
        snap = self.stats.snapshot(keys)
        cfg = self.config
        evidence = [
            (
                snap.get(StatsKey(self.model, p, workload_tag)),
                snap.get(StatsKey(self.model, p, "")) if workload_tag else None,
            )
            for p in proposers
        ]
        rows = ranking_rows(evidence, cfg.min_served_steps, batch)
        return [
            posterior(p, own, pooled, cfg.prior_mean, cfg.prior_strength, depth, count_ends, cfg.min_served_steps, rows)
            for p, (own, pooled) in zip(proposers, evidence, strict=True)
        ]

    def decide(
        self,
        requested: str = "auto",
        workload_tag: str = "",
        num_speculative_tokens: int = 0,
        batch: int = 1,
        current: str | None = None,
        exclude: tuple[str, ...] = (),
        estimate: RequestEstimate | None = None,
    ) -> Decision:
        """Proposer and k for a request (at its start, and again every few steps with ``current``).

        ``exclude``: proposers that cannot serve this request (e.g. rag without a corpus).
        ``estimate``: the request's own acceptance under ``current`` (a re-decision by the engine).
        The request then moves, without exploration, only to a proposer that beats ``current`` on
        the shared statistics' means and beats what the request's own estimate promises: that
        estimate follows the request's last few steps and knows nothing of the others, so alone
        against their pooled posteriors it would move a request off its proposer whenever its text
        turns hard for a while, where the others fare no better on average. What the request does
        tell apart is how often ``current`` has a tree for it: the shared figures of ``current``
        enter at the request's own share of steps with a tree (``RequestEstimate.served``), so a
        request that prompt lookup finds nothing to copy for moves to a proposer that has trees.
        A request that stays gets its k from its estimate, so the k chosen and the verifier's
        width gate read one model."""
        policy = self.policy.get()
        available = tuple(n for n in self.available if n not in exclude)
        names, why = candidates(requested, policy, available)
        baseline = 1.0 / self.step_time(max(batch, 1), 1)
        if not names:
            return Decision("none", 0, baseline, baseline, reason=why)
        cap = k_cap(self.config, num_speculative_tokens, policy.num_speculative_tokens)
        posts = self.posteriors(names, workload_tag, cap, batch=max(batch, 1))
        steps = self.step_time, max(batch, 1), cap
        if estimate is not None and current in names:
            means = replace(self.config, exploration="greedy")
            shared = [
                estimate.served(p, self.step_time(p.served.rows, 1)) if p.proposer == current and p.served else p
                for p in posts
            ]
            mine = [estimate.posterior(p, cap) if p.proposer == current else p for p in posts]
            pooled, own = choose(shared, *steps, means, None, current), choose(mine, *steps, means, None, current)
            if pooled.proposer == own.proposer != current and own.speculate:
                return own
            return choose([p for p in mine if p.proposer == current], *steps, means, None, current)
        with self._rng_lock:
            return choose(posts, *steps, self.config, self._rng, current)

    def estimate(self, proposer: str, workload_tag: str = "") -> RequestEstimate:
        """A new request's acceptance estimate under ``proposer``: the shared posterior's means
        (over every depth a tree may reach; given a node is there, as the gate reads them) as its
        prior."""
        post = self.posteriors([proposer], workload_tag, self.config.max_k, count_ends=False)[0]
        return RequestEstimate.from_posterior(post, self.config.prior_mean)
