"""The head proposer's pure pieces on tiny tensors: the draft vocabulary, batched tree drafting
within budget, depth and order, and sampled nodes carrying the exact distribution they came from."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from proposer_svc.core.tree_search import DraftConfig, SearchRow, proposal_distribution
from proposer_svc.head.proposer import DraftRow, Head, HeadArch, draft_trees, draft_vocabulary, target_to_draft
from specmesh_server.tree import TokenTree, depths, validate_tree

V, H = 50, 8
CONFIG = DraftConfig(max_nodes=24, max_depth=5)  # the head server's defaults


def tiny_head(seed: int = 0, n: int = 20) -> Head:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, H, generator=g)
    counts = torch.randint(0, 100, (V,), generator=g)
    ids = draft_vocabulary(counts, n, always=[0])
    head = Head(HeadArch(H, V, len(ids), "tiny", "h"), embed, embed[ids].contiguous(), ids)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return head.eval()


def test_the_draft_vocabulary_maps_to_target_ids_and_back():
    counts = torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(1))
    ids = draft_vocabulary(counts, 16, always=[3])
    assert 3 in ids.tolist() and len(ids) == 16 and ids.tolist() == sorted(ids.tolist())
    inv = target_to_draft(ids, V)
    assert ids[inv[ids]].tolist() == ids.tolist()  # target → draft → target
    assert (inv[torch.arange(V)] >= 0).sum() == 16  # every other id maps to -1
    kept = set(ids.tolist()) - {3}
    assert min(counts[sorted(kept)]) >= max(counts[[t for t in range(V) if t not in kept and t != 3]])


def rows(n: int, **kw) -> list[DraftRow]:
    g = torch.Generator().manual_seed(7)
    base = {"max_nodes": 10, "max_depth": 4, "context_length": 30} | kw
    return [DraftRow(torch.randn(H, generator=g), i + 1, SearchRow(**base)) for i in range(n)]


@pytest.mark.parametrize(("nodes", "depth"), [(1, 1), (6, 2), (10, 4), (24, 6)])
def test_greedy_trees_stay_within_budget_and_depth_best_first_with_parents_first(nodes, depth):
    head = tiny_head()
    for tree in draft_trees(head, rows(3, max_nodes=nodes, max_depth=depth), CONFIG):
        validate_tree(TokenTree(tree.tokens, tree.parents, probs=tree.probs), V, nodes, depth)
        assert len(tree.tokens) == min(nodes, CONFIG.max_nodes)
        assert max(depths(tree.parents)) <= depth
        assert tree.probs == sorted(tree.probs, reverse=True)  # best first, so every cut keeps the best
        assert all(p < 0 or tree.probs[p] >= tree.probs[i] for i, p in enumerate(tree.parents))
        assert set(tree.tokens) <= set(head.draft_ids.tolist())


def test_a_request_gets_the_same_tree_alone_or_batched():
    head, cfg = tiny_head(), CONFIG
    batch = rows(4, max_nodes=12, max_depth=5)
    together = draft_trees(head, batch, cfg)
    alone = [draft_trees(head, [r], cfg)[0] for r in batch]
    assert [(t.tokens, t.parents) for t in together] == [(t.tokens, t.parents) for t in alone]


def test_the_root_is_the_heads_greedy_choice_and_its_probability_the_heads_softmax():
    head = tiny_head()
    r = rows(1, max_nodes=4, max_depth=1)[0]
    _, logits = head(r.state[None], torch.tensor([r.token]))
    p = torch.softmax(logits[0], -1)
    tree = draft_trees(head, [r], replace(CONFIG, branch=4))[0]
    assert tree.tokens[0] == int(head.draft_ids[p.argmax()])
    assert tree.probs == pytest.approx(p.topk(4).values.tolist(), rel=1e-5)


def test_sampled_nodes_carry_the_truncated_softmax_they_were_drawn_from_minus_earlier_siblings():
    head, cfg = tiny_head(), replace(CONFIG, q_support=8)
    r = rows(1, max_nodes=3, max_depth=1, temperature=0.7, top_p=0.9, top_k=6, seed=11)[0]
    tree = draft_trees(head, [r], cfg)[0]
    assert tree.parents == [-1, -1, -1] and tree.dists is not None
    _, logits = head(r.state[None], torch.tensor([r.token]))
    ids, q = proposal_distribution(
        logits, torch.tensor([0.7]), torch.tensor([0.9]), torch.tensor([6]), cfg.q_support, cfg.q_floor
    )
    q_of = dict(zip(head.draft_ids[ids[0]].tolist(), q[0].tolist(), strict=True))
    drawn: list[int] = []
    for tok, (d_ids, d_probs) in zip(tree.tokens, tree.dists, strict=True):
        rest = {t: p for t, p in q_of.items() if t not in drawn}
        total = math.fsum(rest.values())
        assert dict(zip(d_ids, d_probs, strict=True)) == pytest.approx({t: p / total for t, p in rest.items()})
        assert tok in rest
        drawn.append(tok)
    validate_tree(TokenTree(tree.tokens, tree.parents, tree.dists), V, 3, 1)
    # Same seed and context: the same draws; another context: fresh noise.
    assert draft_trees(head, [r], cfg)[0].tokens == tree.tokens
