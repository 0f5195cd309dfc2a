"""Which proposer, and how many draft tokens per step: the router's policy core.

For proposer p verifying k draft tokens per step in a batch of B rows:

    goodput(p, k) = (1 + E_p(k)) / (c_p · step_time(B, 1 + k) + (1 - c_p) · step_time(B, 1) + wait_p)
    E_p(k)        = Σ_{d=1..k} Π_{j=1..d} α_{p,j}

α_{p,j}: probability that p's draft token at depth j is accepted given its parent was (a Beta
posterior per depth from the decayed statistics, plus an optimism bonus that shrinks with
evidence), where the end of p's own tree counts as a miss; c_p: the share of steps p had a tree
for; wait_p: the verifier's mean wait for p's draft per step; the 1 is the bonus token. k = 0
(plain decoding) is always a candidate, so speculation switches itself off where verification is
dear or acceptance poor.

Which proposer: ranked by the goodput above until each candidate has served ``min_served_steps``
(decayed) steps at one batch size (``ranking_rows``), then by what it measurably delivered there,
with the same kind of optimism bonus: served(p) = Σ tokens / Σ seconds over its requests' steps.
The α chain misprices trees sized by their own probabilities (suffix), the measured figure does not
(``docs/bench/router-ablation``: ranking by the model alone loses 2–8 %). The optimism (UCB) is
what gets an unmeasured proposer tried: without it a router that starts cold stays on the first
proposer the α chain favours (0.80x of suffix on the replay).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specmesh_router.cost_model import CostFn
from specmesh_router.estimate import Posterior, RequestEstimate, Served, expected_accepted, posterior, ranking_rows
from specmesh_router.policy import PolicyStore, SpeculationPolicy, resolve_proposer
from specmesh_router.stats import AcceptanceStats, StatsBackend, StatsKey

StepTime = CostFn  # (batch rows, tokens per row) → seconds of one verification forward


@dataclass(frozen=True)
class SelectionConfig:
    ucb_c: float = 0.5  # optimism: c · √(log N / evidence) on α's and on served tokens
    prior_mean: float = 0.5  # α prior at depth 1 where nothing is known
    prior_strength: float = 2.0  # pseudo-trials behind a prior
    max_k: int = 32  # draft tokens per step, at most
    min_served_steps: float = 64.0  # decayed steps of a proposer before its measured goodput ranks it
    served_by_batch: bool = True  # rank by the figures measured at this batch size (off: pooled over all sizes)


@dataclass(frozen=True)
class Decision:
    proposer: str  # whose stream the request should have ("none": no stream)
    k: int  # draft tokens to verify per step now; 0 = plain decoding (the stream may stay for statistics)
    goodput: float  # expected tokens/s per row of this choice
    reason: str = ""  # why k == 0, or why no proposer

    @property
    def speculate(self) -> bool:
        return self.k > 0 and self.proposer != "none"


def optimistic_alphas(post: Posterior, c: float, total_evidence: float) -> list[float]:
    """One α per depth: the posterior mean plus c · √(log(1 + N) / trials behind it).

    >>> post = Posterior("ngram", (9.0, 3.0), (3.0, 1.0))
    >>> optimistic_alphas(post, 0.0, 0.0)
    [0.75, 0.75]
    >>> [round(a, 3) for a in optimistic_alphas(post, 0.5, 100.0)]
    [0.999, 0.999]
    """
    log_n = math.log(1.0 + total_evidence)
    return [
        min(m + c * math.sqrt(log_n / (a + b)), 0.999) for m, a, b in zip(post.means(), post.a, post.b, strict=True)
    ]


def best_k(
    alphas: Sequence[float], step_time: StepTime, batch: int, wait_s: float, coverage: float = 1.0
) -> tuple[int, float]:
    """(k ≥ 1, its goodput) maximising (1 + E(k)) / (cost of the step + wait_s), a step with a tree
    (share ``coverage``) costing step_time(batch, 1 + k), one without step_time(batch, 1).

    >>> from specmesh_router.cost_model import StepCost
    >>> cpu = StepCost.by_tokens((1, 2, 4, 8, 16), (0.066, 0.119, 0.125, 0.139, 0.158))
    >>> k, g = best_k([0.9] * 16, cpu, batch=1, wait_s=0.0)
    >>> k, round(g, 1)
    (16, 52.0)
    """
    e = expected_accepted(alphas)
    plain = (1 - coverage) * step_time(batch, 1)
    best = (1, 0.0)
    for k in range(1, len(alphas) + 1):
        g = (1 + e[k]) / (coverage * step_time(batch, 1 + k) + plain + wait_s)
        if g > best[1]:
            best = (k, g)
    return best


def served_goodput(served: Served, c: float, total_evidence: float) -> float:
    """Tokens/s per row a proposer measurably delivered, its tokens per step raised by
    c · √(log N / steps).

    >>> round(served_goodput(Served(3.0, 3.0, 0.07, 500.0), 0.0, 0.0), 1)
    42.9
    """
    tokens = served.tokens * (1.0 + c * math.sqrt(math.log(1.0 + total_evidence) / served.steps))
    return tokens / served.seconds if served.seconds > 0 else 0.0


def choose(
    posteriors: Sequence[Posterior], step_time: StepTime, batch: int, max_k: int, config: SelectionConfig
) -> Decision:
    """The (proposer, k) with the highest goodput; k = 0 unless speculation beats plain decoding.

    Proposers with ``served`` measurements are ranked by them (``served_goodput``); k, and whether
    speculation pays at all, come from the α model of the proposer ranked first.

    >>> cfg = SelectionConfig(ucb_c=0.0)
    >>> from specmesh_router.cost_model import StepCost
    >>> cpu = StepCost.by_tokens((1, 2, 4, 8, 16, 32, 64, 128), (1.0, 1.8, 1.9, 2.1, 2.4, 3.4, 6.0, 11.5))
    >>> copy = Posterior("ngram", (9.0,) * 8, (1.0,) * 8)    # α = 0.9 per depth
    >>> chat = Posterior("draft", (3.0,) * 8, (7.0,) * 8)    # α = 0.3
    >>> d = choose([chat, copy], cpu, batch=1, max_k=8, config=cfg)
    >>> d.proposer, d.k, round(d.goodput, 2)
    ('ngram', 8, 2.87)
    >>> choose([chat, copy], cpu, batch=64, max_k=8, config=cfg).k    # verification too dear at batch 64
    0
    >>> choose([chat], cpu, batch=1, max_k=8, config=cfg).k    # poor acceptance: not worth 1.8x per step
    0
    """
    baseline = 1.0 / step_time(batch, 1)
    if not posteriors:
        return Decision("none", 0, baseline, "no proposer to choose from")
    total = sum(p.evidence for p in posteriors)
    depth = max(0, max_k)
    scored = []  # (rank, proposer, k, goodput by the α model)
    for post in posteriors:
        trimmed = replace(post, a=post.a[:depth], b=post.b[:depth])
        alphas = optimistic_alphas(trimmed, config.ucb_c, total) if depth else []
        k, g = best_k(alphas, step_time, batch, post.wait_s, post.coverage) if alphas else (0, 0.0)
        rank = served_goodput(post.served, config.ucb_c, total) if k and post.served is not None else g
        scored.append((rank, post.proposer, k, g))
    _, name, k, g = max(scored, key=lambda x: x[0])
    if k and g > baseline:
        return Decision(name, k, g)
    why = f"speculation does not pay at batch {batch}: best {name} k={k} {g:.3g} tok/s per row vs {baseline:.3g} plain"
    return Decision(name, 0, baseline, why if k else "speculation capped at 0 tokens")


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


class Router:
    """The stateful front of the policy: statistics backend, runtime policy, step cost.

    Thread-safe: ``decide`` runs on the gRPC loop (once per request, at its start); ``record`` on the
    engine thread. Neither touches Redis (the backend's local tables).
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
        rows = ranking_rows(evidence, cfg.min_served_steps, batch) if cfg.served_by_batch else None
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
        exclude: tuple[str, ...] = (),
    ) -> Decision:
        """Proposer and k for a request, at its start (a request keeps them: re-deciding mid-request
        measurably paid nothing, ``docs/bench/router-ablation``). ``exclude``: proposers that cannot
        serve it (e.g. rag without a corpus)."""
        policy = self.policy.get()
        available = tuple(n for n in self.available if n not in exclude)
        names, why = candidates(requested, policy, available)
        if not names:
            return Decision("none", 0, 1.0 / self.step_time(max(batch, 1), 1), why)
        caps = (num_speculative_tokens, policy.num_speculative_tokens)
        cap = min([self.config.max_k, *(c for c in caps if c > 0)])
        posts = self.posteriors(names, workload_tag, cap, batch=max(batch, 1))
        return choose(posts, self.step_time, max(batch, 1), cap, self.config)

    def estimate(self, proposer: str, workload_tag: str = "") -> RequestEstimate:
        """A new request's acceptance estimate under ``proposer``: the shared posterior's means
        (over every depth a tree may reach; given a node is there, as the gate reads them) as its
        prior."""
        post = self.posteriors([proposer], workload_tag, self.config.max_k, count_ends=False)[0]
        return RequestEstimate.from_posterior(post, self.config.prior_mean)
