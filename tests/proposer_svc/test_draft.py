"""The draft proposer's tree core and per-request KV cache, on tiny tensors and a tiny random Llama."""

import random

import pytest
import torch

from proposer_svc.core.tree_search import DraftConfig, gumbel_order, proposal_distribution, sampling_template
from proposer_svc.draft.proposer import Drafter, RequestState
from specmesh_server.model_runner import ModelRunner, causal_mask
from specmesh_server.sampling import filter_logits
from specmesh_server.tree import TokenTree, depths, validate_tree

VOCAB = 96


@pytest.fixture(scope="module")
def runner():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # peaky logits: few near-ties between batched and single drafting
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    return ModelRunner(model, torch.device("cpu"), torch.float32, 512)


def _state(rid: str, context: list[int], slot: int, nodes=12, depth=4, temperature=0.0, seed=0) -> RequestState:
    return RequestState(
        rid, list(context), nodes, depth, temperature=temperature, top_p=0.9, top_k=20, seed=seed, slot=slot
    )


def _propose(drafter: Drafter, states: list[RequestState]):
    for s in states:
        if len(s.tail) > 1:
            drafter.prefill(s, len(s.context) - 1)
    return drafter.draft(slice(0, len(states)), states, [True] * len(states))


def test_sampling_template_respects_node_and_depth_budgets():
    for nodes in range(1, 40):
        for depth in range(1, 9):
            t = sampling_template(nodes, depth, width=4, branch=4)
            assert sum(map(sum, t)) <= nodes and len(t) <= depth
            assert all(c <= 4 for row in t for c in row)
            if nodes >= depth:
                assert len(t) == depth  # the budget reaches the full depth


def test_proposal_distribution_sums_to_one_and_is_the_truncated_draft_softmax():
    torch.manual_seed(1)
    logits = torch.randn(5, 50) * 3
    temp, top_p, top_k = torch.tensor([0.7] * 5), torch.tensor([0.9] * 5), torch.tensor([0, 5, 10, 0, 3])
    ids, q = proposal_distribution(logits, temp, top_p, top_k, support=16, floor=1e-3)
    assert torch.allclose(q.sum(-1), torch.ones(5)) and bool((q > 0).all())
    for r in range(5):
        assert len(set(ids[r].tolist())) == 16
    p = torch.softmax(filter_logits(logits, temp, top_p, top_k), -1)
    # Inside the support, q = 0.999 * p / p(support) + floor / T exactly.
    kept = p.gather(1, ids)
    want = 0.999 * kept / kept.sum(-1, keepdim=True) + 1e-3 / 16
    assert torch.allclose(q, want, atol=1e-6)


def test_gumbel_order_draws_first_from_probs_and_second_without_replacement():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05]).expand(40000, 4)
    order = gumbel_order(probs, torch.rand(40000, 4, dtype=torch.float64))
    first = torch.bincount(order[:, 0], minlength=4) / 40000
    assert torch.allclose(first, probs[0], atol=0.01)
    assert bool((order[:, 0] != order[:, 1]).all())
    second_given_0 = torch.bincount(order[order[:, 0] == 0, 1], minlength=4).double()
    assert torch.allclose(second_given_0 / second_given_0.sum(), torch.tensor([0, 0.6, 0.3, 0.1]).double(), atol=0.02)


def test_greedy_trees_fit_the_budget_are_topological_and_start_with_the_draft_argmax(runner):
    drafter = Drafter(runner, DraftConfig(max_nodes=16, max_depth=6, width=3, branch=3))
    rng = random.Random(0)
    budgets = [(12, 4), (5, 6), (16, 2)]
    states = [
        _state(f"r{i}", [rng.randrange(VOCAB) for _ in range(10 + 7 * i)], i, n, d) for i, (n, d) in enumerate(budgets)
    ]
    trees = _propose(drafter, states)
    for s, tree, (n, d) in zip(states, trees, budgets, strict=True):
        validate_tree(TokenTree(tree.tokens, tree.parents), VOCAB, n, d)
        drafted = 3 + 9 * (d - 1)  # root: 3 children; then 3 frontier nodes x 3 per level
        assert len(tree.tokens) == min(n, drafted) and tree.dists is None
        with torch.inference_mode():
            logits = runner.model(torch.tensor([s.context])).logits[0, -1]
        assert tree.tokens[0] == int(logits.argmax())  # best first: the draft's greedy token


def test_batched_drafting_gives_the_same_greedy_trees_as_one_request_at_a_time(runner):
    cfg = DraftConfig(max_nodes=10, max_depth=4, width=2, branch=3)
    rng = random.Random(1)
    contexts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 30, 17)]
    together = _propose(Drafter(runner, cfg), [_state(str(i), c, i, 10, 4) for i, c in enumerate(contexts)])
    for i, c in enumerate(contexts):
        alone = _propose(Drafter(runner, cfg), [_state(str(i), c, 0, 10, 4)])[0]
        assert (alone.tokens, alone.parents) == (together[i].tokens, together[i].parents)


def test_sampled_trees_have_a_static_shape_and_exact_sibling_distributions(runner):
    drafter = Drafter(runner, DraftConfig(max_nodes=12, max_depth=4, width=2, branch=3, q_support=16))
    ctx = list(range(20))
    a, b = _propose(
        drafter, [_state("a", ctx, 0, temperature=0.8, seed=1), _state("b", ctx, 1, temperature=0.8, seed=2)]
    )
    assert a.parents == b.parents and a.tokens != b.tokens  # shape from the budget only; values from the seed
    assert len(a.tokens) == 12 and max(depths(a.parents)) == 4
    validate_tree(TokenTree(a.tokens, a.parents, a.dists), VOCAB, 12, 4)
    for i, (ids, probs) in enumerate(a.dists):
        assert abs(sum(probs) - 1) < 1e-9 and a.tokens[i] in ids
        earlier = [a.tokens[k] for k in range(i) if a.parents[k] == a.parents[i]]
        assert not set(earlier) & set(ids)  # drawn without replacement: earlier siblings excluded
        if not earlier:
            assert len(ids) == 16  # a first child: the full sparse q


def test_kv_cache_after_many_advance_steps_equals_a_fresh_prefill(runner):
    drafter = Drafter(runner, DraftConfig(max_nodes=10, max_depth=4, width=2, branch=3))
    rng = random.Random(2)
    states = [_state(str(i), [rng.randrange(VOCAB) for _ in range(12 + 5 * i)], i, 10, 4) for i in range(3)]
    for step in range(25):
        trees = _propose(drafter, states)
        for s, tree in zip(states, trees, strict=True):
            # The verifier accepts a prefix of the tree's first path, then adds a bonus token.
            path, node = [], -1
            for k, p in enumerate(tree.parents):
                if p == node and len(path) < rng.randrange(5):
                    path.append(tree.tokens[k])
                    node = k
            s.advance([*path, rng.randrange(VOCAB)], runner.cache)
        if step % 5 == 2:  # the new tokens are exactly a drafted chain (all forwarded)
            trees = _propose(drafter, states)
            for s, tree in zip(states, trees, strict=True):
                node = max((m for m, st in enumerate(tree.cand_storage) if st >= 0), key=tree.cand_storage.__getitem__)
                chain = []  # the root-to-node path of the last forwarded node (depth 3)
                while node >= 0:
                    chain.insert(0, tree.cand_tokens[node])
                    node = tree.cand_parents[node]
                assert len(chain) == 3
                s.advance(chain, runner.cache)
        if step % 5 == 4:  # a request idles through a step: its stored draft KV must survive
            trees = drafter.draft(slice(0, 3), states, [True, False, True])
            for i in (0, 2):
                states[i].advance([trees[i].tokens[0], 1], runner.cache)
    assert sum(s.reused_tokens for s in states) > 10  # drafted KV was really taken over
    for s in states:
        n = s.cached
        fresh = 3  # a spare slot
        pos = torch.arange(n)[None]
        runner.forward(slice(fresh, fresh + 1), torch.tensor([s.context[:n]]), pos, causal_mask(pos, n))
        for layer in range(len(runner.cache.keys)):
            for buf in (runner.cache.keys[layer], runner.cache.values[layer]):
                torch.testing.assert_close(buf[s.slot, :, :n], buf[fresh, :, :n], atol=1e-5, rtol=1e-4)
