"""Structured outputs (``verifier_svc.grammar``): every tree node's mask is the grammar state its path
reaches, forbidden drafts are pruned (a sampled node's proposal restricted with them), compile
errors name their field; the engine's greedy output under a JSON schema, a regex and a choice list
is identical with n-gram speculation on and off at 1 and 8 streams and to transformers ``generate()``
with xgrammar's own logits processor; sampled acceptance with a grammar mask emits the constrained
target's distribution at every node (chi-square, with the negative controls failing)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xgr
from support import tree_path

from specmesh_server.tree import TokenTree
from verifier_svc.grammar import GrammarCompiler, RequestGrammar, constrain_trees, step_masks
from verifier_svc.requests import GenerationRequest, GrammarSpec, InvalidRequest, SpecParams

NO_SPEC = SpecParams("none", 0, 0, "", "")
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 30},
        "topic": {"enum": ["math", "coding", "writing", "other"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["answer", "topic", "confidence"],
    "additionalProperties": False,
}
JSON_SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
REGEX_SPEC = GrammarSpec("regex", r"(yes|no), because [a-z ]{5,40}\.")
CHOICE_SPEC = GrammarSpec("choice", choices=("positive", "negative", "neutral"))


@pytest.fixture(scope="module")
def compiler(lm) -> GrammarCompiler:
    return GrammarCompiler(lm.tokenizer, lm.model.config.vocab_size, {2})


def _allowed(row: torch.Tensor, vocab: int) -> torch.Tensor:
    """The token ids a bitmask row allows."""
    bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)[None, :]) & 1  # [W, 32]
    return bits.reshape(-1)[:vocab].nonzero().squeeze(1)


def _fresh_row(compiled, path: list[int], width: int) -> torch.Tensor | None:
    """The mask after ``path`` from a new matcher (None where the grammar rejects the path)."""
    m = xgr.GrammarMatcher(compiled)
    if not all(m.accept_token(t) for t in path):
        return None
    row = torch.zeros(1, width, dtype=torch.int32)
    m.fill_next_token_bitmask(row)
    return row[0]


def test_compile_errors_name_the_field_and_compiled_grammars_are_cached(compiler) -> None:
    assert compiler.compile(JSON_SPEC) is compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    for spec in (
        GrammarSpec("regex", "(unclosed"),
        GrammarSpec("grammar", "root ::= missing_rule"),
        GrammarSpec("json_schema", '{"type": "no-such-type"}'),
    ):
        with pytest.raises(InvalidRequest, match=f"sampling.structured_output.{spec.kind}: cannot compile"):
            compiler.compile(spec)


def test_every_tree_nodes_mask_is_the_grammar_state_its_path_reaches_and_forbidden_nodes_are_pruned(
    lm, compiler
) -> None:
    """Random trees over tokens the grammar likes (and some it forbids): each kept node's row equals
    a fresh matcher's after the node's path, a node is pruned exactly when its path leaves the
    grammar, and the matcher's own state is untouched by the traversal."""
    tok = lm.tokenizer
    compiled = compiler.compile(JSON_SPEC)
    good = tok.encode('{"answer": "It is four.", "topic": "math", "confidence": 9}', add_special_tokens=False)
    vocab = lm.model.config.vocab_size
    width = (vocab + 31) // 32
    rng = random.Random(0)
    for trial in range(20):
        g = RequestGrammar.start(compiled, vocab)
        prefix = good[: rng.randrange(len(good) - 4)]
        g.advance(prefix)
        n = rng.randrange(1, 24)
        parents = [rng.randrange(-1, i) for i in range(n)]
        tokens = []
        for i in range(n):  # mostly the grammar's own next token, sometimes a random one
            depth = len(tree_path(TokenTree([*tokens, 0], parents[: i + 1]), i))
            at = len(prefix) + depth - 1
            tokens.append(good[at] if at < len(good) and rng.random() < 0.7 else rng.randrange(vocab))
        tree = TokenTree(tokens, parents)
        [kept] = constrain_trees([g], [tree])
        expect_kept = [i for i in range(n) if _fresh_row(compiled, prefix + tree_path(tree, i), width) is not None]
        assert len(kept) == len(expect_kept), trial
        assert g.pruned == n - len(expect_kept)
        assert [tokens[i] for i in expect_kept] == kept.tokens
        masks = step_masks([g], [kept])
        assert masks.rows == list(range(len(kept) + 1))
        assert torch.equal(masks.bitmask[0], _fresh_row(compiled, prefix, width))
        for j in range(len(kept)):
            assert torch.equal(masks.bitmask[j + 1], _fresh_row(compiled, prefix + tree_path(kept, j), width)), trial
        assert torch.equal(_row_of(g), _fresh_row(compiled, prefix, width))  # traversal rolled back


def _row_of(g: RequestGrammar) -> torch.Tensor:
    row = torch.zeros(1, g.width, dtype=torch.int32)
    g.matcher.fill_next_token_bitmask(row)
    return row[0]


def test_sampled_nodes_proposals_are_restricted_to_what_their_parent_allows(lm, compiler) -> None:
    tok = lm.tokenizer
    g = RequestGrammar.start(compiler.compile(CHOICE_SPEC), lm.model.config.vocab_size)
    pos, neg, hello = (tok.encode(w, add_special_tokens=False)[0] for w in ("positive", "negative", "hello"))
    tree = TokenTree([pos, hello, neg], [-1, -1, -1], dists=[([pos, hello, neg], [0.5, 0.3, 0.2])] * 3)
    [kept] = constrain_trees([g], [tree])
    assert kept.tokens == [pos, neg] and g.pruned == 1
    assert kept.dists == [([pos, neg], [0.5, 0.2])] * 2


def test_a_speculating_requests_tree_gains_the_text_its_grammar_forces_next(lm, compiler) -> None:
    """After ``{"answer": "It is four.", "`` the schema forces ``topic": "``: its tokens are grafted onto
    the proposer's tree (a plain request's tree, room 0, is left alone) and pass the grammar."""
    tok, vocab = lm.tokenizer, lm.model.config.vocab_size
    g = RequestGrammar.start(compiler.compile(JSON_SPEC), vocab, compiler.encode)
    g.advance(tok.encode('{"answer": "It is four.", "', add_special_tokens=False))
    forced = list(compiler.encode('topic": "'))
    ngram = TokenTree([forced[0], 999], [-1, 0])  # right first token, then a wrong one
    [plain] = constrain_trees([g], [ngram], rooms=[0])
    assert plain.tokens == [forced[0]] and g.forced == 0  # 999 pruned, nothing added
    [grafted] = constrain_trees([g], [ngram], rooms=[8])
    assert grafted.tokens == [forced[0], *forced[1:]] and grafted.parents == [-1, *range(len(forced) - 1)]
    assert g.forced == len(forced) - 1
    assert tok.decode(grafted.tokens) == 'topic": "'


def test_the_tokenizers_added_tokens_are_never_allowed_but_its_stop_token(lm, compiler) -> None:
    """Inside a JSON string xgrammar allows any token; SmolLM2's added tokens (<|im_start|> …) are not
    text, so a constrained row forbids them, root and tree nodes alike; EOS ends the value as before."""
    tok, vocab = lm.tokenizer, lm.model.config.vocab_size
    spec = GrammarSpec("json_schema", '{"type": "string"}')
    im_start, there = tok.convert_tokens_to_ids("<|im_start|>"), tok.encode(" there", add_special_tokens=False)[0]
    for banned in (None, compiler.banned):
        g = RequestGrammar.start(compiler.compile(spec), vocab, banned=banned)
        g.advance(tok.encode('"hi', add_special_tokens=False))
        [tree] = constrain_trees([g], [TokenTree([im_start, there], [-1, -1])])
        assert (im_start in _allowed(g.rows[0], vocab).tolist()) is (banned is None)
        assert tree.tokens == ([im_start, there] if banned is None else [there])
    g.advance(tok.encode('"', add_special_tokens=False))
    constrain_trees([g], [TokenTree([], [])])
    assert _allowed(g.rows[0], vocab).tolist() == [2]


def test_step_masks_apply_to_each_constrained_requests_rows_only(lm, compiler) -> None:
    vocab = lm.model.config.vocab_size
    g = RequestGrammar.start(compiler.compile(CHOICE_SPEC), vocab)
    trees = [TokenTree([5, 6], [-1, 0]), TokenTree([], [])]
    trees = constrain_trees([None, g], trees)
    masks = step_masks([None, g], trees)
    logits = torch.zeros(4, vocab)
    masks.apply(logits)
    assert torch.isfinite(logits[:3]).all()  # the free request's root and two nodes
    allowed = torch.isfinite(logits[3]).nonzero().squeeze(1)
    assert {lm.tokenizer.decode(t) for t in allowed.tolist()} >= {"positive", "negative", "neutral"}
    assert len(allowed) < 40


# --- the engine on the real model --------------------------------------------------------------

PROMPTS = [
    "Answer as JSON with keys answer, topic and confidence: what is 7 times 6?",
    "Answer as JSON with keys answer, topic and confidence: write a haiku about rain.",
    "Answer as JSON with keys answer, topic and confidence: how do I reverse a list in Python?",
    "Answer as JSON with keys answer, topic and confidence: what is the capital of France?",
    "Is the sky blue? Answer yes or no, then say why.",
    "Is water dry? Answer yes or no, then say why.",
    "Classify the sentiment: 'I loved this film, it was wonderful.'",
    "Classify the sentiment: 'The service was slow and the food cold.'",
]
SPECS = [JSON_SPEC] * 4 + [REGEX_SPEC] * 2 + [CHOICE_SPEC] * 2


def _check(spec: GrammarSpec, text: str) -> None:
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.kind == "regex":
        assert re.fullmatch(spec.value, text), text
    else:
        assert text in spec.choices, text


def _run(eng, compiler, prompts, specs, n: int, speculate: bool, temperature: float = 0.0, seed: int = 1):
    from test_logits_controls import _Collector

    from verifier_svc.local_proposer import LocalProposerSession
    from verifier_svc.proposer_client import ProposerLimits
    from verifier_svc.request_speculation import RequestSpeculation

    limits = ProposerLimits(vocab_size=eng.runner.vocab_size, max_nodes=16, max_depth=8)
    got = [_Collector() for _ in prompts]
    grammars = []
    for i, (ids, spec) in enumerate(zip(prompts, specs, strict=True)):
        sp = SpecParams("ngram", 0, 0, "", "") if speculate else NO_SPEC
        req = GenerationRequest(f"r{i}", ids, temperature, 1.0, 0, seed + i, n, (), False, sp, structured_output=spec)
        session = LocalProposerSession("ngram", ids, limits, eng.speculation.trees_arrived) if speculate else None
        grammar = compiler.request(compiler.compile(spec))
        eng.submit(req, got[i], RequestSpeculation.start(session), grammar)
        grammars.append(grammar)
    assert all(c.done.wait(300) for c in got)
    FORCED.append(sum(g.forced for g in grammars))
    return [c.tokens for c in got]


FORCED: list[int] = []  # per _run: draft nodes the grammars' forced continuations added


def _text(lm, tokens: list[int]) -> str:
    return lm.tokenizer.decode([t for t in tokens if t != 2])


@pytest.mark.slow
def test_greedy_under_a_grammar_is_identical_with_ngram_speculation_on_and_off_at_1_and_8_streams(
    lm, chat_ids, engine_factory, compiler
):
    """Eight concurrent greedy streams, four under a JSON schema, two a regex, two a choice list: with
    every n-gram tree verified they equal the same streams decoded plain and each one alone with
    speculation, every output is valid, and plain equals transformers generate() with xgrammar's
    logits processor (an independent implementation of the constrained greedy decode)."""
    from support import assert_greedy_equal
    from xgrammar.contrib.hf import LogitsProcessor

    eng = engine_factory()
    prompts = [chat_ids(p) for p in PROMPTS]
    n = 64
    plain = _run(eng, compiler, prompts, SPECS, n, False)
    assert FORCED[-1] == 0  # plain decoding drafts nothing, not even what the grammar forces
    spec = _run(eng, compiler, prompts, SPECS, n, True)
    assert FORCED[-1] > 0
    for ids, s, a, b in zip(prompts, SPECS, plain, spec, strict=True):
        assert_greedy_equal(lm, ids, b, a)
        assert a[-1] == 2, _text(lm, a)  # the grammar completed (then only EOS is allowed)
        _check(s, _text(lm, a))
    for i in (0, 4, 6):
        alone = _run(eng, compiler, [prompts[i]], [SPECS[i]], n, True)[0]
        assert_greedy_equal(lm, prompts[i], alone, plain[i])
        with torch.inference_mode():
            out = lm.model.generate(
                torch.tensor([prompts[i]]),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=2,
                eos_token_id=2,
                logits_processor=[LogitsProcessor(compiler.compile(SPECS[i]))],
            )
        assert_greedy_equal(lm, prompts[i], plain[i], out[0, len(prompts[i]) :].tolist())


@pytest.mark.slow
def test_sampled_outputs_under_a_schema_with_speculation_all_validate_and_metrics_count_grammar_work(
    lm, chat_ids, engine_factory
):
    """Eight sampled streams (temperature 0.8) under a schema with n-gram speculation: every output
    validates; /metrics' series count the compile, every step's mask time and the pruned nodes."""
    from prometheus_client import CollectorRegistry

    from specmesh_server.metrics import VerifierMetrics

    registry = CollectorRegistry()
    metrics = VerifierMetrics(registry, model="m")
    compiler = GrammarCompiler(lm.tokenizer, lm.model.config.vocab_size, {2}, metrics=metrics)
    eng = engine_factory(metrics=metrics)
    prompts = [chat_ids(p) for p in PROMPTS[:4]] * 2
    outs = _run(eng, compiler, prompts, [JSON_SPEC] * 8, 96, True, temperature=0.8, seed=7)
    for out in outs:
        assert out[-1] == 2
        _check(JSON_SPEC, _text(lm, out))
    value = lambda name, **labels: registry.get_sample_value(name, {"model": "m", **labels})  # noqa: E731
    assert value("specmesh_grammar_compile_seconds_count", kind="json_schema") == 1  # then cached
    assert value("specmesh_grammar_mask_seconds_count") >= len(outs[0]) // 2
    assert value("specmesh_grammar_pruned_nodes_total") is not None


@pytest.mark.slow
def test_sampled_acceptance_under_a_grammar_mask_emits_the_constrained_targets_distribution_chi_square(
    lm, chat_ids, compiler
):
    """A branching tree after a prompt asking for a choice (root children: an allowed and a forbidden
    token, then allowed continuations), pruned and masked as a decode step does, walked for 20,000
    seeds: each row's distribution is the target's renormalised over the tokens the grammar allows
    after the node's path (from a fresh matcher), the token emitted after each node follows it
    (chi-square, p = 0.001, nodes reached by ≥ 1,000 walks), and the wrong rules fail."""

    from support import assert_walks_follow, seeded_tree_walks

    spec = GrammarSpec("choice", choices=("red", "green", "blue", "reddish", "greenish"))
    compiled = compiler.compile(spec)
    tok, vocab = lm.tokenizer, lm.model.config.vocab_size
    prompt = chat_ids("Name a colour: red, green or blue?")
    first = [tok.encode(w, add_special_tokens=False)[0] for w in ("red", "green", "yellow")]
    kids = {w: tok.encode(w, add_special_tokens=False)[1:2] for w in ("reddish", "greenish")}  # red|dish, green|ish
    tree = TokenTree([first[0], *kids["reddish"], first[1], *kids["greenish"], first[2]], [-1, 0, -1, 2, -1])
    g = RequestGrammar.start(compiled, vocab)
    [kept] = constrain_trees([g], [tree])
    assert g.pruned == 1 and len(kept) == 4  # "yellow" is not a choice
    masks = step_masks([g], [kept])
    paths = [[]] + [tree_path(kept, i) for i in range(len(kept))]

    with torch.inference_mode():
        raw = torch.stack([lm.model(torch.tensor([prompt + p])).logits[0, -1].float() for p in paths])
    logits = raw.clone()
    masks.apply(logits)
    probs, out, emitted = seeded_tree_walks(kept, prompt, logits, "ngram", 20_000)

    def want(index: int, path: list[int]) -> torch.Tensor:  # the target renormalised over the allowed set
        allowed = _allowed(_fresh_row(compiled, path, g.width), vocab)
        p = torch.zeros(vocab, dtype=torch.float64)
        p[allowed] = torch.softmax(raw[index, allowed].double(), -1)
        return p

    assert np.isclose(float(probs[0].sum()), 1.0)
    assert_walks_follow(paths, probs, out, emitted, want)
