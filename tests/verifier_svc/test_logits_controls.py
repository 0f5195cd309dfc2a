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
from support import assert_greedy_equal, workload_prompts
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


def _path(tree: TokenTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(tree.tokens[node])
        node = tree.parents[node]
    return out[::-1]


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
            plain = output + (_path(tree, node) if node >= 0 else [])
            want = process_logits(logits[row : row + 1].clone(), [req], [plain], [TokenTree([], [])], EOS)
            torch.testing.assert_close(got[row : row + 1], want, rtol=0, atol=1e-6)
            row += 1
    assert torch.equal(got[len(trees[0]) + 1 : len(trees[0]) + 6], logits[len(trees[0]) + 1 : len(trees[0]) + 6])


def test_a_batch_without_controls_is_returned_untouched() -> None:
    logits = torch.randn(2, V)
    assert process_logits(logits, [_req(), _req()], [[1], [2]], [TokenTree([], [])] * 2, EOS) is logits


# --- the engine on the real model --------------------------------------------------------------

pytest_slow = pytest.mark.slow
CONTROLS = {
    "repetition_penalty": dict(repetition_penalty=1.3),
    "presence+frequency": dict(presence_penalty=1.0, frequency_penalty=0.5),
    "logit_bias": dict(logit_bias=((13, 4.0), (30, -100.0))),
    "min_tokens": dict(min_tokens=40),
    "allowed_token_ids": dict(allowed_token_ids=frozenset(range(200, 30000))),
}


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


def _run(eng, prompts: list[list[int]], n: int, speculate: bool, **controls) -> list[list[int]]:
    from verifier_svc.local_proposer import LocalProposerSession
    from verifier_svc.proposer_client import ProposerLimits
    from verifier_svc.request_speculation import RequestSpeculation

    limits = ProposerLimits(vocab_size=eng.runner.vocab_size, max_nodes=16, max_depth=8)
    got = [_Collector() for _ in prompts]
    for i, ids in enumerate(prompts):
        spec = SpecParams("ngram", 0, 0, "", "") if speculate else NO_SPEC
        req = GenerationRequest(f"r{i}", ids, 0.0, 1.0, 0, 1, n, (), False, spec, **controls)
        session = LocalProposerSession("ngram", ids, limits, eng.speculation.trees_arrived) if speculate else None
        eng.submit(req, got[i], RequestSpeculation.start(session))
    assert all(c.done.wait(300) for c in got)
    return [c.tokens for c in got]


def _hf(lm, ids: list[int], n: int, **kw) -> list[int]:
    with torch.inference_mode():
        out = lm.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=2, **kw)
    return out[0, len(ids) :].tolist()


@pytest_slow
def test_greedy_with_each_control_is_identical_with_ngram_speculation_on_and_off_at_1_and_8_streams(
    lm, chat_ids, engine_factory
):
    """Each control alone, greedy: 8 concurrent n-gram streams (every tree verified) equal 8 plain
    ones, and the first prompt alone equals transformers generate() with the matching processor."""
    eng = engine_factory()
    prompts = [chat_ids(p) for p in workload_prompts(per_category=1, max_chars=700)][:8]
    n = 24
    hf_kwargs = {
        "repetition_penalty": dict(repetition_penalty=1.3),
        "logit_bias": dict(sequence_bias={(13,): 4.0, (30,): -100.0}),
        "min_tokens": dict(min_new_tokens=40, eos_token_id=2),
    }
    for name, controls in CONTROLS.items():
        m = 44 if name == "min_tokens" else n
        plain = _run(eng, prompts, m, False, **controls)
        spec = _run(eng, prompts, m, True, **controls)
        alone = _run(eng, prompts[:1], m, True, **controls)[0]
        for ids, a, b in zip(prompts, plain, spec, strict=True):
            assert_greedy_equal(lm, ids, b, a)
        assert_greedy_equal(lm, prompts[0], alone, plain[0])
        if name in hf_kwargs:
            assert_greedy_equal(lm, prompts[0], plain[0], _hf(lm, prompts[0], m, **hf_kwargs[name]))
        if name == "allowed_token_ids":
            assert all(200 <= t < 30000 for out in spec for t in out)
        if name == "min_tokens":
            assert all(len(out) >= 40 and 2 not in out[:40] for out in spec)
