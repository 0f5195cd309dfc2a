"""The draft proposer through the real services: its own process, the verifier in another,
greedy output identical to plain decoding, sampled tokens distributed as the target, and a
draft with another vocabulary refused."""

import copy
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from support import (
    assert_chi_square,
    assert_greedy_equal,
    second_token_counts,
    start_verifier,
    stop_verifier,
    workload_prompts,
)

from proposer_svc.distill import save_draft, truncate_layers
from specmesh import Client, SamplingParams, SpecDecodeParams
from specmesh.deploy import free_port, wait_healthy
from specmesh.server.model_loading import tokenizer_hash
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc

pytestmark = pytest.mark.slow
SELF = SpecDecodeParams(proposer="draft", num_speculative_tokens=4, max_tree_nodes=8)
WEAK = SpecDecodeParams(proposer="weak", num_speculative_tokens=4, max_tree_nodes=8)


def start_draft(log_dir: Path, model: str | None, *args: str) -> tuple[str, subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "specmesh", "serve", "draft", "--address", address, "--threads", "1", *args]
    if model:
        cmd += ["--model", model]
    log = (log_dir / f"draft-{address.rsplit(':', 1)[1]}.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_healthy(address, 120, proc)
    return address, proc


@pytest.fixture(scope="module")
def weak_draft_dir(tmp_path_factory, lm) -> Path:
    """The target cut to its first 2 layers: shares the tokenizer, disagrees often."""
    out = tmp_path_factory.mktemp("weak-draft")
    save_draft(truncate_layers(copy.deepcopy(lm.model), 2), lm.tokenizer, out)
    return out


@pytest.fixture(scope="module")
def services(tmp_path_factory, lm, weak_draft_dir):
    logs = tmp_path_factory.mktemp("draft-logs")
    self_addr, self_proc = start_draft(logs, None)  # the target as its own draft
    weak_addr, weak_proc = start_draft(logs, str(weak_draft_dir))
    # A draft-model proposal takes ~70 ms on this CPU: let the verifier wait for it (the default 5 ms
    # suits the n-gram proposer).
    v = start_verifier(
        logs,
        "--proposer", f"draft={self_addr}",
        "--proposer", f"weak={weak_addr}",
        "--spec-gating", "always",
        "--proposer-wait-ms", "10000",
        "--proposer-timeout", "60",
    )  # fmt: skip
    yield v
    stop_verifier(v)
    for p in (self_proc, weak_proc):
        p.terminate()
        p.wait(30)


@pytest.fixture(scope="module")
def prompts(chat_ids):
    return [chat_ids(t) for t in workload_prompts(per_category=1, max_chars=400)][:2]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_greedy_with_the_target_as_its_own_draft_is_identical_and_accepts_whole_paths(lm, services, prompts, hf_greedy):
    with Client(services.address) as c:
        for ids in prompts:
            out = c.complete(ids, _greedy(16), SELF)
            assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, 16))
            m = out.summary.speculation
            assert not m.fallback_reason and m.steps > 0
            # Depth 4 trees from the target itself: every verified step accepts (nearly) a whole path.
            assert m.accepted_tokens >= 0.9 * 4 * m.steps - 4, m


def test_greedy_with_a_two_layer_draft_is_identical_and_concurrent_requests_batch(lm, services, prompts, hf_greedy):
    with Client(services.address) as c, ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ids: c.complete(ids, _greedy(20), WEAK), prompts))
    drafted = accepted = 0
    for ids, out in zip(prompts, outs, strict=True):
        assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, 20))
        m = out.summary.speculation
        assert not m.fallback_reason
        drafted, accepted = drafted + m.drafted_tokens, accepted + m.accepted_tokens
    assert drafted > 0 and accepted < 0.5 * drafted  # trees were verified, and this draft is poor


def test_sampled_tokens_with_the_draft_follow_the_target_softmax_chi_square(lm, services):
    import torch

    ids = lm.tokenizer.encode("The three primary colors are red, blue and")
    with torch.inference_mode():
        first = torch.softmax(lm.model(torch.tensor([ids])).logits[0, -1].float(), -1)
    mode = int(first.argmax())
    with torch.inference_mode():
        p = torch.softmax(lm.model(torch.tensor([[*ids, mode]])).logits[0, -1].float(), -1)
    n = 2000  # as many seeded requests as the n-gram chi-square test
    shallow = SpecDecodeParams(proposer="weak", num_speculative_tokens=2, max_tree_nodes=4)  # root: 2 children
    with Client(services.address) as c:
        pairs, drafted = second_token_counts(c, ids, shallow, n, 1.0)
    assert drafted > 0
    seconds = torch.tensor([b for a, b in pairs if a == mode])
    assert len(seconds) > n // 8, "first token too spread for the conditional test"
    assert_chi_square(seconds, p, "draft")


def test_a_draft_with_another_vocabulary_is_refused_with_failed_precondition(tmp_path, lm):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = copy.deepcopy(lm.tokenizer)
    tok.add_tokens(["<not-in-the-target-vocabulary>"])
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    save_draft(LlamaForCausalLM(cfg), tok, tmp_path / "other")
    address, proc = start_draft(tmp_path, str(tmp_path / "other"))
    try:
        target = proposer_pb2.VocabIdentity(vocab_size=49152, tokenizer_hash=tokenizer_hash(lm.tokenizer))
        start = proposer_pb2.ProposeStart(request_id="r", prompt_token_ids=[1, 2, 3], vocab=target)
        with grpc.insecure_channel(address) as ch:
            stream = proposer_pb2_grpc.ProposerServiceStub(ch).Propose(iter([proposer_pb2.ProposeRequest(start=start)]))
            with pytest.raises(grpc.RpcError) as err:
                next(stream)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "vocabulary size 49153 != target's 49152" in err.value.details()
        assert "tokenizer hash" in err.value.details()
    finally:
        proc.terminate()
        proc.wait(30)
