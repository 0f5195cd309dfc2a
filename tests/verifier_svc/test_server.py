"""The verifier as a real gRPC process: greedy equality with transformers, concurrency and
cancellation, input validation, admission limits, health, reflection, admin and SIGTERM drain."""

import itertools
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support import assert_greedy_equal, start_verifier, stop_verifier, workload_prompts

from specmesh import Client, SamplingParams, SpecDecodeParams
from specmesh.v1 import admin_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def client(verifier):
    with Client(verifier.address) as c:
        yield c


@pytest.fixture(scope="module")
def prompts(chat_ids):
    texts = workload_prompts(per_category=1, max_chars=1500)[:8]
    return [(t, chat_ids(t)) for t in texts]


def test_greedy_single_stream_is_token_identical_to_transformers_generate(lm, client, prompts, hf_greedy):
    for _, ids in prompts[:4]:
        out = client.complete(ids, _greedy(32))
        assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, 32))
        assert out.summary.completion_tokens == len(out.token_ids)


def test_greedy_eight_concurrent_streams_are_token_identical(lm, client, prompts, hf_greedy):
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: client.complete(p[1], _greedy(32)), prompts))
    for (_, ids), out in zip(prompts, outs, strict=True):
        assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, 32))


def test_text_and_chat_inputs_stream_text_that_matches_the_tokens(lm, client, prompts):
    text, ids = prompts[0]
    chunks = list(stream := client.generate(text, _greedy(24), chat=True))
    tokens = [t for c in chunks for t in c.token_ids]
    assert stream.summary.prompt_tokens == len(ids)
    assert "".join(c.text for c in chunks) == lm.tokenizer.decode(tokens, skip_special_tokens=True)
    raw = client.complete("The capital of France is", _greedy(5))
    assert raw.summary.finish_reason == "length" and len(raw.token_ids) == 5


def test_sixteen_mixed_requests_complete_and_a_cancelled_one_frees_its_slot(lm, client, prompts, hf_greedy):
    jobs = [(ids, 4 + 3 * i) for i, (_, ids) in enumerate(prompts * 2)][:15]
    victim = client.generate(prompts[0][1], _greedy(300, ignore_eos=True))
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(client.complete, ids, _greedy(n)) for ids, n in jobs]
        got = 0
        for chunk in victim:
            got += len(chunk.token_ids)
            if got >= 3:
                victim.cancel()
                break
        outs = [f.result(timeout=300) for f in futures]
    for (ids, n), out in zip(jobs, outs, strict=True):
        assert_greedy_equal(lm, ids, out.token_ids, hf_greedy(ids, n))
    deadline = time.time() + 10
    while (stats := client.stats().server).running_requests and time.time() < deadline:
        time.sleep(0.1)
    assert stats.running_requests == 0 and stats.waiting_requests == 0
    assert stats.cancelled_requests >= 1


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({}, "input"),
        ({"text": ""}, "input.text"),
        ({"text": "word " * 9000}, "input.text"),
        ({"text": "hi", "sampling": {"max_tokens": -1}}, "sampling.max_tokens"),
        ({"text": "hi", "sampling": {"temperature": -1}}, "sampling.temperature"),
        ({"text": "hi", "sampling": {"top_p": 0}}, "sampling.top_p"),
        ({"text": "hi", "sampling": {"top_p": 1.01}}, "sampling.top_p"),
        ({"text": "hi", "spec_decode": {"proposer": "eagle9"}}, "spec_decode.proposer"),
        ({"text": "hi", "spec_decode": {"num_speculative_tokens": 2**31 - 1}}, "spec_decode.num_speculative_tokens"),
        ({"text": "hi", "spec_decode": {"max_tree_nodes": 2**31 - 1}}, "spec_decode.max_tree_nodes"),
        ({"text": "hi", "spec_decode": {"corpus": "x" * 65}}, "spec_decode.corpus"),
    ],
)
def test_bad_input_gets_invalid_argument_naming_the_field_and_server_keeps_serving(
    verifier, client, request_kwargs, field
):
    with grpc.insecure_channel(verifier.address) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(generation_pb2.GenerateRequest(**request_kwargs)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)
    assert len(client.complete("Hello", _greedy(2)).token_ids) == 2


def test_unconfigured_proposer_is_failed_precondition(client):
    with pytest.raises(grpc.RpcError) as err:
        client.complete("hi", _greedy(2), SpecDecodeParams(proposer="ngram"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_two_clients_with_one_request_id_do_not_cancel_each_other(lm, client, prompts, hf_greedy):
    """The engine filed requests under the client's request_id: the second "dup" replaced the first,
    so cancelling the first cancelled the second (which then never ended) and left the first running."""
    cancelled_before = client.stats().server.cancelled_requests
    victim = client.generate(prompts[0][1], _greedy(300, ignore_eos=True), request_id="dup")
    victim_chunks = iter(victim)
    next(victim_chunks)  # admitted and running before the second arrives
    ids = prompts[1][1]
    survivor = client.generate(ids, _greedy(24), request_id="dup", timeout=120)
    chunks = iter(survivor)
    tokens = list(next(chunks).token_ids)
    victim.cancel()
    tokens += [t for chunk in chunks for t in chunk.token_ids]
    assert survivor.request_id == "dup" and survivor.summary.completion_tokens == len(tokens)
    assert_greedy_equal(lm, ids, tokens, hf_greedy(ids, 24))
    _wait_idle(client)  # the cancelled one is gone too
    assert client.stats().server.cancelled_requests == cancelled_before + 1


def test_an_oversized_request_id_is_invalid_argument(verifier, client):
    """A 1 MB request_id was accepted and echoed in every response chunk (17.8 MB for 16 tokens)."""
    from verifier_svc.requests import MAX_REQUEST_ID_CHARS

    with grpc.insecure_channel(verifier.address) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        request = generation_pb2.GenerateRequest(text="hi", request_id="x" * 2**20, sampling=_greedy(16).to_proto())
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request_id") and f"at most {MAX_REQUEST_ID_CHARS}" in err.value.details()
    assert len(client.complete("Hello", _greedy(2)).token_ids) == 2


def test_seeded_sampling_is_reproducible_and_the_seed_matters(client, prompts):
    ids = prompts[1][1]
    a = client.complete(ids, SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=24))
    b = client.complete(ids, SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=24))
    c = client.complete(ids, SamplingParams(temperature=1.0, top_p=0.95, seed=12, max_tokens=24))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_sampled_first_tokens_follow_the_target_softmax_chi_square(lm, client, chat_ids):
    import torch

    ids = chat_ids("Name one random animal.")
    temperature, n = 1.5, 300
    with torch.inference_mode():
        p = torch.softmax(lm.model(torch.tensor([ids])).logits[0, -1].float() / temperature, -1)
    with ThreadPoolExecutor(16) as pool:
        firsts = list(
            pool.map(
                lambda s: client.complete(ids, SamplingParams(temperature=temperature, seed=s, max_tokens=1)).token_ids[
                    0
                ],
                range(n),
            )
        )
    counts = torch.bincount(torch.tensor(firsts), minlength=p.numel()).double()
    expected = p.double() * n
    big = expected >= 5  # chi-square buckets: every token expected >= 5 times, the rest pooled
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    dof = int(big.sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert dof >= 3, "prompt too peaked for a meaningful test"
    # p = 0.001 critical value via Wilson-Hilferty
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3
    assert chi2 < crit, f"chi2 {chi2:.1f} over {dof} dof (critical {crit:.1f})"


def test_health_and_reflection_answer_for_every_service(verifier):
    with grpc.insecure_channel(verifier.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "specmesh.v1.GenerationService", "specmesh.v1.AdminService"):
            assert (
                health.Check(health_pb2.HealthCheckRequest(service=name)).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
    assert {"specmesh.v1.GenerationService", "specmesh.v1.AdminService", "grpc.health.v1.Health"} <= names


def test_admin_switches_policy_at_runtime_and_reports_stats(client):
    off = client.set_policy(admin_pb2.SpeculationPolicy(mode=admin_pb2.POLICY_MODE_OFF))
    assert off.mode == admin_pb2.POLICY_MODE_OFF
    out = client.complete("Hello", _greedy(3))
    assert out.summary.speculation.fallback_reason == "speculation is off by the server policy"
    with pytest.raises(grpc.RpcError) as err:
        client.set_policy(admin_pb2.SpeculationPolicy(mode=admin_pb2.POLICY_MODE_FIXED, proposer="ngram"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client.set_policy(admin_pb2.SpeculationPolicy(mode=admin_pb2.POLICY_MODE_AUTO))
    client.complete("Hello", _greedy(3))  # the same prompt again: a prefix-cache query
    stats = client.stats()
    assert stats.server.generated_tokens > 0 and stats.server.model == "smollm2-135m-instruct"
    assert stats.policy.mode == admin_pb2.POLICY_MODE_AUTO
    s = stats.server
    assert s.kv_block_size == 16 and s.kv_blocks_in_use <= s.kv_blocks and s.kv_blocks > 0
    assert s.prefix_cache_queries >= s.prefix_cache_hits and s.prefix_cache_queries > 0


def test_admin_policy_knobs_beyond_the_servers_limits_are_invalid_argument_naming_field_and_limit(client):
    from specmesh_router.policy import PolicyLimits

    limits = PolicyLimits()  # the verifier's defaults (RequestLimits)
    for knob, limit in (
        ("num_speculative_tokens", limits.max_speculative_tokens),
        ("max_tree_nodes", limits.max_tree_nodes),
    ):
        with pytest.raises(grpc.RpcError) as err:
            client.set_policy(admin_pb2.SpeculationPolicy(mode=admin_pb2.POLICY_MODE_AUTO, **{knob: 2**31 - 1}))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"policy.{knob}: must be in [0, {limit}]"), err.value.details()
    assert client.stats().policy.num_speculative_tokens == 0  # the policy is unchanged


def test_a_tiny_temperature_gives_exactly_the_greedy_output(client, prompts):
    ids = prompts[0][1]
    tiny = client.complete(ids, SamplingParams(temperature=1e-45, seed=3, max_tokens=6))  # logits / t overflow
    assert tiny.token_ids == client.complete(ids, _greedy(6)).token_ids


def test_malformed_request_bytes_are_invalid_argument_without_a_traceback(verifier, client):
    with grpc.insecure_channel(verifier.address) as ch:
        generate = ch.unary_stream("/specmesh.v1.GenerationService/Generate")  # raw bytes
        set_policy = ch.unary_unary("/specmesh.v1.AdminService/SetPolicy")
        bad_utf8 = generation_pb2.GenerateRequest(text="ab").SerializeToString().replace(b"ab", b"\xff\xfe")
        for call, raw in ((generate, b"\xff\xff\xff"), (generate, bad_utf8), (set_policy, b"\x0a\x05\x12")):
            with pytest.raises(grpc.RpcError) as err:
                list(call(raw, timeout=30)) if call is generate else call(raw, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert len(client.complete("Hello", _greedy(2)).token_ids) == 2
    log = verifier.log()
    assert log.count("malformed request message") == 3
    assert "Traceback" not in log and "Unexpected" not in log


def test_metrics_count_every_request_outcome_once(tmp_path, lm):
    from urllib.request import urlopen

    from specmesh.deploy import free_port

    port = free_port()
    v = start_verifier(tmp_path, "--max-running", "1", "--max-waiting", "0", "--metrics-port", str(port))
    long = _greedy(1500, ignore_eos=True)
    try:
        with Client(v.address) as c, grpc.insecure_channel(v.address) as ch:
            c.complete("hi", _greedy(2))  # ok
            with pytest.raises(grpc.RpcError):
                c.complete("hi", SamplingParams(top_p=0.0))  # invalid
            held = c.generate("Count to one hundred.", long, chat=True)
            next(iter(held))
            with pytest.raises(grpc.RpcError) as err:
                c.complete("hi", _greedy(2))  # rejected: the one slot is taken, no queue
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            held.cancel()  # cancelled
            _wait_idle(c)
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            request = generation_pb2.GenerateRequest(text="Count to one hundred.", sampling=long.to_proto())
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, timeout=1.0))  # deadline_exceeded
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            _wait_idle(c)
        text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        counts = {
            status: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("specmesh_requests_total{")  # {model="…",status="…"}
            for status in [line.split('status="')[1].split('"')[0]]
        }
        assert counts == {"ok": 1, "invalid": 1, "rejected": 1, "cancelled": 1, "deadline_exceeded": 1, "error": 0}, (
            counts
        )
    finally:
        stop_verifier(v)


def _wait_idle(c: Client) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:  # the cancellation reaches the engine
        server = c.stats().server
        if server.running_requests + server.waiting_requests == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the server never became idle: {server}")


def test_too_many_concurrent_requests_get_resource_exhausted(tmp_path, lm):
    v = start_verifier(tmp_path, "--max-running", "1", "--max-waiting", "1")
    try:
        with Client(v.address) as c:
            # Long enough (1500 tokens) that neither finishes while the test fills the server.
            # The second is sent only once the first runs: sent together, the server may take them in
            # either order, and the first's first token would come only after the second finished.
            first = c.generate("Count to one hundred.", _greedy(1500, ignore_eos=True), chat=True)
            next(iter(first))
            long = [first, c.generate("Count to one hundred.", _greedy(1500, ignore_eos=True), chat=True)]
            deadline = time.time() + 30
            while time.time() < deadline:  # both admitted: one running, one waiting
                server = c.stats().server
                if server.running_requests + server.waiting_requests == 2:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"the two long requests were never both admitted: {server}")
            with pytest.raises(grpc.RpcError) as err:
                c.complete("hi", _greedy(2))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for s in long:
                s.cancel()
            deadline = time.time() + 30
            while time.time() < deadline:  # the cancellations reach the engine
                server = c.stats().server
                if server.running_requests + server.waiting_requests == 0:
                    break
                time.sleep(0.05)
            assert len(c.complete("hi", _greedy(2)).token_ids) == 2  # capacity is back
    finally:
        stop_verifier(v)


def test_sigterm_drains_the_in_flight_request_then_cuts_what_outlives_the_grace(tmp_path, lm):
    """SIGTERM: no new work; a request that ends within --grace finishes. One that does not is cut
    when the grace runs out: UNAVAILABLE telling its client to retry elsewhere, one warning line for
    the drain. (gRPC cancelling it instead gave "Cancelling all calls" and logged an ERROR
    CancelledError traceback per stream.)"""
    from specmesh_server.serving import RETRY_ELSEWHERE

    v = start_verifier(tmp_path, "--grace", "8")
    with Client(v.address) as c:
        stream = c.generate("Tell me a long story.", _greedy(16, ignore_eos=True), chat=True)
        endless = iter(c.generate("Count to one hundred.", _greedy(1500, ignore_eos=True), chat=True, timeout=120))
        it = iter(stream)
        tokens = list(next(it).token_ids)
        next(endless)
        v.proc.send_signal(signal.SIGTERM)
        rest: list[int] = []
        drained = threading.Thread(target=lambda: rest.extend(t for ch in it for t in ch.token_ids))
        drained.start()
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as err:  # no new work once draining
            c.complete("hi", _greedy(2))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as cut:  # ~50 more tokens in the grace, not 1500
            for _ in endless:
                pass
        drained.join(120)
    assert len(tokens + rest) == 16 and stream.summary.finish_reason == "length"
    assert (cut.value.code(), cut.value.details()) == (grpc.StatusCode.UNAVAILABLE, RETRY_ELSEWHERE)
    assert v.proc.wait(60) == 0
    log = v.log()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert log.count("drain grace") == 1 and "drain grace of 8 s over: cutting 1 streams" in log, log[-3000:]


def test_logprobs_are_the_models_distribution_as_sampling_used_it(lm, client, prompts):
    import torch

    from specmesh_server.sampling import filter_logits

    _, ids = prompts[0]
    for params in (SamplingParams(temperature=0.0, max_tokens=6, logprobs=4),
                   SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=6, logprobs=4)):  # fmt: skip
        out = client.complete(ids, params)
        assert len(out.logprobs) == len(out.token_ids) == 6
        with torch.inference_mode():
            logits = lm.model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1].float()  # [6, V]
        n = len(logits)
        if params.temperature:  # sampled: after temperature and top-k, as the draw used it
            logits = filter_logits(logits, torch.full((n,), 0.7), torch.ones(n), torch.full((n,), 20))
        want = torch.log_softmax(logits, dim=-1)
        for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert lp.logprob == pytest.approx(float(want[j, tok]), abs=1e-3)
            assert [t.token_id for t in lp.top] == torch.topk(want[j], 4).indices.tolist()
            assert lp.token == lm.tokenizer.decode([tok])


def test_a_huge_prompt_is_refused_at_once_without_stalling_the_running_streams(client, prompts):
    """3.5 MB of text (under gRPC's 4 MB message limit; tokenizing it took ~4 s on the event loop
    and froze every stream) is refused from its size before tokenizing, as is the same in chat; the
    streams running meanwhile never wait more than 1.5 s between chunks (a step here is ~0.1 s)."""
    huge = "lorem ipsum dolor " * 200_000  # 3.6 MB
    arrivals: list[list[float]] = [[], []]

    def stream(i: int) -> None:
        for _ in client.generate(prompts[i][1], _greedy(48, ignore_eos=True)):
            arrivals[i].append(time.perf_counter())

    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(stream, i) for i in range(2)]
        while not all(arrivals):
            time.sleep(0.01)
        for prompt, field in ((huge, "input.text"), ([{"role": "user", "content": huge}], "input.chat")):
            t0 = time.perf_counter()
            with pytest.raises(grpc.RpcError) as err:
                client.complete(prompt, _greedy(4), chat=field == "input.chat")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in err.value.details() and "before tokenizing" in err.value.details()
            assert time.perf_counter() - t0 < 1.5
        for f in running:
            f.result(timeout=120)
    gaps = [b - a for times in arrivals for a, b in itertools.pairwise(times)]
    assert max(gaps) < 1.5, f"largest gap between chunks {max(gaps):.2f} s"
