"""Batched tree acceptance on the device: greedy is identical to the host walk, sampling equals the host
walk draw for draw (same counter-based uniforms) and its first emitted token converges to the target."""

from __future__ import annotations

import random

import pytest
import torch
from support import first_token_tv

from specmesh_kernels.tree_accept import PackedTrees, tree_accept_kernel_launch, unpack_result
from specmesh_server.sampling import filter_logits
from specmesh_server.tree import TokenTree
from verifier_svc.acceptance import acceptance_uniforms, greedy_accept, sample_accept, walk_shape
from verifier_svc.batch_accept import accept_on_device
from verifier_svc.requests import GenerationRequest, SpecParams

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: 100k walks take hours in Triton's CPU interpreter"
)


def random_batch(seed: int, n_req: int, max_nodes: int, vocab: int, stochastic: bool):
    """Trees whose tokens often agree with a peaked target, so walks go deep, and their target rows."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    trees, rows = [], []
    for _ in range(n_req):
        n = rng.randint(0, max_nodes)
        parents = [rng.randrange(-1, i) for i in range(n)]
        logits = torch.randn(n + 1, vocab, generator=gen) * 2  # [n+1, vocab]
        dists = None
        if stochastic:
            dists = []
            for _ in range(n):
                ids = rng.sample(range(vocab), min(vocab, rng.randint(1, 6)))
                w = [rng.random() + 0.05 for _ in ids]
                dists.append((ids, [x / sum(w) for x in w]))
            tokens = [rng.choices(ids, weights=w)[0] for ids, w in dists]
        else:
            tokens = [rng.randrange(vocab) for _ in range(n)]
        for tok, par in zip(tokens, parents, strict=True):
            if rng.random() < 0.7:  # the target likes this node: its token gets the parent row's top logit
                logits[par + 1, tok] = logits[par + 1].max() + rng.random() * 3
        trees.append(TokenTree(tokens, parents, dists))
        rows.append(logits)
    return trees, torch.cat(rows)


def host_walks(trees, probs, greedy, seeds, positions) -> list[tuple[list[int], int]]:
    """verifier_svc.acceptance, request by request, as the engine calls it."""
    out, row = [], 0
    for b, tree in enumerate(trees):
        p = probs[row : row + len(tree) + 1]
        row += len(tree) + 1
        if greedy[b]:
            out.append(greedy_accept(tree, p.argmax(dim=-1).tolist()))
        else:
            u = acceptance_uniforms(seeds[b : b + 1], positions[b : b + 1], *walk_shape(tree))[0]
            out.append(sample_accept(tree, p, u))
    return out


def pack(trees: list[TokenTree]) -> PackedTrees:
    return PackedTrees.from_lists([t.tokens for t in trees], [t.parents for t in trees], [t.dists for t in trees])


def table(seeds: torch.Tensor, positions: torch.Tensor, trees: list[TokenTree]) -> torch.Tensor:
    """The launcher's uniforms: the host walk's, for the batch's largest tree."""
    n = max(len(t) for t in trees) + 1
    return acceptance_uniforms(seeds, positions, n, n)


@pytest.mark.parametrize("n_req,max_nodes", [(1, 0), (5, 63), (64, 8)])
@pytest.mark.usefixtures("cpu_kernels")
def test_greedy_kernel_is_identical_to_host_greedy_accept(n_req, max_nodes):
    trees, logits = random_batch(n_req + max_nodes, n_req, max_nodes, vocab=40, stochastic=False)
    greedy = torch.ones(n_req, dtype=torch.bool)
    seeds, positions = torch.arange(n_req), torch.full((n_req,), 5)
    probs = torch.softmax(logits, dim=-1)
    out = tree_accept_kernel_launch(probs, logits.argmax(dim=-1), pack(trees), greedy, table(seeds, positions, trees))
    got = unpack_result(out)
    assert got == host_walks(trees, probs, greedy, seeds, positions)
    assert max(len(path) for path, _ in got) >= min(2, max_nodes)  # walks do go down the trees


@pytest.mark.parametrize("stochastic", [False, True], ids=["deterministic-draft", "sparse-q-draft"])
@pytest.mark.usefixtures("cpu_kernels")
def test_sampled_kernel_matches_host_walk_draw_for_draw(stochastic):
    n_req = 24
    trees, logits = random_batch(40 + stochastic, n_req, 12, vocab=30, stochastic=stochastic)
    greedy = torch.tensor([b % 4 == 0 for b in range(n_req)])  # greedy and sampled requests side by side
    seeds = torch.tensor([random.Random(b).getrandbits(63) for b in range(n_req)])
    positions = torch.arange(n_req) * 3 + 11
    probs = torch.softmax(logits, dim=-1)
    out = tree_accept_kernel_launch(probs, logits.argmax(dim=-1), pack(trees), greedy, table(seeds, positions, trees))
    want = host_walks(trees, probs, greedy, seeds, positions)
    assert unpack_result(out) == want
    assert sum(len(p) for p, _ in want) > n_req // 2  # some sampled walks accept nodes


@pytest.mark.usefixtures("cpu_kernels")
def test_the_engine_device_path_applies_temperature_top_k_top_p_as_the_host_walk():
    n_req = 6
    trees, logits = random_batch(9, n_req, 6, vocab=25, stochastic=False)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9, 0.0])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.8, 1.0, 1.0])
    top_k = torch.tensor([0, 0, 5, 3, 0, 0])
    seeds, positions = torch.arange(n_req) + 100, torch.arange(n_req) + 40
    plain = SpecParams("none", 0, 0, "", "")
    reqs = [
        GenerationRequest(str(b), [], float(t), float(p), int(k), int(s), 8, (), False, plain)
        for b, (t, p, k, s) in enumerate(zip(temperature, top_p, top_k, seeds, strict=True))
    ]
    got = accept_on_device(reqs, positions.tolist(), trees, logits)
    counts = torch.tensor([len(t) + 1 for t in trees])
    rep = lambda t: torch.repeat_interleave(t, counts)  # noqa: E731
    shaped = filter_logits(logits, rep(torch.where(temperature > 0, temperature, 1.0)), rep(top_p), rep(top_k))
    probs = torch.softmax(shaped, dim=-1)  # as Engine._accept shapes the sampled rows
    assert got == host_walks(trees, probs, temperature == 0, seeds, positions)


@pytest.mark.parametrize("rows", ["greedy", "sampled", "mixed"])
@pytest.mark.usefixtures("cpu_kernels")
def test_accept_batch_through_the_kernel_equals_the_host_walk(rows, monkeypatch):
    """``--device-accept on`` vs ``off`` (``EngineConfig.device_accept``): the same (path, bonus) for every
    request of a batch, greedy and sampled (temperature, top-p, top-k) alike; ``auto`` on CPU logits walks
    on the host."""
    import verifier_svc.batch_accept as batch_accept

    n_req = 8
    trees, logits = random_batch(60 + len(rows), n_req, 10, vocab=30, stochastic=rows != "greedy")
    temperature = {"greedy": [0.0] * n_req, "sampled": [0.7, 1.0, 1.3, 0.9] * 2}
    temperature["mixed"] = [0.0, 0.8, 0.0, 1.0, 1.2, 0.0, 0.6, 1.0]
    top_p, top_k = [1.0, 0.9, 1.0, 0.8] * 2, [0, 0, 5, 3] * 2
    plain = SpecParams("none", 0, 0, "", "")
    reqs = [
        GenerationRequest(str(b), [], t, p, k, random.Random(b).getrandbits(63), 8, (), False, plain)
        for b, (t, p, k) in enumerate(zip(temperature[rows], top_p, top_k, strict=True))
    ]
    context = [11 + 3 * b for b in range(n_req)]
    counts = [len(t) + 1 for t in trees]
    launches = []
    real = batch_accept.accept_on_device
    monkeypatch.setattr(batch_accept, "accept_on_device", lambda *a: launches.append(1) or real(*a))
    on = batch_accept.accept_batch(reqs, context, trees, logits, counts, device_accept=True)
    assert launches == [1]
    off = batch_accept.accept_batch(reqs, context, trees, logits, counts, device_accept=False)
    auto = batch_accept.accept_batch(reqs, context, trees, logits, counts)
    assert launches == [1]  # neither off nor auto (CPU logits) launched the kernel
    assert on == off == auto
    assert sum(len(path) for path, _ in off) >= n_req // 2  # walks do go down the trees


def test_a_tree_over_the_kernels_bitmask_takes_the_host_walk_even_when_forced(monkeypatch):
    import verifier_svc.batch_accept as batch_accept

    monkeypatch.setattr(batch_accept, "accept_on_device", lambda *a: pytest.fail("the kernel takes 63 nodes at most"))
    n = batch_accept.KERNEL_MAX_NODES + 1
    chain = TokenTree([3] * n, list(range(-1, n - 1)))
    logits = torch.zeros(n + 1, 10)
    logits[:, 3] = 1.0  # the target agrees with every node
    req = GenerationRequest("r", [], 0.0, 1.0, 0, 1, 8, (), False, SpecParams("none", 0, 0, "", ""))
    got = batch_accept.accept_batch([req], [5], [chain], logits, [n + 1], device_accept=True)
    assert got == [(list(range(n)), 3)]


def test_launcher_rejects_mismatched_rows():
    trees, logits = random_batch(1, 3, 4, vocab=10, stochastic=False)
    probs = torch.softmax(logits, dim=-1)
    args = (pack(trees), torch.zeros(3, dtype=torch.bool), table(torch.arange(3), torch.arange(3), trees))
    with pytest.raises(ValueError, match="target rows"):
        tree_accept_kernel_launch(probs[1:], logits.argmax(-1)[1:], *args)
    with pytest.raises(ValueError, match="int64"):
        tree_accept_kernel_launch(probs, logits.argmax(-1).int(), *args)


@pytest.mark.parametrize("stochastic", [False, True], ids=["deterministic-draft", "sparse-q-draft"])
@pytest.mark.usefixtures("cpu_kernels")
def test_first_emitted_token_converges_to_the_target(stochastic):
    """Interpreter-sized: 320 walks, sampling noise of TV about sqrt(V / N) / 2 = 0.08."""
    tv_small, _, _ = first_token_tv(40, stochastic)
    tv, unrelated, results = first_token_tv(320, stochastic)
    print(f"TV {tv:.4f} (40 walks: {tv_small:.4f}), nearest unrelated distribution {unrelated:.4f}")
    assert tv < 0.1 and tv < unrelated / 2 and tv < tv_small, (tv, unrelated, tv_small)
    assert any(path for path, _ in results) and any(not path for path, _ in results)


@requires_cuda
@pytest.mark.parametrize("stochastic", [False, True], ids=["deterministic-draft", "sparse-q-draft"])
def test_first_emitted_token_converges_like_one_over_sqrt_n_on_the_gpu(stochastic):
    tvs = [first_token_tv(n, stochastic, "cuda")[0] for n in (1_000, 100_000)]
    assert tvs[1] < 0.01 and tvs[0] / tvs[1] > 4


@pytest.mark.usefixtures("cpu_kernels")
def test_the_kernel_walks_rows_processed_by_logits_controls_as_the_host_walk_does():
    """Requests with penalties, biases, min_tokens and min_p beside one without: the decode step's
    processed logits (``logits_controls``) walked on the device equal the host walk, greedy and sampled."""
    import verifier_svc.batch_accept as batch_accept
    from verifier_svc.logits_controls import process_logits

    n_req = 6
    trees, logits = random_batch(77, n_req, 10, vocab=30, stochastic=True)
    plain = SpecParams("none", 0, 0, "", "")
    controls = [
        dict(repetition_penalty=1.5, min_p=0.1),
        dict(presence_penalty=1.0, frequency_penalty=0.5),
        dict(logit_bias=((3, 2.0), (7, -5.0)), min_tokens=4),
        dict(allowed_token_ids=frozenset(range(5, 25)), min_p=0.05),
        dict(repetition_penalty=0.8),
        {},
    ]
    temperature = [0.0, 0.9, 1.0, 0.0, 1.2, 0.8]
    reqs = [
        GenerationRequest(str(b), [1, 2, 3], t, 1.0, 0, random.Random(b).getrandbits(63), 8, (), False, plain, **kw)
        for b, (t, kw) in enumerate(zip(temperature, controls, strict=True))
    ]
    outputs = [[4, 5, 5][: b % 4] for b in range(n_req)]
    counts = [len(t) + 1 for t in trees]
    processed = process_logits(logits.clone(), reqs, outputs, trees, {2})
    context = [3 + len(o) for o in outputs]
    on = batch_accept.accept_batch(reqs, context, trees, processed, counts, device_accept=True)
    off = batch_accept.accept_batch(reqs, context, trees, processed, counts, device_accept=False)
    assert on == off
    assert not torch.equal(processed, logits)
