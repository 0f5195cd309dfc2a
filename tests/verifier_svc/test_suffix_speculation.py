"""Speculative decoding with the suffix proposer, which learns from past outputs: greedy output
identical to plain decoding with a warm cache, sampling distributed as the target on suffix
trees, two replicas learning from each other through Redis (and serving on when it dies), and
cache scopes that never leak one scope's outputs into another's proposals.

One verifier serves every process test: ``suffix`` is replica A, ``suffixb`` replica B (two
names, two channels: as two verifiers each with its own replica would see them). Each test
works in scopes of its own, so the tests pass alone and in any order.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from support import (
    VerifierProcess,
    assert_chi_square,
    assert_greedy_equal,
    assert_second_tokens_chi_square,
    assert_wrong_rules_fail,
    greedy_prompt_ids,
    metric,
    second_token_counts,
    seeded_tree_walks,
    start_redis,
    start_verifier,
    stop_redis,
    stop_verifier,
    workload_prompts,
)

from specmesh import Client, SamplingParams, SpecDecodeParams, StructuredOutput
from specmesh.deploy import free_port, wait_healthy

pytestmark = pytest.mark.slow
RUN = uuid.uuid4().hex[:8]  # scopes and the Redis prefix of this run
GREEDY_TOKENS = 16
# A question the model answers in many ways ("I'm sorry…", "I'm ready…"): past outputs that
# differ make a branching tree.
OPEN_QUESTION = "Give me a random number between 1 and 10."


@dataclass
class Replica:
    address: str
    metrics_port: int
    proc: subprocess.Popen
    log_path: Path

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.metrics_port, name, **labels)

    def global_trees(self) -> float:
        """Trees counted (also) from the global cache."""
        return sum(self.metric("specmesh_suffix_trees_total", source=s) for s in ("global", "request+global"))

    def settled(self) -> None:
        """Every Propose stream closed: its trees counted, its output cached (and queued for Redis)."""
        deadline = time.monotonic() + 10
        while self.metric("specmesh_proposer_open_sessions", proposer="suffix"):
            assert time.monotonic() < deadline, f"a stream stayed open:\n{self.log_path.read_text()[-2000:]}"
            time.sleep(0.05)


@dataclass
class Cluster:
    verifier: VerifierProcess
    a: Replica  # proposer "suffix"
    b: Replica  # proposer "suffixb"
    redis_port: int = 0  # 0: no redis-server here (replicas learn from their own streams only)
    redis: list[subprocess.Popen] = field(default_factory=list)  # the one running now


def start_suffix(tmp: Path, name: str, *args: str) -> Replica:
    address, metrics = f"127.0.0.1:{free_port()}", free_port()
    log_path = tmp / f"suffix-{name}.log"
    cmd = [sys.executable, "-m", "specmesh", "serve", "suffix", "--address", address, "--metrics-port", str(metrics)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*cmd, *args], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    try:
        wait_healthy(address, 120, proc)
    except Exception:
        proc.kill()
        raise AssertionError(f"suffix {name} did not start:\n{log_path.read_text(errors='replace')[-3000:]}") from None
    return Replica(address, metrics, proc, log_path)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, lm) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("suffix")
    redis_port, redis, share = 0, [], []
    if shutil.which("redis-server"):
        redis_port = free_port()
        redis.append(start_redis(redis_port))
        share = ["--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--redis-prefix", f"specmesh-suffix-test-{RUN}"]
    procs = list(redis)
    try:
        a = start_suffix(tmp, "a", *share, "--replica-name", "a")
        procs.append(a.proc)
        b = start_suffix(tmp, "b", *share, "--replica-name", "b")
        procs.append(b.proc)
        # Every tree verified (no cost gating) and waited for: every step with a tree exercises it.
        # No Learn: B must learn what A served through Redis alone, as another verifier's replica would.
        v = start_verifier(
            tmp,
            "--proposer", f"suffix={a.address}",
            "--proposer", f"suffixb={b.address}",
            "--spec-gating", "always",
            "--proposer-wait-ms", "200",
            "--learn-outputs", "false",
        )  # fmt: skip
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    c = Cluster(v, a, b, redis_port, redis)
    yield c
    stop_verifier(v)
    for r in (a, b):
        r.proc.kill()
        r.proc.wait(10)
    for proc in c.redis:  # the one running now (a test restarts it)
        stop_redis(proc)


def complete(c: Cluster, ids: list[int], proposer: str, scope: str, n: int = GREEDY_TOKENS, address: str = ""):
    with Client(address or c.verifier.address) as client:
        out = client.complete(
            ids, SamplingParams(temperature=0.0, max_tokens=n), SpecDecodeParams(proposer, cache_scope=scope)
        )
    assert out.summary.finish_reason in ("length", "eos")
    m = out.summary.speculation
    assert not m.fallback_reason, m.fallback_reason  # the proposer served the whole request
    assert m.per_proposer[proposer].drafted_tokens == m.drafted_tokens
    return out


def accepted(out, proposer: str) -> int:
    return out.summary.speculation.per_proposer[proposer].accepted_tokens


# ---------------------------------------------------------------------------------------------
# Greedy: token-identical to plain decoding with a warm cache.


@pytest.fixture(scope="module")
def prompts(chat_ids) -> list[list[int]]:
    return greedy_prompt_ids(chat_ids)


@pytest.fixture(scope="module")
def plain(cluster, prompts) -> dict[tuple[int, ...], list[int]]:
    """The reference: every prompt's plain greedy decoding (proposer none) on the same verifier, 8
    at a time (plain decoding itself is held to transformers' generate by the other tests)."""
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda ids: complete(cluster, ids, "none", "", GREEDY_TOKENS), prompts))
    return {tuple(ids): out.token_ids for ids, out in zip(prompts, outs, strict=True)}


def assert_plain(lm, plain, ids: list[int], out) -> None:
    assert_greedy_equal(lm, ids, out.token_ids, plain[tuple(ids)])


def full_length(prompts, plain) -> list[list[int]]:
    """Prompts whose answer runs to GREEDY_TOKENS (no early EOS): a repeat has that much to accept."""
    return [ids for ids in prompts if len(plain[tuple(ids)]) == GREEDY_TOKENS]


@pytest.fixture(scope="module")
def warm_scope(cluster, prompts, plain, lm) -> str:
    """A scope whose global cache holds every prompt's output: each prompt once through suffix,
    8 at a time (outputs are learned while they are generated, so these already share)."""
    scope = f"greedy-{RUN}"
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda ids: complete(cluster, ids, "suffix", scope, GREEDY_TOKENS), prompts))
    for ids, out in zip(prompts, outs, strict=True):
        assert_plain(lm, plain, ids, out)
    cluster.a.settled()
    return scope


def test_greedy_with_a_warm_suffix_cache_is_token_identical_at_batch_one(cluster, warm_scope, prompts, plain, lm):
    trees = cluster.a.global_trees()
    drafted = hits = 0
    for ids in prompts:
        out = complete(cluster, ids, "suffix", warm_scope, GREEDY_TOKENS)
        assert_plain(lm, plain, ids, out)
        drafted += out.summary.speculation.drafted_tokens
        hits += accepted(out, "suffix")
    cluster.a.settled()
    assert hits > 0 and drafted > 0, "the warm cache was never proposed from: the check is vacuous"
    assert cluster.a.global_trees() > trees  # the trees came from the cache of past outputs


def test_greedy_with_a_warm_suffix_cache_is_token_identical_with_eight_concurrent_requests(
    cluster, warm_scope, prompts, plain, lm
):
    trees = cluster.a.global_trees()
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda ids: complete(cluster, ids, "suffix", warm_scope, GREEDY_TOKENS), prompts))
    for ids, out in zip(prompts, outs, strict=True):
        assert_plain(lm, plain, ids, out)
        # The reference ran these prompts on this verifier: prefix caching (on) found their blocks.
        assert out.summary.cached_tokens == (len(ids) - 1) // 16 * 16
    cluster.a.settled()
    assert sum(accepted(out, "suffix") for out in outs) > 0
    assert cluster.a.global_trees() > trees


# Each stream its own logits control (three without), as the SDK sends them.
CONTROLLED = [
    dict(repetition_penalty=1.3),
    dict(presence_penalty=1.0, frequency_penalty=0.5),
    dict(logit_bias={13: 4.0, 30: -100.0}),
    dict(min_tokens=12),
    dict(allowed_token_ids=tuple(range(200, 30000))),
    {},
    {},
    {},
]


def test_greedy_with_logits_controls_is_token_identical_through_suffix_trees_at_eight_streams_and_one(
    cluster, prompts, lm
):
    """Eight concurrent greedy streams, each with its own control, decoded plain, then twice through
    the suffix proposer in a fresh scope (the first pass fills the cache with the controlled
    outputs, the second is proposed from them), then each controlled prompt alone: all identical."""
    scope = f"controls-{RUN}"

    def run(ids: list[int], kw: dict, proposer: str):
        with Client(cluster.verifier.address) as client:
            params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, **kw)
            return client.complete(ids, params, SpecDecodeParams(proposer, cache_scope=scope))

    batch = prompts[:8]
    with ThreadPoolExecutor(8) as pool:
        plain = list(pool.map(lambda a: run(a[0], a[1], "none"), zip(batch, CONTROLLED, strict=True)))
        for _ in range(2):
            outs = list(pool.map(lambda a: run(a[0], a[1], "suffix"), zip(batch, CONTROLLED, strict=True)))
            for ids, got, want in zip(batch, outs, plain, strict=True):
                assert_greedy_equal(lm, ids, got.token_ids, want.token_ids)
            cluster.a.settled()
    assert sum(accepted(out, "suffix") for out in outs) > 0, "the controlled outputs were never proposed from"
    for ids, kw, want in zip(batch[:5], CONTROLLED[:5], plain[:5], strict=True):
        assert_greedy_equal(lm, ids, run(ids, kw, "suffix").token_ids, want.token_ids)
    assert all(200 <= t < 30000 for t in outs[4].token_ids)


def test_greedy_under_a_grammar_is_token_identical_through_suffix_trees_at_eight_streams_and_one(cluster, chat_ids, lm):
    """Eight concurrent greedy streams, four under a JSON schema, two a regex, two a choice list
    (test_grammar's), through the SDK: decoded plain, then twice through the suffix proposer in a
    fresh scope (the second pass is proposed from the first's constrained outputs), then one of each
    alone: all identical and valid; a grammar that cannot compile is INVALID_ARGUMENT naming it."""
    import grpc
    from test_grammar import PROMPTS, SCHEMA, SPECS, _check

    scope = f"grammar-{RUN}"
    kinds = {"json_schema": lambda s: StructuredOutput(json_schema=s.value), "regex": lambda s: StructuredOutput(
        regex=s.value), "choice": lambda s: StructuredOutput(choice=s.choices)}  # fmt: skip
    grammars = [kinds[s.kind](s) for s in SPECS]
    prompts = [chat_ids(p) for p in PROMPTS]

    def run(ids: list[int], grammar: StructuredOutput, proposer: str):
        with Client(cluster.verifier.address) as client:
            params = SamplingParams(temperature=0.0, max_tokens=64, structured_output=grammar)
            return client.complete(ids, params, SpecDecodeParams(proposer, cache_scope=scope))

    with ThreadPoolExecutor(8) as pool:
        plain = list(pool.map(lambda a: run(*a, "none"), zip(prompts, grammars, strict=True)))
        for _ in range(2):
            outs = list(pool.map(lambda a: run(*a, "suffix"), zip(prompts, grammars, strict=True)))
            for ids, got, want in zip(prompts, outs, plain, strict=True):
                assert_greedy_equal(lm, ids, got.token_ids, want.token_ids)
            cluster.a.settled()
    assert sum(accepted(out, "suffix") for out in outs) > 0, "the constrained outputs were never proposed from"
    for spec, out in zip(SPECS, plain, strict=True):
        assert out.summary.finish_reason == "eos"
        _check(spec, out.text)
    for i in (0, 4, 6):
        assert_greedy_equal(lm, prompts[i], run(prompts[i], grammars[i], "suffix").token_ids, plain[i].token_ids)
    with pytest.raises(grpc.RpcError) as err:
        run(prompts[0], StructuredOutput(json_schema='{"type": "no-such-type"}'), "suffix")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("sampling.structured_output.json_schema: cannot compile")
    assert SCHEMA["additionalProperties"] is False


# ---------------------------------------------------------------------------------------------
# Sampling: every emitted token distributed as the target, on trees from past outputs.


def _logits_after(lm, context: list[int]):
    """paths → the target's logits after ``context`` + each path, ``[len(paths), vocab]``: the
    context's forward once, then one right-padded forward of the paths on copies of its KV cache
    (causal: the padding never reaches a real position)."""
    import copy

    import torch

    with torch.inference_mode():
        first = lm.model(torch.tensor([context]), use_cache=True)
    root = first.logits[0, -1].float()

    def after(paths: list[list[int]]) -> torch.Tensor:
        rows = [root] * len(paths)
        todo = [i for i, p in enumerate(paths) if p]
        if todo:
            n = max(len(paths[i]) for i in todo)
            cache = copy.deepcopy(first.past_key_values)
            cache.batch_repeat_interleave(len(todo))
            batch = torch.tensor([paths[i] + [0] * (n - len(paths[i])) for i in todo])
            with torch.inference_mode():
                logits = lm.model(batch, cache=cache).logits.float()
            for j, i in enumerate(todo):
                rows[i] = logits[j, len(paths[i]) - 1]
        return torch.stack(rows)

    return after


def _top_paths(after, depth: int, width: int = 2) -> list[tuple[list[int], float]]:
    """The ``width`` most probable tokens at every node, ``depth`` levels deep: (path, probability)."""
    import torch

    paths: list[tuple[list[int], float]] = [([], 1.0)]
    for _ in range(depth):
        rows = after([p for p, _ in paths]).softmax(-1)
        paths = [
            ([*p, int(t)], w * float(q))
            for (p, w), row in zip(paths, rows, strict=True)
            for q, t in zip(*torch.topk(row, width), strict=True)
        ]
    return paths


def test_suffix_tree_acceptance_on_the_real_logits_emits_the_target_softmax_at_every_node_chi_square(lm, chat_ids):
    """The verifier's sampled acceptance on a branching tree that the suffix core built from its
    global cache, with the real model's logits at every node, walked for 20,000 seeds: the token
    emitted after each node, given that the walk accepted exactly that node's path, follows the
    target's softmax there (p = 0.001 per node reached by at least 1,000 walks). Negative controls:
    rules that accept drafts too often or forget the residual fail the same test on 2,000 seeds.

    The cache holds what past requests with this prompt answered: its 16 top-2 continuations 4
    tokens deep, each as often as the target would sample it (in 40 requests), so the tree
    branches at several depths and its nodes are ones the target really accepts."""
    import torch

    from proposer_svc.suffix.cache import SuffixCache
    from proposer_svc.suffix.config import SuffixConfig
    from proposer_svc.suffix.request import SuffixRequest
    from specmesh_server.tree import TokenTree, depths
    from verifier_svc.acceptance import children_lists

    n = 20_000
    ids = chat_ids(OPEN_QUESTION)
    after_prompt = _logits_after(lm, ids)
    first = int(after_prompt([[]])[0].argmax())
    answer = [first, int(after_prompt([[first]])[0].argmax())]  # the answer's first tokens (greedy)
    context = ids + answer

    def after(paths: list[list[int]]) -> torch.Tensor:  # the logits after context + each path
        return after_prompt([answer + p for p in paths])

    cache = SuffixCache(SuffixConfig(), background=False)
    for path, p in _top_paths(after, depth=4):
        for _ in range(round(40 * p)):
            past = SuffixRequest(cache, "tenant")
            past.extend(ids)  # the prompt (not cached)
            past.extend(context[len(ids) :] + path)  # the output
            past.close()
    request = SuffixRequest(cache, "tenant")
    request.extend(context)
    proposal = request.propose(max_nodes=16, max_depth=4)
    tokens, parents = proposal.tokens, proposal.parents
    kids = children_lists(parents)
    assert proposal.source == "global", proposal
    assert len(kids[0]) >= 2 and any(len(k) >= 2 for k in kids[1:]), f"premise: a branching tree, {parents}"
    assert max(depths(parents)) == 4, f"premise: 4 levels, {parents}"
    elsewhere = SuffixRequest(cache, "another tenant")
    elsewhere.extend(context)
    assert not elsewhere.propose(max_nodes=16, max_depth=4).tokens  # the tree is the scope's past outputs

    def path_to(node: int) -> list[int]:
        out = []
        while node != -1:
            out.append(tokens[node])
            node = parents[node]
        return out[::-1]

    tree = TokenTree(tokens, parents)
    logits = after([[]] + [path_to(i) for i in range(len(tokens))])  # rows: the root, then each node
    probs, out, emitted = seeded_tree_walks(tree, context, logits, "suffix", n)

    tested = Counter()
    for index in range(len(tokens) + 1):  # index 0: the root; index i: tree node i - 1
        prefix = path_to(index - 1) if index else []
        d = len(prefix)
        sample = torch.tensor([e[d] for e in out if len(e) > d and e[:d] == prefix])
        if len(sample) >= 1_000:
            assert_chi_square(sample, probs[index], f"token after {prefix} ({len(sample)} walks)")
            tested[d] += 1
    branching = [i for i, k in enumerate(kids) if len(k) >= 2]
    assert set(tested) >= {0, 1, 2, 3}, f"nodes tested per depth: {dict(tested)}"
    assert sum(tested.values()) >= 6 and len(branching) >= 2, (dict(tested), branching)

    assert_wrong_rules_fail(probs, out, emitted)


def test_sampled_second_tokens_verified_on_suffix_trees_follow_the_target_softmax_chi_square(cluster, lm, chat_ids):
    """End to end through the processes: a few answers to a question warm a scope; then seeded
    2-token requests whose prompt ends inside that answer ("I'm"), the second token decided by
    verifying the suffix tree proposed after the first, tested against the target's softmax after
    the first token (stratified by it). Catches wiring (seeds, temperature, trees from the cache)."""
    n, scope = 200, f"sampled-{RUN}"
    spec = SpecDecodeParams("suffix", cache_scope=scope)
    ids = chat_ids(OPEN_QUESTION)
    with Client(cluster.verifier.address) as c, ThreadPoolExecutor(8) as pool:
        warm = [SamplingParams(temperature=0.0, max_tokens=12)]
        warm += [SamplingParams(temperature=1.0, seed=10_000 + s, max_tokens=12) for s in range(5)]
        first, *_ = pool.map(lambda p: c.complete(ids, p, spec), warm)  # every one done
        prompt = ids + first.token_ids[:2]  # the greedy answer's first tokens
        pairs, drafted = second_token_counts(c, prompt, spec, n, 1.0)
    assert drafted >= n // 4, f"too few second steps verified a tree ({drafted} drafted tokens)"
    tested = assert_second_tokens_chi_square(lm, prompt, pairs, 1.0, "suffix")
    assert tested >= n // 3, f"first token too spread ({tested} of {n} tested)"


# ---------------------------------------------------------------------------------------------
# Replicas sharing one Redis; scopes.


def test_an_output_through_replica_a_is_proposed_by_replica_b_and_both_serve_on_when_redis_dies(
    cluster, prompts, plain, lm
):
    if not cluster.redis_port:
        pytest.skip("needs the redis-server binary")
    a, b = cluster.a, cluster.b
    scope = f"shared-{RUN}"
    learned, *fresh = full_length(prompts, plain)[:3]
    b.settled()
    trees = b.global_trees()

    assert_plain(lm, plain, learned, complete(cluster, learned, "suffix", scope))  # through A only
    a.settled()
    published = a.metric("specmesh_suffix_shared_outputs_total", direction="out")  # every output A finished
    assert published >= 1
    deadline = time.monotonic() + 15
    while b.metric("specmesh_suffix_shared_outputs_total", direction="in") < published:
        assert time.monotonic() < deadline, f"B did not ingest A's outputs:\n{b.log_path.read_text()[-2000:]}"
        time.sleep(0.1)
    repeat = complete(cluster, learned, "suffixb", scope)  # B never served this scope itself
    assert_plain(lm, plain, learned, repeat)
    b.settled()
    assert accepted(repeat, "suffixb") > 0, "B did not propose A's output"
    assert b.global_trees() > trees

    # Redis dies while requests run through both replicas: they complete, identical to plain decoding.
    work = [("suffix", fresh[0]), ("suffixb", fresh[1]), ("suffix", learned), ("suffixb", learned)]
    with ThreadPoolExecutor(len(work)) as pool:
        futures = [pool.submit(complete, cluster, ids, name, scope, GREEDY_TOKENS) for name, ids in work]
        deadline = time.monotonic() + 60
        while not all(r.metric("specmesh_proposer_open_sessions", proposer="suffix") for r in (a, b)):
            assert time.monotonic() < deadline, "the requests never reached both replicas"
            time.sleep(0.02)
        stop_redis(cluster.redis.pop())
        outs = [f.result(timeout=300) for f in futures]
    for (_, ids), done in zip(work, outs, strict=True):
        assert_plain(lm, plain, ids, done)
    assert a.proc.poll() is None and b.proc.poll() is None
    b.settled()
    trees = b.global_trees()
    again = complete(cluster, learned, "suffixb", scope)  # B keeps proposing from its cache
    assert_plain(lm, plain, learned, again)
    b.settled()
    assert accepted(again, "suffixb") > 0 and b.global_trees() > trees
    assert "unreachable" in b.log_path.read_text()  # B did lose Redis, and said so

    # Redis returns (empty): the outputs B finished meanwhile reach A.
    shared_in = a.metric("specmesh_suffix_shared_outputs_total", direction="in")
    cluster.redis.append(start_redis(cluster.redis_port))
    deadline = time.monotonic() + 30
    while a.metric("specmesh_suffix_shared_outputs_total", direction="in") <= shared_in:
        assert time.monotonic() < deadline, f"A never caught up:\n{a.log_path.read_text()[-2000:]}"
        time.sleep(0.2)


def test_a_scope_is_never_proposed_from_another_scopes_outputs(cluster, prompts, plain, lm, chat_ids):
    a = cluster.a
    questions = [chat_ids(t) for t in workload_prompts(per_category=4, max_chars=600, categories=("qa",))]
    ids = next(q for q in questions if q in full_length(prompts, plain))  # an answer that copies little of its prompt
    in_y, in_x = f"scope-y-{RUN}", f"scope-x-{RUN}"
    assert_plain(lm, plain, ids, complete(cluster, ids, "suffix", in_y, GREEDY_TOKENS))
    a.settled()
    before = {s: a.metric("specmesh_suffix_trees_total", source=s) for s in ("global", "request+global")}
    sent = a.metric("specmesh_proposals_total", proposer="suffix")

    # The same request in scope X: Y's output is not there.
    out_x = complete(cluster, ids, "suffix", in_x, GREEDY_TOKENS)
    assert_plain(lm, plain, ids, out_x)
    a.settled()
    assert a.metric("specmesh_proposals_total", proposer="suffix") > sent  # X's stream did get (other) trees
    assert {s: a.metric("specmesh_suffix_trees_total", source=s) for s in before} == before

    # The same request in scope Y again: its past output is proposed.
    out_y = complete(cluster, ids, "suffix", in_y, GREEDY_TOKENS)
    assert_plain(lm, plain, ids, out_y)
    a.settled()
    assert a.global_trees() > sum(before.values())
    assert accepted(out_y, "suffix") > accepted(out_x, "suffix")


def test_an_output_another_proposer_served_is_learnt_by_the_suffix_tier(
    cluster, tmp_path, prompts, plain, lm, chat_ids
):
    """All traffic, not only the suffix tier's own: a second verifier, with in-process n-gram and
    replica A, sends A (Learn) the output of a request that n-gram served; the same request through
    A in that scope is then proposed from the global cache, and accepts more than in a fresh scope."""
    a = cluster.a
    questions = [chat_ids(t) for t in workload_prompts(per_category=4, max_chars=600, categories=("qa",))]
    ids = next(q for q in questions if q in full_length(prompts, plain))  # an answer that copies little of its prompt
    scope, fresh = f"learn-{RUN}", f"learn-fresh-{RUN}"
    v = start_verifier(
        tmp_path,
        "--proposer", "ngram=inprocess:ngram",
        "--proposer", f"suffix={a.address}",
        "--spec-gating", "always",
        "--proposer-wait-ms", "200",
    )  # fmt: skip
    try:
        learned = a.metric("specmesh_suffix_learned_outputs_total")
        assert_plain(lm, plain, ids, complete(cluster, ids, "ngram", scope, address=v.address))
        deadline = time.monotonic() + 10
        while a.metric("specmesh_suffix_learned_outputs_total") <= learned:
            assert time.monotonic() < deadline, f"A never learnt the n-gram request's output:\n{v.log()[-2000:]}"
            time.sleep(0.05)
        a.settled()
        before = a.global_trees()
        again = complete(cluster, ids, "suffix", scope, address=v.address)
        assert_plain(lm, plain, ids, again)
        a.settled()
        assert a.global_trees() > before
        cold = complete(cluster, ids, "suffix", fresh, address=v.address)
        assert_plain(lm, plain, ids, cold)
        assert accepted(again, "suffix") > accepted(cold, "suffix")
    finally:
        stop_verifier(v)
