"""Logits controls (penalties, biases, allowed tokens, min_tokens, min_p): their arithmetic equals
transformers' logits processors (or vLLM's formulas where transformers has none) on the same
logits; under speculation every tree node's row equals what plain decoding computes had its path
been generated; and the engine's greedy output is identical with speculation on and off and to
transformers ``generate()`` with the matching processors."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from support import assert_greedy_equal, greedy_prompt_ids, tree_path
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from specmesh_server.sampling import filter_logits
from specmesh_server.tree import TokenTree
from verifier_svc.events import ErrorEvent, FinishEvent, TokenEvent
from verifier_svc.logits_controls import process_logits
from verifier_svc.requests import GenerationRequest, SpecParams

V = 50
NO_SPEC = SpecParams("none", 0, 0, "", "")
EOS = {2}


def _req(prompt=(1, 3, 5), **kw) -> GenerationRequest:
    base = dict(temperature=0.0, top_p=1.0, top_k=0, seed=1, max_tokens=64, stop=(), ignore_eos=False)
    return GenerationRequest("r", list(prompt), spec_params=kw.pop("spec_params", NO_SPEC), **(base | kw))


def test_repetition_penalty_equals_transformers_over_prompt_and_output() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, V, generator=g) * 3
    prompt, output = [4, 9, 9, 11], [11, 20, 7]
    got = process_logits(logits.clone(), [_req(prompt, repetition_penalty=1.3)], [output], [TokenTree([], [])], EOS)
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_logit_bias_equals_transformers_sequence_bias_and_allowed_tokens_mask_the_rest() -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1))
    bias = ((3, 5.0), (17, -2.5))
    got = process_logits(logits.clone(), [_req(logit_bias=bias)], [[8]], [TokenTree([], [])], EOS)
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(torch.tensor([[1, 3, 5, 8]]), logits.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    allowed = process_logits(
        logits.clone(), [_req(allowed_token_ids=frozenset({4, 6}))], [[]], [TokenTree([], [])], EOS
    )
    assert torch.isfinite(allowed[0]).nonzero().squeeze(1).tolist() == [4, 6]
    assert allowed[0, 4] == logits[0, 4]


def test_min_tokens_equals_transformers_min_new_tokens_and_masks_stop_token_ids_too() -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    prompt = [1, 3, 5]
    for output in ([], [7], [7, 8]):  # min_tokens 2: EOS masked for the first two tokens only
        ids = torch.tensor([prompt + output])
        want = MinNewTokensLengthLogitsProcessor(len(prompt), 2, 2)(ids, logits.clone())
        got = process_logits(logits.clone(), [_req(prompt, min_tokens=2)], [output], [TokenTree([], [])], EOS)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    got = process_logits(
        logits.clone(),
        [_req(min_tokens=1, stop_token_ids=frozenset({9}), ignore_eos=True)],
        [[]],
        [TokenTree([], [])],
        EOS,
    )
    assert got[0, 9] == float("-inf") and got[0, 2] == logits[0, 2]  # ignore_eos: EOS stays


def test_presence_and_frequency_penalties_follow_vllms_formula() -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    output = [5, 5, 5, 12, 30]
    got = process_logits(
        logits.clone(), [_req(presence_penalty=0.7, frequency_penalty=-0.4)], [output], [TokenTree([], [])], EOS
    )
    counts = torch.bincount(torch.tensor(output), minlength=V).float()
    want = logits - 0.7 * (counts > 0) - (-0.4) * counts  # vLLM's apply_penalties, prompt tokens not counted
    torch.testing.assert_close(got, want[None] if want.dim() == 1 else want, rtol=0, atol=1e-6)


def test_min_p_after_temperature_equals_transformers_min_p_warper() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4)) * 2
    got = filter_logits(
        logits, torch.full((3,), 0.8), torch.ones(3), torch.zeros(3, dtype=torch.long), torch.full((3,), 0.1)
    )
    ids = torch.zeros(3, 1, dtype=torch.long)
    want = MinPLogitsWarper(0.1)(ids, TemperatureLogitsWarper(0.8)(ids, logits.clone()))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)])


def _random_tree(rng: random.Random, n: int) -> TokenTree:
    parents = [rng.randrange(-1, i) for i in range(n)]
    return TokenTree([rng.randrange(V) for _ in range(n)], parents)


def test_every_tree_rows_controls_are_plain_decodings_had_its_path_been_generated() -> None:
    """A batch of three requests (one without controls) with random trees: each node's row equals
    the row plain decoding computes after output + the node's path (min_tokens by depth included)."""
    rng = random.Random(5)
    controls = dict(
        repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3, logit_bias=((2, 1.0), (7, -3.0)),
        min_tokens=6, stop_token_ids=frozenset({11}),
    )  # fmt: skip
    reqs = [
        _req((4, 4, 9), **controls),
        _req((1,)),
        _req((3, 8), **(controls | {"allowed_token_ids": frozenset(range(30))})),
    ]
    outputs = [[7, 8, 2 + 1], [5], [9, 9]]
    trees = [_random_tree(rng, 9), _random_tree(rng, 4), _random_tree(rng, 12)]
    logits = torch.randn(sum(len(t) + 1 for t in trees), V, generator=torch.Generator().manual_seed(6))
    got = process_logits(logits.clone(), reqs, outputs, trees, EOS)
    row = 0
    for req, output, tree in zip(reqs, outputs, trees, strict=True):
        for node in range(-1, len(tree)):
            plain = output + (tree_path(tree, node) if node >= 0 else [])
            want = process_logits(logits[row : row + 1].clone(), [req], [plain], [TokenTree([], [])], EOS)
            torch.testing.assert_close(got[row : row + 1], want, rtol=0, atol=1e-6)
            row += 1
    assert torch.equal(got[len(trees[0]) + 1 : len(trees[0]) + 6], logits[len(trees[0]) + 1 : len(trees[0]) + 6])


def _dense_reference(logits, req: GenerationRequest, seen: list[int]) -> torch.Tensor:
    """One row, the module docstring's six steps written out densely over the vocabulary."""
    x = logits.clone()
    if req.allowed_token_ids:
        x[[t for t in range(V) if t not in req.allowed_token_ids]] = float("-inf")
    if len(seen) < req.min_tokens:
        x[sorted(set(req.stop_token_ids) | (set() if req.ignore_eos else EOS))] = float("-inf")
    for t, b in req.logit_bias:
        x[t] += b
    counts = torch.bincount(torch.tensor(seen, dtype=torch.long), minlength=V).float()
    hit = counts > 0
    if req.repetition_penalty != 1.0:
        hit[req.prompt_ids] = True
    p = req.repetition_penalty
    x = torch.where(hit, torch.where(x > 0, x / p, x * p), x)
    return x - req.frequency_penalty * counts - req.presence_penalty * (counts > 0)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches_of_trees_equal_the_dense_formulas_row_by_row(seed: int) -> None:
    """Random requests (every control, some without), outputs, prompts and trees whose tokens repeat
    each other's: each processed row equals the dense formulas after output + the row's path."""
    rng = random.Random(seed)
    reqs, outputs, trees = [], [], []
    for i in range(5):
        kw = dict(
            repetition_penalty=rng.choice([1.0, 0.7, 1.6]), presence_penalty=rng.choice([0.0, 1.2, -0.5]),
            frequency_penalty=rng.choice([0.0, 0.4]), min_tokens=rng.choice([0, 3, 9]),
            logit_bias=tuple((t, rng.uniform(-3, 3)) for t in sorted(rng.sample(range(V), 3))) if i % 2 else (),
            allowed_token_ids=frozenset(rng.sample(range(V), 20)) if i == 3 else frozenset(),
            stop_token_ids=frozenset({7}) if i % 3 == 0 else frozenset(), ignore_eos=i == 4,
        )  # fmt: skip
        reqs.append(_req([rng.randrange(12) for _ in range(rng.randrange(1, 9))], **kw))
        outputs.append([rng.randrange(12) for _ in range(rng.randrange(0, 7))])
        n = rng.randrange(0, 10)
        trees.append(TokenTree([rng.randrange(12) for _ in range(n)], [rng.randrange(-1, j) for j in range(n)]))
    logits = torch.randn(sum(len(t) + 1 for t in trees), V, generator=torch.Generator().manual_seed(seed))
    got = process_logits(logits.clone(), reqs, outputs, trees, EOS)
    row = 0
    for req, output, tree in zip(reqs, outputs, trees, strict=True):
        for node in range(-1, len(tree)):
            want = _dense_reference(logits[row], req, output + (tree_path(tree, node) if node >= 0 else []))
            torch.testing.assert_close(got[row], want, rtol=0, atol=1e-5)
            row += 1


def test_a_batch_without_controls_is_returned_untouched() -> None:
    logits = torch.randn(2, V)
    assert process_logits(logits, [_req(), _req()], [[1], [2]], [TokenTree([], [])] * 2, EOS) is logits


# --- the engine on the real model --------------------------------------------------------------

pytest_slow = pytest.mark.slow
CONTROLS = [  # one per stream of an 8-stream batch (the last three without controls)
    dict(repetition_penalty=1.3),
    dict(presence_penalty=1.0, frequency_penalty=0.5),
    dict(logit_bias=((13, 4.0), (30, -100.0))),
    dict(min_tokens=14),
    dict(allowed_token_ids=frozenset(range(200, 30000))),
    {},
    {},
    {},
]
HF_KWARGS = [  # transformers generate()'s processors for the same controls, where it has them
    dict(repetition_penalty=1.3),
    None,
    dict(sequence_bias={(13,): 4.0, (30,): -100.0}),
    dict(min_new_tokens=14, eos_token_id=2),
    None,
]


class _Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        if isinstance(ev, TokenEvent):
            self.tokens += ev.token_ids
        else:
            assert not isinstance(ev, ErrorEvent), ev.message
            assert isinstance(ev, FinishEvent)
            self.done.set()


def _run(eng, prompts: list[list[int]], controls: list[dict], n: int, speculate: bool) -> list[list[int]]:
    from verifier_svc.local_proposer import LocalProposerSession
    from verifier_svc.proposer_client import ProposerLimits
    from verifier_svc.request_speculation import RequestSpeculation

    limits = ProposerLimits(vocab_size=eng.runner.vocab_size, max_nodes=16, max_depth=8)
    got = [_Collector() for _ in prompts]
    for i, (ids, kw) in enumerate(zip(prompts, controls, strict=True)):
        spec = SpecParams("ngram", 0, 0, "", "") if speculate else NO_SPEC
        req = GenerationRequest(f"r{i}", ids, 0.0, 1.0, 0, 1, n, (), False, spec, **kw)
        session = LocalProposerSession("ngram", ids, limits, eng.speculation.trees_arrived) if speculate else None
        eng.submit(req, got[i], RequestSpeculation.start(session))
    assert all(c.done.wait(300) for c in got)
    return [c.tokens for c in got]


@pytest_slow
def test_greedy_with_each_control_is_identical_with_ngram_speculation_on_and_off_at_1_and_8_streams(
    lm, chat_ids, engine_factory
):
    """Eight concurrent greedy streams, each with its own control (three with none): with every
    n-gram tree verified they equal the same streams decoded plain; each controlled prompt alone
    with speculation equals them too; and where transformers has the processor, generate() with it
    gives the same tokens."""
    eng = engine_factory()
    prompts = greedy_prompt_ids(chat_ids)[::2][:8]  # from five categories
    n = 18
    plain = _run(eng, prompts, CONTROLS, n, False)
    spec = _run(eng, prompts, CONTROLS, n, True)
    for ids, a, b in zip(prompts, plain, spec, strict=True):
        assert_greedy_equal(lm, ids, b, a)
    for i, kw in enumerate(CONTROLS[:5]):
        alone = _run(eng, [prompts[i]], [kw], n, True)[0]
        assert_greedy_equal(lm, prompts[i], alone, plain[i])
        if HF_KWARGS[i] is not None:
            assert_greedy_equal(lm, prompts[i], plain[i], _hf(lm, prompts[i], n, **HF_KWARGS[i]))
    assert all(200 <= t < 30000 for t in spec[4])
    assert len(spec[3]) >= 14 and 2 not in spec[3][:14]


def _hf(lm, ids: list[int], n: int, **kw) -> list[int]:
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2, **kw)
    return out[0, len(ids) :].tolist()


@pytest_slow
@pytest.mark.parametrize(
    "controls", [dict(presence_penalty=1.5, frequency_penalty=0.5), dict(min_p=0.05)], ids=["presence", "min_p"]
)
def test_sampled_acceptance_with_controls_emits_plain_decodings_distribution_at_every_node_chi_square(
    lm, chat_ids, controls
):
    """A branching tree (the two likeliest tokens at the root and after each of them) after a prompt
    and a two-token output, walked for 20,000 seeds with the controls on: each row's distribution
    equals the one computed from scratch after output + the node's path (vLLM's formula, or
    transformers' MinPLogitsWarper), and the token emitted after each node, given the walk accepted
    that node's path, follows it (chi-square, p = 0.001, nodes reached by ≥ 1,000 walks). Negative
    controls: rules that accept drafts too often or forget the residual fail on 2,000 seeds."""

    from support import assert_walks_follow, seeded_tree_walks

    prompt = chat_ids("Give me a random number between 1 and 10.")

    def after(paths: list[list[int]]) -> torch.Tensor:  # the model's logits after prompt + each path
        with torch.inference_mode():
            return torch.stack([lm.model(torch.tensor([prompt + p])).logits[0, -1].float() for p in paths])

    first = int(after([[]])[0].argmax())
    output = [first, int(after([[first]])[0].argmax())]
    top = after([output])[0].topk(2).indices.tolist()
    kids = [after([[*output, t]])[0].topk(2).indices.tolist() for t in top]
    tree = TokenTree([top[0], kids[0][0], kids[0][1], top[1], kids[1][0], kids[1][1]], [-1, 0, 0, -1, 3, 3])
    paths = [
        [],
        [top[0]],
        [top[0], kids[0][0]],
        [top[0], kids[0][1]],
        [top[1]],
        [top[1], kids[1][0]],
        [top[1], kids[1][1]],
    ]
    logits = after([output + p for p in paths])  # rows: the root, then each node
    probs, out, emitted = seeded_tree_walks(tree, prompt + output, logits, "ngram", 20_000, output=2, **controls)

    def reference(row: torch.Tensor, seen: list[int]) -> torch.Tensor:
        counts = torch.bincount(torch.tensor(seen), minlength=row.shape[0]).float()
        x = row - controls.get("presence_penalty", 0) * (counts > 0) - controls.get("frequency_penalty", 0) * counts
        if "min_p" in controls:
            x = MinPLogitsWarper(controls["min_p"])(torch.zeros(1, 1, dtype=torch.long), x[None])[0]
        return torch.softmax(x, -1).double()

    assert_walks_follow(paths, probs, out, emitted, lambda index, path: reference(logits[index], output + path))
