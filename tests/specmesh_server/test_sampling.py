"""Sampling on tiny arrays: determinism, batch invariance, filters, and exact distributions."""

import math

import torch

from specmesh_server.sampling import filter_logits, sample_from_probs, sample_next, uniform


def test_uniform_is_deterministic_and_independent_of_batch_composition():
    seeds = torch.tensor([1, 2, 3, 2**62 + 5])
    counters = torch.tensor([10, 10, 11, 12])
    alone = torch.stack([uniform(seeds[i : i + 1], counters[i : i + 1])[0] for i in range(4)])
    assert torch.equal(uniform(seeds, counters), alone)
    assert torch.equal(uniform(seeds, counters), uniform(seeds, counters))
    assert not torch.equal(uniform(seeds, counters, salt=1), uniform(seeds, counters))


def test_uniform_looks_uniform():
    n = 20000
    u = uniform(torch.full((n,), 12345), torch.arange(n))
    assert float(u.min()) > 0 and float(u.max()) < 1
    hist = torch.histc(u.float(), bins=10, min=0, max=1)
    chi2 = float(((hist - n / 10) ** 2 / (n / 10)).sum())
    assert chi2 < 27.9  # 9 dof, p = 0.001


def test_top_k_keeps_k_best_and_top_p_keeps_smallest_prefix_reaching_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = torch.ones(1)
    k2 = filter_logits(logits, one, one, torch.tensor([2]))
    assert torch.isinf(k2[0, 2:]).all() and torch.isfinite(k2[0, :2]).all()
    p = filter_logits(logits, one, torch.tensor([0.75]), torch.tensor([0]))
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()  # 0.5 < 0.75 <= 0.8
    tiny = filter_logits(logits, one, torch.tensor([0.01]), torch.tensor([0]))
    assert torch.isfinite(tiny[0, 0]) and torch.isinf(tiny[0, 1:]).all()  # always keeps the argmax


def test_temperature_zero_rows_are_argmax_and_others_sample():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    out = sample_next(
        logits,
        temperature=torch.tensor([0.0, 1.0]),
        top_p=torch.ones(2),
        top_k=torch.zeros(2, dtype=torch.long),
        seeds=torch.tensor([0, 1]),
        positions=torch.tensor([0, 0]),
    )
    assert out[0] == 1 and 0 <= out[1] < 3


def test_sampled_tokens_follow_the_filtered_distribution_chi_square():
    torch.manual_seed(0)
    vocab, n = 6, 30000
    logits = torch.randn(vocab)
    temperature, top_k = 0.7, 4
    want = torch.softmax(
        filter_logits(logits[None], torch.tensor([temperature]), torch.ones(1), torch.tensor([top_k]))[0], -1
    )
    tokens = sample_next(
        logits.expand(n, vocab),
        temperature=torch.full((n,), temperature),
        top_p=torch.ones(n),
        top_k=torch.full((n,), top_k),
        seeds=torch.full((n,), 99),
        positions=torch.arange(n),
    )
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[want == 0].sum() == 0  # filtered tokens never appear
    keep = want > 0
    expected = want[keep].double() * n
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # 3 dof, p = 0.001


def test_sample_from_probs_inverse_cdf_edges():
    probs = torch.tensor([[0.25, 0.25, 0.5], [0.0, 1.0, 0.0]])
    assert sample_from_probs(probs, torch.tensor([0.2, 0.999])).tolist() == [0, 1]
    assert sample_from_probs(probs, torch.tensor([0.6, 1e-9])).tolist() == [2, 1]
    assert not math.isnan(float(sample_from_probs(probs, torch.tensor([1 - 1e-12, 0.5]))[0]))


def test_tiny_temperature_is_greedy_not_an_overflow_to_the_last_token():
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.25]])
    ones, zeros = torch.ones(2), torch.zeros(2, dtype=torch.long)
    for t in (1e-45, 1e-38, 1e-6):  # 1e-45: logits / t is inf, softmax NaN
        tokens = sample_next(logits, torch.full((2,), t), ones, zeros, torch.tensor([1, 2]), torch.tensor([0, 0]))
        assert tokens.tolist() == [1, 0]
        assert not torch.isnan(torch.softmax(filter_logits(logits, torch.full((2,), t), ones, zeros), -1)).any()


def test_sampling_with_nan_and_inf_logits_stays_in_the_vocabulary_and_never_nan():
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan, 1.0, 2.0, nan], [0.0, inf, 1.0, inf], [nan, nan, nan, nan]])
    one, k0 = torch.ones(3), torch.zeros(3, dtype=torch.long)
    for top_p, top_k in ((one, k0), (torch.full((3,), 0.5), torch.full((3,), 2))):
        probs = torch.softmax(filter_logits(logits, one, top_p, top_k), -1)
        assert not torch.isnan(probs[:2]).any()
        assert probs[0, 0] == probs[0, 3] == 0  # a NaN logit is never drawn
        assert probs[1, 1] + probs[1, 3] == 1  # +inf logits share the mass
    for seed in range(20):
        tokens = sample_next(logits, one, one, k0, torch.full((3,), seed), torch.arange(3)).tolist()
        assert tokens[0] in (1, 2) and tokens[1] in (1, 3) and 0 <= tokens[2] < 4
    nan_probs = torch.tensor([[nan, nan, nan], [0.0, 0.0, 0.0], [nan, 0.3, inf]])
    assert sample_from_probs(nan_probs, torch.full((3,), 0.99, dtype=torch.float64)).tolist() == [0, 0, 1]
