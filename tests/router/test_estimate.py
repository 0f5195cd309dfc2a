"""One acceptance model: a request's estimate starts from the shared posterior, learns from its own
trees, and is what both the router's k and the verifier's width gate read."""

from __future__ import annotations

import random

import pytest

from specmesh_router.cost_model import StepCost, choose_width
from specmesh_router.estimate import RequestEstimate, expected_accepted, levels_sample
from specmesh_router.stats import AcceptanceStats
from tests.router.test_selection import feed, make_router
from verifier_svc.speculation import expected_by_width


def test_a_new_estimate_starts_at_the_shared_posterior_means(clock):
    router = make_router(clock, exploration="greedy")
    feed(router, clock, random.Random(3), {"ngram": 0.9, "draft": 0.3}, "code", 200)
    shared = router.posteriors(["ngram"], "code", 8)[0].means()
    est = router.estimate("ngram", "code")
    assert est.alphas(8) == pytest.approx([min(m, 0.99) for m in shared])


def test_censored_paths_never_pull_the_estimate_down():
    """Trees cut to 2 nodes and accepted to the end say nothing about depth 3: it keeps its prior,
    while depths 1-2 rise."""
    est = RequestEstimate((0.5, 0.5, 0.5))
    for _ in range(10):
        est.observe(levels_sample(0, 2, rejected=False))
    a1, a2, a3 = est.alphas(3)
    assert a1 > 0.95 and a2 > 0.95
    assert abs(a3 - 0.5) < 1e-9  # untried depth: its prior, not a miss


def test_a_skipped_trees_walk_counts_each_level_at_its_own_depth():
    """A shadow walk that matched 2 levels in one step and misses at depth 3 in the next."""
    walked = levels_sample(0, 2, False) + levels_sample(2, 0, True)
    verified = AcceptanceStats.of_step(3, 2, rejected=True)  # the same outcome in one verified tree
    assert (walked.hits, walked.trials) == (verified.hits, verified.trials) == ((1.0, 1.0), (1.0, 1.0, 1.0))


def test_a_request_whose_trees_keep_matching_gets_speculation_from_the_router_despite_poor_shared_stats(clock):
    """The shared statistics say draft tokens are rarely accepted (k = 0: off); this request's own
    trees match every time. At its re-decision the router reads the request's estimate: k > 0."""
    router = make_router(clock, exploration="greedy")
    feed(router, clock, random.Random(5), {"ngram": 0.05}, "chat", 200)
    assert router.decide("ngram", "chat").k == 0
    est = router.estimate("ngram", "chat")
    for _ in range(12):
        est.observe(levels_sample(0, 8, rejected=False))
    d = router.decide("ngram", "chat", current="ngram", estimate=est)
    assert d.k >= 4
    # The gate reads the same numbers: the k the router chose is where the request's own chain pays.
    alphas = est.alphas(d.k)
    assert expected_by_width(alphas, list(range(-1, d.k - 1)))[-1] == expected_accepted(alphas)[-1]
    assert abs(d.expected_accepted - expected_accepted(alphas)[-1]) < 1e-9
    # Another request of the same tag, without its own evidence, still gets plain decoding.
    assert router.decide("ngram", "chat").k == 0


def test_the_proposers_path_probabilities_let_the_gate_cut_the_siblings_it_rates_low():
    """A chain rated certain is the chain model exactly; a bushy tree's low-rated siblings add
    little expected acceptance, so on this CPU's cost curve the gate keeps the strong chain only."""
    alphas = [0.8, 0.7, 0.6, 0.6]
    chain = list(range(-1, 5))
    assert expected_by_width(alphas, chain, [1.0] * 6) == pytest.approx(expected_by_width(alphas, chain))
    # A 6-node chain the proposer rates 0.9 per level, then 26 one-off siblings under its first five nodes.
    parents = chain + [i % 5 for i in range(26)]  # none deeper than the chain
    probs = [0.9 ** (d + 1) for d in range(6)] + [0.02] * 26
    with_probs = expected_by_width(alphas, parents, probs)
    assert with_probs[-1] - with_probs[7] < 0.3  # the 26 siblings together add < 0.3 tokens
    dear = StepCost.by_tokens((1, 8, 16, 33), (0.044, 0.072, 0.078, 0.120))  # measured here, ms → s
    assert 1 < choose_width([with_probs], dear) <= 8
    # Without the probabilities, the chain model's value is the same for every width ≥ 7:
    assert expected_by_width(alphas, parents)[7:] == [expected_by_width(alphas, parents)[7]] * 26
