"""Tree acceptance on tiny arrays: greedy picks the target's path; speculative sampling emits
tokens distributed exactly as the target (convergence in N, versus unrelated distributions)."""

import random

import pytest
import torch

from specmesh_server.tree import TokenTree
from verifier_svc.acceptance import acceptance_uniforms, greedy_accept, sample_accept, walk_shape

VOCAB = 10


def test_greedy_follows_the_deepest_matching_path_and_emits_the_bonus():
    #        root
    #       /    \
    #     3(0)   4(1)
    #     |       |  \
    #    5(2)   6(3) 7(4)
    tree = TokenTree(tokens=[3, 4, 5, 6, 7], parents=[-1, -1, 0, 1, 1])
    assert greedy_accept(tree, argmax=[4, 0, 7, 0, 0, 8]) == ([1, 4], 8)
    assert greedy_accept(tree, argmax=[3, 5, 0, 2, 0, 0]) == ([0, 2], 2)
    assert greedy_accept(tree, argmax=[1, 0, 0, 0, 0, 0]) == ([], 1)
    assert greedy_accept(TokenTree([], []), argmax=[6]) == ([], 6)


def _rand_dist(gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    d = torch.rand(VOCAB, generator=gen, dtype=torch.float64) ** 2
    if zeros:
        d[torch.randperm(VOCAB, generator=gen)[:zeros]] = 0
    return d / d.sum()


def _shape(kind: str) -> list[int]:
    if kind == "chain":
        return [-1, 0, 1]
    return [-1, -1, -1, 0, 0, 1, 2, 2, 2]  # 3 root children, 1-3 children below


def _first_token_tv(kind: str, proposal: str, n: int, seed: int = 0) -> tuple[float, torch.Tensor]:
    """Total-variation distance between the first emitted token's empirical distribution and p."""
    gen = torch.Generator().manual_seed(seed)
    parents = _shape(kind)
    probs = torch.stack([_rand_dist(gen) for _ in range(len(parents) + 1)])  # [n+1, V] target rows
    if proposal == "q==p":
        q_rows = [probs[p + 1] for p in parents]
    elif proposal == "q-with-zeros":
        q_rows = [_rand_dist(gen, zeros=4) for _ in parents]
        probs[0] = _rand_dist(gen, zeros=0)
    else:
        q_rows = [_rand_dist(gen) for _ in parents]
    rng = random.Random(seed)
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    fixed_tokens = [rng.randrange(VOCAB) for _ in parents]
    dists = [(list(range(VOCAB)), q.tolist()) for q in q_rows]
    us = acceptance_uniforms(
        torch.arange(n), torch.full((n,), 7), *walk_shape(TokenTree(fixed_tokens, parents))
    ).numpy()
    for i in range(n):
        if proposal == "deterministic":
            tree = TokenTree(fixed_tokens, parents)
        else:  # every node drawn from its own q, independently, as a stochastic proposer must
            tokens = [rng.choices(range(VOCAB), weights=d[1])[0] for d in dists]
            tree = TokenTree(tokens, parents, dists)
        path, bonus = sample_accept(tree, probs, us[i])
        counts[tree.tokens[path[0]] if path else bonus] += 1
    return 0.5 * float((counts / n - probs[0]).abs().sum()), probs[0]


@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("proposal", ["deterministic", "random-q", "q==p", "q-with-zeros"])
def test_first_emitted_token_converges_to_the_target(kind, proposal):
    tv_small, _ = _first_token_tv(kind, proposal, 500, seed=1)
    tv, p = _first_token_tv(kind, proposal, 20_000, seed=1)
    gen = torch.Generator().manual_seed(99)
    unrelated = min(0.5 * float((_rand_dist(gen) - p).abs().sum()) for _ in range(20))
    # Sampling noise of the TV distance is about sqrt(V / N) / 2: 0.011 at N = 20k.
    assert tv < 0.03, f"TV {tv:.4f} to the target"
    assert tv < unrelated / 4
    assert tv < tv_small


@pytest.mark.slow
def test_convergence_at_one_hundred_thousand_samples_shrinks_like_one_over_sqrt_n():
    tvs = [_first_token_tv("tree", "random-q", n, seed=5)[0] for n in (1_000, 10_000, 100_000)]
    assert tvs[2] < 0.012 and tvs[2] < tvs[1] < tvs[0]
    assert tvs[0] / tvs[2] > 4  # sqrt(100) = 10 in expectation


def test_sample_accept_is_deterministic_in_the_seed():
    gen = torch.Generator().manual_seed(0)
    probs = torch.stack([_rand_dist(gen) for _ in range(4)])
    tree = TokenTree([1, 2, 3], [-1, 0, 0])
    u = acceptance_uniforms(torch.tensor([5, 5]), torch.tensor([3, 3]), *walk_shape(tree)).numpy()
    assert (u[0] == u[1]).all() and sample_accept(tree, probs, u[0]) == sample_accept(tree, probs, u[1])
