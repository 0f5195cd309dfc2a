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
    accepts_drafts_too_often,
    assert_chi_square,
    assert_greedy_equal,
    assert_second_tokens_chi_square,
    forgets_the_residual,
    on_cpu,
    second_token_counts,
    start_verifier,
    stop_verifier,
    workload_prompts,
)

from proposer_svc.draft.distill import save_draft, truncate_layers
from specmesh import Client, SamplingParams, SpecDecodeParams
from specmesh.deploy import free_port, wait_healthy
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc
from specmesh_server.model_loading import tokenizer_hash

pytestmark = pytest.mark.slow
SELF = SpecDecodeParams(proposer="draft", num_speculative_tokens=4, max_tree_nodes=8)
WEAK = SpecDecodeParams(proposer="weak", num_speculative_tokens=4, max_tree_nodes=8)
QUANTIZED = SpecDecodeParams(proposer="gguf", num_speculative_tokens=4, max_tree_nodes=8)


def start_draft(log_dir: Path, model: str | None, *args: str) -> tuple[str, subprocess.Popen]:
    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "specmesh", "serve", "draft", "--address", address, "--threads", "1", *on_cpu(args)]
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
    gguf_addr, gguf_proc = start_draft(logs, None, "--weights", "gguf")  # the shipped file's own blocks
    # A draft-model proposal takes ~70 ms on this CPU: let the verifier wait for it (the default 5 ms
    # suits the n-gram proposer).
    v = start_verifier(
        logs,
        "--proposer", f"draft={self_addr}",
        "--proposer", f"weak={weak_addr}",
        "--proposer", f"gguf={gguf_addr}",
        "--spec-gating", "always",
        "--proposer-wait-ms", "10000",
        "--proposer-timeout", "60",
    )  # fmt: skip
    yield v
    stop_verifier(v)
    for p in (self_proc, weak_proc, gguf_proc):
        p.terminate()
        p.wait(30)


@pytest.fixture(scope="module")
def prompts(chat_ids):
    return [chat_ids(t) for t in workload_prompts(per_category=1, max_chars=400)][:2]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _one_by_one(lm, address: str, prompts, hf_greedy, spec: SpecDecodeParams) -> list:
    """Each prompt's 16 greedy tokens with ``spec``, one request at a time, equal to ``generate()``'s and
    speculated without a fallback; their speculation summaries."""
    out = []
    with Client(address) as c:
        for ids in prompts:
            done = c.complete(ids, _greedy(16), spec)
            assert_greedy_equal(lm, ids, done.token_ids, hf_greedy(ids, 16))
            m = done.summary.speculation
            assert not m.fallback_reason and m.steps > 0
            out.append(m)
    return out


def test_greedy_with_the_target_as_its_own_draft_is_identical_and_accepts_whole_paths(lm, services, prompts, hf_greedy):
    for m in _one_by_one(lm, services.address, prompts, hf_greedy, SELF):
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


def test_a_draft_on_the_gguf_blocks_keeps_the_output_plain_greedy_and_guesses_the_target_well(
    lm, services, prompts, hf_greedy
):
    """``--weights gguf``: the draft runs on the shipped file's Q4_1 / Q8_0 blocks (its start-up line says so);
    the float32 target's output is still plain greedy decoding's, and its own quantized copy guesses it well."""
    logs = [p.read_text() for p in services.log_path.parent.glob("draft-*.log")]
    assert sum("draft: weights: the GGUF's own blocks from" in text for text in logs) == 1, logs
    ms = _one_by_one(lm, services.address, prompts, hf_greedy, QUANTIZED)
    drafted, accepted, steps = (sum(getattr(m, k) for m in ms) for k in ("drafted_tokens", "accepted_tokens", "steps"))
    # depth-4 trees: more than half of each path accepted (measured: 24 tokens over 9 steps, the float32
    # self-draft nearly 4 a step)
    assert accepted >= 2 * steps, (accepted, drafted, steps)


def test_gguf_weights_draft_on_the_cpu_in_float32():
    from proposer_svc.draft.server import build_flags, parse_args

    assert parse_args(["--weights", "gguf"]).weights == "gguf"
    assert parse_args([]).weights == "fp32"
    for other in (["--device", "cuda"], ["--dtype", "bfloat16"]):
        with pytest.raises(SystemExit):
            parse_args(["--weights", "gguf", *other])
    assert "--weights" in build_flags().parser.format_help()


COLORS = "The three primary colors are red, blue and"
SHALLOW = SpecDecodeParams(proposer="weak", num_speculative_tokens=1, max_tree_nodes=2)  # root: 2 children


def test_sampled_tokens_with_the_draft_follow_the_target_softmax_chi_square(lm, services):
    """End to end through the processes: seeded 2-token requests, the second token decided by
    verifying the 2-layer draft's sampled tree, tested against the target's softmax after the
    first token (stratified by it). The acceptance rule itself gets its large-sample test, with
    negative controls, on tensors below; this one catches wiring (the draft's q and noise, seeds,
    counters, temperature) with 400 requests."""
    ids = lm.tokenizer.encode(COLORS)
    n = 400
    with Client(services.address) as c:
        pairs, drafted = second_token_counts(c, ids, SHALLOW, n, 1.0)
    assert drafted > 0
    tested = assert_second_tokens_chi_square(lm, ids, pairs, 1.0, "draft")
    assert tested >= n // 3, f"first token too spread ({tested} of {n} tested)"


def test_draft_tree_acceptance_on_the_real_logits_emits_the_target_softmax_chi_square(lm):
    """The verifier's sampled acceptance, on the real target's logits and the 2-layer draft's real
    q (both computed once), for 20,000 seeds: each seed's root children drawn as the draft server
    draws them (its noise stream, Gumbel-top-k without replacement, sibling distributions), then
    walked. The emitted token follows the target's softmax (p = 0.001). Negative controls: rules
    that accept drafts too often or forget the residual fail the same test on 2,000 seeds."""
    import torch

    from proposer_svc.core.tree_search import (
        DraftConfig,
        gumbel_order,
        proposal_distribution,
        sampling_template,
        sibling_distribution,
    )
    from proposer_svc.draft.distill import truncate_layers
    from proposer_svc.draft.proposer import _DRAFT_SEED_MIX
    from specmesh_server.sampling import uniform
    from specmesh_server.tree import TokenTree
    from verifier_svc.acceptance import acceptance_uniforms, sample_accept, walk_shape
    from verifier_svc.batch_accept import accept_batch, target_probs
    from verifier_svc.requests import GenerationRequest, SpecParams

    n, cfg = 20_000, DraftConfig()
    template = sampling_template(SHALLOW.max_tree_nodes, SHALLOW.num_speculative_tokens, cfg.width, cfg.branch)
    assert template == [[2]], "premise: the end-to-end request's tree is 2 root children"
    width = template[0][0]
    ids = lm.tokenizer.encode(COLORS)
    weak = truncate_layers(copy.deepcopy(lm.model), 2)
    one = torch.ones(1)
    with torch.inference_mode():
        context = [*ids, int(lm.model(torch.tensor([ids])).logits[0, -1].argmax())]
        q_ids, q_p = proposal_distribution(
            weak(torch.tensor([context])).logits[0, -1:].float(), one, one, torch.zeros(1, dtype=torch.long),
            cfg.q_support, cfg.q_floor,
        )  # fmt: skip
        support = q_ids[0].tolist()  # every token a child can be: the target's rows after each, in one forward
        logits = torch.cat(
            [
                lm.model(torch.tensor([context])).logits[0, -1:],
                lm.model(torch.tensor([[*context, x] for x in support])).logits[:, -1],
            ]
        ).float()  # [1 + T, V]
    spec = SpecParams(proposer="weak", num_speculative_tokens=1, max_tree_nodes=2, workload_tag="", corpus="")
    sampled = dict(temperature=1.0, top_p=1.0, top_k=0, max_tokens=8, stop=(), ignore_eos=True, spec_params=spec)
    reqs = [GenerationRequest(str(s), context, seed=s, **sampled) for s in range(32)]
    probs = target_probs(logits, reqs[:1], [len(logits)]).double()
    # The draft server's root draw for each seed: its counter (context length * 1024 + depth 1), salts 1..T.
    t = len(support)
    seeds = (torch.arange(n) ^ _DRAFT_SEED_MIX) & 0x7FFFFFFFFFFFFFFF
    counters = torch.full((n * t,), len(context) * 1024 + 1)
    noise = uniform(seeds.repeat_interleave(t), counters, torch.arange(t).repeat(n) + 1)
    order = gumbel_order(q_p.expand(n, t), noise.view(n, t))
    drawn_ids, drawn_p = q_ids[0][order].tolist(), q_p[0].double()[order].tolist()
    trees = [
        TokenTree(ids_s[:width], [-1] * width, [sibling_distribution(ids_s, p_s, j) for j in range(width)])
        for ids_s, p_s in zip(drawn_ids, drawn_p, strict=True)
    ]
    rows = [[0, *(1 + support.index(x) for x in tree.tokens)] for tree in trees]  # the walk's target rows
    u = acceptance_uniforms(torch.arange(n), torch.full((n,), len(context)), *walk_shape(trees[0])).numpy()

    table = probs.numpy()  # numpy's row gather is much cheaper than torch's for one small walk

    def emitted(rule, count: int) -> torch.Tensor:
        walks = ((trees[s], rule(trees[s], torch.from_numpy(table[rows[s]]), u[s])) for s in range(count))
        return torch.tensor([tree.tokens[path[0]] if path else bonus for tree, (path, bonus) in walks])

    seconds = emitted(sample_accept, n)
    # This walk is the engine's acceptance dispatch draw for draw (probabilities, seeds, counters).
    k = len(reqs)
    batch_logits = logits[[r for s in range(k) for r in rows[s]]]
    batch = accept_batch(reqs, [len(context)] * k, trees[:k], batch_logits, [1 + width] * k)
    firsts = [trees[s].tokens[path[0]] if path else bonus for s, (path, bonus) in enumerate(batch)]
    assert firsts == seconds[:k].tolist()
    assert_chi_square(seconds, probs[0], f"draft, {n} seeds")

    control = 2_000
    assert_chi_square(seconds[:control], probs[0], "the right rule, control size")
    for rule in (accepts_drafts_too_often, forgets_the_residual):
        with pytest.raises(AssertionError, match="chi2"):
            assert_chi_square(emitted(rule, control), probs[0], rule.__name__)


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
