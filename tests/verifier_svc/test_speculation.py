"""Speculative decoding through the services: the n-gram proposer as its own process, output
identical to plain greedy decoding, sampling distributed as the target, and proposers that
die or lie never corrupt or stall a request."""

import os
import signal
import subprocess
import sys
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import grpc
import pytest
from support import (
    assert_chi_square,
    assert_greedy_equal,
    assert_second_tokens_chi_square,
    assert_wrong_rules_fail,
    second_token_counts,
    seeded_tree_walks,
    start_verifier,
    stop_verifier,
    workload_prompts,
)

from specmesh import Client, SamplingParams, SpecDecodeParams
from specmesh.deploy import free_port, wait_healthy
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc

pytestmark = pytest.mark.slow
NGRAM = SpecDecodeParams(proposer="ngram")


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def start_ngram() -> tuple[str, subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "specmesh", "serve", "ngram", "--address", address]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(address, 60, proc)
    return address, proc


@pytest.fixture(scope="module")
def spec_verifier(tmp_path_factory, lm):
    address, ngram = start_ngram()
    # Verify every tree (no cost gating), so losslessness is exercised on every proposal; wait for
    # each step's tree (the n-gram answers in milliseconds), so every step that has one verifies it.
    v = start_verifier(
        tmp_path_factory.mktemp("spec"),
        "--proposer", f"ngram={address}",
        "--spec-gating", "always",
        "--proposer-wait-ms", "200",
    )  # fmt: skip
    yield v
    stop_verifier(v)
    ngram.terminate()
    ngram.wait(30)


@pytest.fixture(scope="module")
def prompts(chat_ids):
    texts = workload_prompts(per_category=2, max_chars=2000)  # 14: up to 2 a category, under 2,000 characters
    assert len(texts) >= 12
    return [chat_ids(t) for t in texts]


def test_greedy_with_ngram_is_token_identical_on_workload_prompts_at_batch_one(lm, spec_verifier, prompts, hf_greedy):
    drafted = accepted = cached = 0
    with Client(spec_verifier.address) as c:
        for ids in prompts:
            out = c.complete(ids, _greedy(24), NGRAM)
            assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, 24))
            m = out.summary.speculation
            assert not m.fallback_reason and m.per_proposer["ngram"].drafted_tokens == m.drafted_tokens
            drafted += m.drafted_tokens
            accepted += m.accepted_tokens
            cached += out.summary.cached_tokens
    assert drafted > 0 and accepted > 0  # speculation really happened
    assert cached > 0  # and on prefixes from the cache (the chat template's first block, at least)


def test_greedy_with_ngram_is_token_identical_with_eight_concurrent_requests(lm, spec_verifier, prompts, hf_greedy):
    with Client(spec_verifier.address) as c, ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda ids: c.complete(ids, _greedy(24), NGRAM), prompts))
    for ids, out in zip(prompts, outs, strict=True):
        assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, 24))


# Repetitive raw prompts: after the first sampled token the n-gram proposer has matches. The short
# one keeps the requests cheap; after the long one the target accepts deeper into the chain.
REPETITIVE = "red green blue, red green blue, red green"
REPETITIVE_LONG = "red green blue, red green blue, red green blue, red green blue, red green"


def test_sampled_tokens_with_ngram_on_and_off_follow_the_target_softmax_chi_square(lm, spec_verifier):
    """End to end through the processes: seeded 2-token requests, the second token decided by a
    verification step of an n-gram tree (on) or a plain decode step (off), tested against the
    target's softmax after the first token (stratified by it). The acceptance rule itself gets its
    large-sample test, with negative controls, on tensors below; this one catches wiring (seeds,
    counters, temperature, trees) with 500 + 200 requests."""
    ids = lm.tokenizer.encode(REPETITIVE)
    with Client(spec_verifier.address) as c:
        for spec, n in ((NGRAM, 500), (SpecDecodeParams(proposer="none"), 200)):
            pairs, drafted = second_token_counts(c, ids, spec, n, 1.0)
            if spec is NGRAM:  # after " blue" (most first tokens) the n-gram proposes ", red green"
                assert drafted >= n // 4, f"too few second steps verified a tree ({drafted} drafted tokens)"
            tested = assert_second_tokens_chi_square(lm, ids, pairs, 1.0, spec.proposer)
            assert tested >= n // 3, f"{spec.proposer}: first token too spread ({tested} of {n} tested)"


def test_ngram_tree_acceptance_on_the_real_logits_emits_the_target_softmax_at_every_depth_chi_square(lm):
    """The verifier's sampled acceptance, on the real model's logits for the n-gram proposer's real
    tree (a chain), computed once and walked for 20,000 seeds: the token emitted at each depth,
    given the drafts accepted before it, follows the target's softmax there (p = 0.001 per depth).
    Negative controls: rules that accept drafts too often or forget the residual fail the same
    test on 2,000 seeds."""
    import torch

    from specmesh_server.ngram import NgramConfig, NgramIndex
    from specmesh_server.tree import TokenTree

    n = 20_000
    ids = lm.tokenizer.encode(REPETITIVE_LONG)
    with torch.inference_mode():
        context = [*ids, int(lm.model(torch.tensor([ids])).logits[0, -1].argmax())]
    index = NgramIndex(NgramConfig())
    index.extend(context)
    tokens, parents = index.propose(max_depth=3)
    assert parents == [-1, 0, 1], "premise: the proposal here is a chain"
    tree = TokenTree(tokens, parents)
    with torch.inference_mode():  # a chain's rows are a causal forward: after the root, node 0, 1, 2
        logits = lm.model(torch.tensor([[*context, *tokens]])).logits[0, len(ids) :].float()
    probs, out, emitted = seeded_tree_walks(tree, context, logits, "ngram", n)

    for depth in range(len(tokens) + 1):  # depth d: after the first d drafts were accepted
        sample = torch.tensor([e[depth] for e in out if len(e) > depth and e[:depth] == tokens[:depth]])
        assert len(sample) >= 1_000, f"depth {depth}: too few walks got there ({len(sample)})"
        assert_chi_square(sample, probs[depth], f"token at depth {depth} ({len(sample)} walks)")

    assert_wrong_rules_fail(probs, out, emitted)


def test_proposer_killed_mid_request_completes_with_the_same_greedy_output(tmp_path, lm, prompts, hf_greedy):
    address, ngram = start_ngram()
    v = start_verifier(tmp_path, "--proposer", f"ngram={address}", "--spec-gating", "always")
    try:
        ids = prompts[-1]
        with Client(v.address) as c:
            stream = c.generate(ids, _greedy(48, ignore_eos=True), NGRAM)
            tokens: list[int] = []
            for chunk in stream:
                tokens += chunk.token_ids
                if len(tokens) >= 4 and ngram.poll() is None:
                    os.kill(ngram.pid, signal.SIGKILL)
            assert_greedy_equal(lm, ids, tokens, hf_greedy(ids, 48))
            assert "ngram" in stream.summary.speculation.fallback_reason
            after = c.complete(ids, _greedy(8), NGRAM)  # a new request with the tier down: plain decoding
            assert after.token_ids == hf_greedy(ids, 48)[:8] and after.summary.speculation.fallback_reason
    finally:
        ngram.kill()
        stop_verifier(v)


class LyingProposer(proposer_pb2_grpc.ProposerServiceServicer):
    """Sends, in turn: a cycle, out-of-vocabulary tokens, an oversized tree, mismatched arrays,
    then well-formed but wrong guesses."""

    BAD: ClassVar[list[proposer_pb2.TokenTree]] = [
        proposer_pb2.TokenTree(tokens=[5, 6], parents=[1, 0]),
        proposer_pb2.TokenTree(tokens=[10**7], parents=[-1]),
        proposer_pb2.TokenTree(tokens=[5] * 500, parents=[-1] * 500),
        proposer_pb2.TokenTree(tokens=[5, 6], parents=[-1]),
    ]

    def Propose(self, request_iterator, context):
        context_len = 0
        for i, msg in enumerate(request_iterator):
            kind = msg.WhichOneof("event")
            if kind == "start":
                context_len = len(msg.start.prompt_token_ids)
            elif kind == "advance":
                context_len += len(msg.advance.accepted_token_ids)
            else:
                return
            tree = (
                self.BAD[i] if i < len(self.BAD) else proposer_pb2.TokenTree(tokens=[17, 18, 19], parents=[-1, 0, -1])
            )
            yield proposer_pb2.ProposeResponse(context_length=context_len, tree=tree)


def test_malformed_trees_are_rejected_counted_and_the_request_completes_correctly(tmp_path, lm, prompts, hf_greedy):
    server = grpc.server(futures.ThreadPoolExecutor(4))
    proposer_pb2_grpc.add_ProposerServiceServicer_to_server(LyingProposer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    v = start_verifier(tmp_path, "--proposer", f"liar=127.0.0.1:{port}", "--spec-gating", "always")
    try:
        ids = prompts[0]
        with Client(v.address) as c:
            out = c.complete(ids, _greedy(24), SpecDecodeParams(proposer="liar"))
            stats = c.stats()
        assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, 24))
        m = out.summary.speculation
        assert m.invalid_trees >= 4 and m.drafted_tokens > 0  # the bad ones dropped, the wrong ones verified
        deadline = time.time() + 5
        while stats.server.running_requests and time.time() < deadline:
            time.sleep(0.1)
    finally:
        stop_verifier(v)
        server.stop(0)


def test_cost_gated_speculation_is_lossless_and_still_speculates_where_copying_pays(tmp_path, lm, chat_ids, hf_greedy):
    address, ngram = start_ngram()
    v = start_verifier(tmp_path, "--proposer", f"ngram={address}")  # default: --spec-gating cost
    try:
        edits = [chat_ids(t) for t in workload_prompts(per_category=8, max_chars=2000, categories=("code_edit",))][:3]
        drafted = 0
        with Client(v.address) as c:
            for ids in edits:
                out = c.complete(ids, _greedy(64), NGRAM)
                assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, 64))
                drafted += out.summary.speculation.drafted_tokens
        assert drafted > 0
        assert "verifier: step cost (rows×[widths" in v.log()
    finally:
        stop_verifier(v)
        ngram.kill()
