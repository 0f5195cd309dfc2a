"""The runtime speculation policy: validation and how a request's proposer is resolved."""

import pytest

from specmesh_router.policy import PolicyLimits, PolicyStore, SpeculationPolicy, resolve_proposer


def test_fixed_policy_needs_a_configured_proposer():
    store = PolicyStore(("ngram",))
    with pytest.raises(ValueError, match="policy.proposer"):
        store.set(SpeculationPolicy(mode="fixed", proposer="draft"))
    assert store.set(SpeculationPolicy(mode="fixed", proposer="ngram")).proposer == "ngram"
    with pytest.raises(ValueError, match="policy.mode"):
        store.set(SpeculationPolicy(mode="sometimes"))


def test_policy_knobs_beyond_the_servers_limits_are_refused_naming_field_and_limit():
    store = PolicyStore(("ngram",), PolicyLimits(max_speculative_tokens=8, max_tree_nodes=16))
    for knob, limit in (("num_speculative_tokens", 8), ("max_tree_nodes", 16)):
        for bad in (limit + 1, 2**31 - 1, -1):
            with pytest.raises(ValueError, match=rf"^policy\.{knob}: must be in \[0, {limit}\].*got {bad}"):
                store.set(SpeculationPolicy(**{knob: bad}))
        assert getattr(store.set(SpeculationPolicy(**{knob: limit})), knob) == limit
    assert store.get() == SpeculationPolicy(max_tree_nodes=16)


def test_request_choice_overrides_policy_and_auto_follows_it():
    fixed = SpeculationPolicy(mode="fixed", proposer="rag")
    assert resolve_proposer("none", fixed, ("rag",)).proposer == "none"
    assert resolve_proposer("ngram", fixed, ("rag", "ngram")).proposer == "ngram"
    assert resolve_proposer("auto", fixed, ("rag",)).proposer == "rag"
    no_proposers = resolve_proposer("auto", SpeculationPolicy(), ())
    assert no_proposers.proposer == "none" and "no proposer" in no_proposers.reason
