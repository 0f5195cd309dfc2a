"""One acceptance model: a request's estimate starts from the shared posterior, learns from its own
trees, and is what the verifier's width gate reads."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from specmesh_router.cost_model import LiveStepCost, StepCost, choose_width
from specmesh_router.estimate import RequestEstimate, levels_sample, posterior
from specmesh_router.stats import AcceptanceStats, StatsKey
from specmesh_server.tree import TokenTree
from tests.router.test_selection import MODEL, feed, make_router
from verifier_svc.proposer_client import ProposerLimits
from verifier_svc.request_speculation import RequestSpeculation, expected_by_width
from verifier_svc.speculation import SpeculationConfig, SpeculationControl


def test_a_new_estimate_starts_at_the_shared_posterior_means(clock):
    router = make_router(clock, ucb_c=0.0)
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


def test_where_the_proposers_trees_end_is_a_miss_for_the_router_and_censored_for_the_gate():
    """Trees the proposer itself ended at depth 2, accepted to the end: the gate (pricing a tree
    that is there) keeps depth 3 at its prior; the router's posterior learns there is no depth 3."""
    est = RequestEstimate((0.5, 0.5, 0.5))
    for _ in range(10):
        est.observe(levels_sample(0, 2, rejected=False, ended=True))
    assert abs(est.alphas(3)[2] - 0.5) < 1e-9
    shared = sum((levels_sample(0, 2, rejected=False, ended=True) for _ in range(10)), AcceptanceStats())
    routed = posterior("draft", shared, None, 0.5, 2.0, depth=3).means()
    assert routed[0] > 0.9 and routed[1] > 0.9 and routed[2] < 0.2
    walked = levels_sample(0, 1, False) + levels_sample(1, 1, False, ended=True)  # a skipped tree's walk
    assert (
        walked
        == levels_sample(0, 2, False, ended=True)
        == replace(AcceptanceStats.of_step(2, 2, rejected=False, ended=True), steps=0.0, drafted=0.0, accepted=0.0)
    )


def test_a_skipped_trees_walk_counts_each_level_at_its_own_depth():
    """A shadow walk that matched 2 levels in one step and misses at depth 3 in the next."""
    walked = levels_sample(0, 2, False) + levels_sample(2, 0, True)
    verified = AcceptanceStats.of_step(3, 2, rejected=True)  # the same outcome in one verified tree
    assert (walked.hits, walked.trials) == (verified.hits, verified.trials) == ((1.0, 1.0), (1.0, 1.0, 1.0))


def test_the_proposers_path_probabilities_let_the_gate_cut_the_siblings_it_rates_low():
    """Path probabilities are taken as the chance each node is accepted: a chain rated certain is
    worth one token a node whatever the request's α's, and low-rated siblings add so little that
    on this CPU's cost curve the gate keeps the strong chain only."""
    alphas = [0.8, 0.7, 0.6, 0.6]
    chain = list(range(-1, 5))
    assert expected_by_width(alphas, chain, [1.0] * 6) == pytest.approx([0.0, 1, 2, 3, 4, 5, 6])
    # A 6-node chain the proposer rates 0.9 per level, then 26 one-off siblings under its first five nodes.
    parents = chain + [i % 5 for i in range(26)]  # none deeper than the chain
    probs = [0.9 ** (d + 1) for d in range(6)] + [0.02] * 26
    with_probs = expected_by_width(alphas, parents, probs)
    assert with_probs[-1] - with_probs[7] < 0.6  # the 26 siblings together add ≈ 0.5 tokens
    dear = StepCost.by_tokens((1, 8, 16, 33), (0.044, 0.072, 0.078, 0.120))  # measured here, ms → s
    assert 1 < choose_width([with_probs], dear) <= 8
    # Without the probabilities, the chain model's value is the same for every width ≥ 7:
    assert expected_by_width(alphas, parents)[7:] == [expected_by_width(alphas, parents)[7]] * 26


def test_a_proposer_that_claims_certainty_and_misses_loses_the_gate_within_two_trees():
    """Trust scales the probabilities by how they held for this request: a proposer rating every node
    of a 16-node chain certain, with nothing accepted, is cut after two trees to the few nodes this
    CPU verifies at a plain step's cost, while an honest one (as many tokens as it said) keeps its
    probabilities at face value."""
    cpu = StepCost.by_tokens((1, 2, 4, 8, 16, 32), (1.0, 1.0, 1.0, 1.1, 1.4, 1.7))
    chain, certain = list(range(-1, 15)), [1.0] * 16
    liar = RequestSpeculation()
    assert choose_width([liar.expected(TokenTree(list(range(16)), chain, probs=certain))], cpu) == 17
    for _ in range(2):
        liar.observe(0, rejected=True, ended=False, tree=TokenTree(list(range(16)), chain, probs=certain))
    assert liar.trust.value < 0.05
    assert choose_width([liar.expected(TokenTree(list(range(16)), chain, probs=certain))], cpu) <= 4
    honest, halving = RequestSpeculation(), [0.5 ** (d + 1) for d in range(16)]
    for _ in range(10):
        honest.observe(1, rejected=True, ended=False, tree=TokenTree(list(range(16)), chain, probs=halving))
    assert honest.trust.value == pytest.approx(1.0, abs=0.05)
    assert choose_width([honest.expected(TokenTree(list(range(16)), chain, probs=halving))], cpu) > 1


class ScriptedSession:
    """A proposer stream whose next tree the test sets (``verifier_svc.request_speculation.ProposerSession``)."""

    name, failed, invalid_trees, last_response, hidden_dtype = "draft", None, 0, 0.0, None

    def __init__(self, limits: ProposerLimits) -> None:
        self.limits = limits
        self.next: TokenTree | None = None
        self.sent: TokenTree | None = None

    def take(self, context_length: int, recent: list[int] | None = None) -> TokenTree | None:
        self.sent, self.next = self.next, None
        return self.sent

    def has_tree_for(self, context_length: int) -> bool:
        return self.next is not None

    def advance(self, tokens, hidden=None) -> None: ...

    def fail(self, reason: str) -> None: ...

    def close(self) -> None: ...


def test_the_verifier_records_where_the_proposer_ended_its_tree_not_where_the_budget_or_k_cut_it(clock):
    router = make_router(clock)
    control = SpeculationControl(SpeculationConfig(), router)
    session = ScriptedSession(ProposerLimits(vocab_size=100, max_nodes=4, max_depth=3))
    req = SimpleNamespace(temperature=0.0, spec_params=SimpleNamespace(workload_tag="chat"))
    seq = SimpleNamespace(
        speculation=RequestSpeculation.start(session), context_length=10, length=10, output=[], req=req
    )

    def step(tree: TokenTree, accepted: list[int], k_cap: int | None = None) -> None:
        seq.speculation.k_cap, session.next = k_cap, tree
        trees = control.collect_trees([seq], max_context=1000)
        control.after_step([seq], trees, [(accepted, 0)], 0.06)

    step(TokenTree([5, 6], [-1, 0]), [0, 1])  # its own 2-level chain, accepted to the end: an end at 2
    step(TokenTree([5, 6, 7], [-1, 0, 1]), [0, 1, 2])  # as deep as the budget: censored
    step(TokenTree([], []), [])  # nothing to propose: an end at 0
    step(TokenTree([5, 6], [-1, 0]), [0], k_cap=1)  # cut to 1 node by the router's k: censored
    step(TokenTree([5, 6], [-1, 0]), [0])  # missed at depth 2: a miss, not an end
    got = router.stats.snapshot()[StatsKey(MODEL, "draft", "chat")]
    assert got.ends == (1.0, 0.0, 1.0)
    assert (got.hits, got.trials) == ((4.0, 2.0, 1.0), (4.0, 3.0, 1.0))
    assert got.steps == 4.0  # the empty step carried no draft


def test_trees_with_path_probabilities_escape_the_routers_k_and_a_tree_the_gate_skips_is_no_tree_to_the_router(clock):
    """The router's k (a chain's depth) cuts a tree without probabilities; one with them is sized
    by the gate alone. A probability tree the gate cuts to nothing is, to the router's statistics
    and the request's estimate, a step without a tree worth verifying (its coverage), not a miss
    at depth 1; its walk along the emitted tokens feeds the request's Trust only."""
    router = make_router(clock)
    flat = LiveStepCost(StepCost.by_tokens((1, 2, 4, 8, 16), (1.0, 1.0, 1.0, 1.0, 1.0)))  # any width is free
    control = SpeculationControl(SpeculationConfig(), router, flat)
    session = ScriptedSession(ProposerLimits(vocab_size=100, max_nodes=8, max_depth=8))
    req = SimpleNamespace(temperature=0.0, spec_params=SimpleNamespace(workload_tag="chat"))
    seq = SimpleNamespace(
        speculation=RequestSpeculation.start(session, k_cap=2), context_length=10, length=10, output=[], req=req
    )

    def take(tree: TokenTree) -> TokenTree:
        session.next = tree
        return control.collect_trees([seq], max_context=1000)[0]

    assert len(take(TokenTree([5, 6, 7, 8], [-1, 0, 1, 2]))) == 2  # the router's k = 2
    assert len(take(TokenTree([5, 6, 7, 8], [-1, 0, 1, 2], probs=[0.9, 0.8, 0.7, 0.6]))) == 4

    dear = LiveStepCost(StepCost.by_tokens((1, 2, 4, 8, 16), (1.0, 3.0, 5.0, 9.0, 17.0)))  # a node costs a step
    control.step_cost = dear
    guess = TokenTree([5, 6], [-1, 0], probs=[0.05, 0.01])
    verified = take(guess)
    assert not len(verified) and seq.speculation.gated_out
    control.after_step([seq], [verified], [([], 5)], 0.06)  # the guess was right (5): only Trust hears it
    session.next = None  # the next step has no tree (the proposer is late): the walk goes on
    control.after_step([seq], control.collect_trees([seq], max_context=1000), [([], 6)], 0.06)
    stats = router.stats.snapshot()[StatsKey(MODEL, "draft", "chat")]
    assert stats.trials == () and stats.ends == (1.0,)  # one step without a tree, no miss, no hit
    assert seq.speculation.estimate.seen.ends == (1.0,) and seq.speculation.estimate.seen.trials == ()
    assert seq.speculation.shadow is None and seq.speculation.trust.accepted == 2.0  # the walk matched 5 then 6
