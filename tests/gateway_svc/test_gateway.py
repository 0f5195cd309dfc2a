"""The gateway as a real process in front of a real verifier, driven by the official ``openai`` client:
output identical to the gRPC SDK's, per-request speculation and its metrics, logprobs that do not
depend on speculation, SSE framing, every error path, and a client leaving mid-stream."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from support import start_gateway, start_verifier, stop_process, stop_verifier

from specmesh import AsyncClient, Client, SamplingParams, SpecDecodeParams
from specmesh.cli import DEMO_PROMPT

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def verifier(tmp_path_factory, lm):
    # 16 running + 2 waiting: the 16-stream test fits, a burst of 24 is refused (429).
    v = start_verifier(
        tmp_path_factory.mktemp("verifier"),
        "--proposer",
        "ngram=inprocess:ngram",
        "--max-running",
        "16",
        "--max-waiting",
        "2",
    )
    yield v
    stop_verifier(v)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, verifier):
    g = start_gateway(tmp_path_factory.mktemp("gateway"), verifier.address)
    yield g
    stop_process(g.proc)


@pytest.fixture(scope="module")
def grpc_client(verifier):
    with Client(verifier.address) as c:
        yield c


def _spec(resp) -> dict:
    return resp.model_extra["metrics"]["speculative_decoding"]


def test_models_health_and_metrics_describe_the_served_model(gateway, oai, model):
    card = oai.models.list().data[0]
    assert card.owned_by == "specmesh" and card.model_extra["max_model_len"] == 8192
    assert oai.models.retrieve(model).id == model
    base = gateway.url.removesuffix("/v1")
    assert httpx.get(f"{base}/health").status_code == 200
    oai.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)
    metrics = httpx.get(f"{base}/metrics").text
    assert 'specmesh_gateway_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    assert "specmesh_gateway_time_to_first_token_seconds_bucket" in metrics


def test_chat_and_completions_equal_the_grpc_sdk_streaming_or_not(oai, model, grpc_client):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, logprobs=0)
    want = grpc_client.complete(QUESTION, greedy, chat=True)
    want_tokens = [lp.token for lp in want.logprobs]
    kw = {"model": model, "max_tokens": 40, "temperature": 0, "logprobs": True}
    msgs = [{"role": "user", "content": QUESTION}]
    full = oai.chat.completions.create(messages=msgs, **kw)
    assert full.choices[0].message.content == want.text
    assert [t.token for t in full.choices[0].logprobs.content] == want_tokens  # the same tokens, one by one
    assert full.usage.completion_tokens == len(want.token_ids)
    assert full.usage.prompt_tokens == want.summary.prompt_tokens
    # The SDK's request just computed this prompt: its full blocks come from the prefix cache (OpenAI's field).
    assert full.usage.prompt_tokens_details.cached_tokens == (want.summary.prompt_tokens - 1) // 16 * 16 > 0
    assert full.choices[0].finish_reason == ("length" if want.summary.finish_reason == "length" else "stop")
    chunks = list(oai.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    # vLLM's continuous_usage_stats (guidellm asks for it): every chunk its choice's usage so far.
    options = {"include_usage": True, "continuous_usage_stats": True}
    counted = list(oai.chat.completions.create(messages=msgs, stream=True, stream_options=options, **kw))
    assert [c.choices[0].delta.content for c in counted[:-1]] == [c.choices[0].delta.content for c in chunks[:-1]]
    assert all(c.usage.prompt_tokens == want.summary.prompt_tokens for c in counted)
    done = [c.usage.completion_tokens for c in counted]
    assert done == sorted(done) and done[0] == 0 and done[-1] == len(want.token_ids)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in counted)

    raw = grpc_client.complete("def add(a, b):", SamplingParams(temperature=0.0, max_tokens=24))
    text = oai.completions.create(model=model, prompt="def add(a, b):", max_tokens=24, temperature=0)
    assert text.choices[0].text == raw.text and text.usage.completion_tokens == len(raw.token_ids)
    ids = oai.completions.create(model=model, prompt=raw.token_ids[:5], max_tokens=8, temperature=0, stream=True)
    by_ids = grpc_client.complete(raw.token_ids[:5], SamplingParams(temperature=0.0, max_tokens=8))
    assert "".join(c.choices[0].text for c in ids) == by_ids.text


def test_async_client_streams_chat_identical_to_the_blocking_one(gateway, oai, model):
    msgs = [{"role": "user", "content": QUESTION}]
    want = oai.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)

    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=gateway.url, api_key="unused", max_retries=0) as client:
            stream = await client.chat.completions.create(
                model=model, messages=msgs, max_tokens=24, temperature=0, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    assert asyncio.run(run()) == want.choices[0].message.content


def test_sse_framing_on_the_raw_bytes(gateway, model):
    body = {
        "model": model,
        "prompt": "Hello",
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{gateway.url}/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(resp.iter_bytes())
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" and p["id"] == payloads[0]["id"] for p in payloads)
    assert payloads[-1]["usage"]["completion_tokens"] == 4


def test_spec_decode_none_drafts_nothing_and_ngram_accepts_on_a_code_edit(oai, model):
    msgs = [{"role": "user", "content": DEMO_PROMPT}]
    kw = {"model": model, "messages": msgs, "max_tokens": 96, "temperature": 0}
    plain = oai.chat.completions.create(extra_body={"spec_decode": {"proposer": "none"}}, **kw)
    fast = oai.chat.completions.create(extra_body={"spec_decode": {"proposer": "ngram"}}, **kw)
    assert _spec(plain)["num_draft_tokens"] == 0 and _spec(plain)["num_spec_steps"] == 0
    assert fast.choices[0].message.content == plain.choices[0].message.content
    m = _spec(fast)
    assert 0 < m["num_accepted_draft_tokens"] <= m["num_draft_tokens"]
    assert sum(m["acceptance_histogram"]) == m["num_spec_steps"] > 0
    assert m["proposers"]["ngram"]["num_accepted_draft_tokens"] == m["num_accepted_draft_tokens"]
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_draft_tokens"] / m["num_spec_steps"])
    assert m["draft_acceptance_rate"] == pytest.approx(m["num_accepted_draft_tokens"] / m["num_draft_tokens"])
    assert m["fallback_reason"] is None
    stream = list(
        oai.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, extra_body={"spec_decode": {"proposer": "ngram"}}, **kw
        )
    )
    assert _spec(stream[-1])["num_accepted_draft_tokens"] > 0  # on the final usage chunk


def test_logprobs_are_the_same_with_and_without_speculation(oai, model):
    kw = {
        "model": model,
        "messages": [{"role": "user", "content": DEMO_PROMPT}],
        "max_tokens": 64,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    plain = oai.chat.completions.create(extra_body={"spec_decode": {"proposer": "none"}}, **kw)
    spec = oai.chat.completions.create(extra_body={"spec_decode": {"proposer": "ngram"}}, **kw)
    assert _spec(spec)["num_accepted_draft_tokens"] > 0
    a, b = plain.choices[0].logprobs.content, spec.choices[0].logprobs.content
    assert [t.token for t in a] == [t.token for t in b]
    worst = max(abs(x.logprob - y.logprob) for x, y in zip(a, b, strict=True))
    print(f"largest logprob difference, speculative vs plain: {worst:.2e}")
    assert worst < 1e-3
    for t in a:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.bytes == list(t.token.encode())


def test_n_choices_stop_strings_and_completion_logprobs(oai, model):
    out = oai.completions.create(
        model=model, prompt=["1, 2, 3,", "a, b, c,"], max_tokens=6, n=2, temperature=0, logprobs=2
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text and out.choices[2].text == out.choices[3].text
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6 and lp.text_offset[0] == 0
    singles = [
        oai.completions.create(model=model, prompt=p, max_tokens=6, temperature=0) for p in ("1, 2, 3,", "a, b, c,")
    ]
    assert [c.text for c in out.choices[::2]] == [s.choices[0].text for s in singles]
    # each prompt counted once, not once per choice
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert out.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    # A seed repeats a sample exactly for one request alone in the batch with speculation fixed: a tree
    # changes which uniforms a token consumes, and n choices share steps whose batch size (and so the
    # fp32 kernels' rounding) depends on timing. The distribution is the target's either way.
    seeded = {"model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 5,
              "extra_body": {"spec_decode": {"proposer": "none"}}}  # fmt: skip
    once, again = oai.completions.create(**seeded), oai.completions.create(**seeded)
    assert once.choices[0].text == again.choices[0].text
    fanned = oai.completions.create(**seeded, n=3)
    assert len({c.text for c in fanned.choices}) == 3  # seeds seed, seed + 1, …: independent choices
    stopped = oai.completions.create(model=model, prompt="1, 2, 3,", max_tokens=20, temperature=0, stop=[","])
    assert stopped.choices[0].finish_reason == "stop" and "," not in stopped.choices[0].text
    assert stopped.choices[0].model_extra["stop_reason"] == ","


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 3}, 400, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "spec_decode": {"proposer": "medusa"}},
            400,
            "spec_decode.proposer",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "spec_decode": {"proposer": "draft"}},
            400,
            "spec_decode.proposer",
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 100}, 400, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 3}, 400, "frequency_penalty"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"999999": 5}}, 400, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": [10**6]}, 400, "allowed_token_ids"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools.0.function"),
        ({"messages": [{"role": "user", "content": "hi"}], "frobnicate": True}, 400, "frobnicate"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(gateway, model, body, status, param):
    resp = httpx.post(f"{gateway.url}/chat/completions", json={"model": model, **body}, timeout=60)
    assert resp.status_code == status, resp.text
    err = _error(resp)
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_unknown_model_route_and_malformed_json(gateway):
    resp = httpx.post(
        f"{gateway.url}/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert resp.status_code == 404 and _error(resp)["code"] == "model_not_found" and _error(resp)["param"] == "model"
    resp = httpx.post(
        f"{gateway.url}/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400 and "JSON" in _error(resp)["message"]
    assert httpx.get(f"{gateway.url}/nothing-here").status_code == 404
    assert "Traceback" not in gateway.log()  # every error above was an answer, not a crash


def test_a_full_verifier_is_429_with_retry_after_and_the_others_go_on(gateway, verifier, model):
    # Short generations: the 2 queued requests answer (with their first token) once the running ones end.
    body = {
        "model": model,
        "prompt": "Count to one thousand:",
        "max_tokens": 32,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    _wait_idle(verifier)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as client:
            streams = [client.stream("POST", f"{gateway.url}/completions", json=body) for _ in range(24)]
            responses = await asyncio.gather(*(s.__aenter__() for s in streams))
            codes = [r.status_code for r in responses]
            refused = next(r for r in responses if r.status_code == 429)
            await refused.aread()
            assert refused.headers["retry-after"] == "1" and json.loads(refused.content)["error"]["code"]
            for s in streams:
                await s.__aexit__(None, None, None)  # leave every admitted stream: the verifier cancels them
            return codes

    codes = asyncio.run(burst())
    assert codes.count(200) == 18 and codes.count(429) == 6
    _wait_idle(verifier)


def _wait_idle(verifier) -> None:
    """Until the verifier runs and queues nothing (cancellations reach its engine asynchronously)."""
    with Client(verifier.address) as c:
        deadline = time.time() + 30
        while (s := c.stats().server).running_requests + s.waiting_requests and time.time() < deadline:
            time.sleep(0.1)
        assert s.running_requests == 0 and s.waiting_requests == 0


def test_a_dead_verifier_is_503_and_a_deadline_is_504(tmp_path, verifier, model):
    from specmesh.deploy import free_port

    dead = start_gateway(tmp_path, f"127.0.0.1:{free_port()}", "--served-model-name", model, healthy=False)
    slow = start_gateway(tmp_path, verifier.address, "--request-timeout", "0.001")
    try:
        assert httpx.get(dead.url.removesuffix("/v1") + "/health").status_code == 503
        msgs = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        resp = httpx.post(f"{dead.url}/chat/completions", json=msgs, timeout=60)
        assert resp.status_code == 503 and _error(resp)["type"] == "service_unavailable_error"
        resp = httpx.post(f"{slow.url}/chat/completions", json={**msgs, "max_tokens": 200}, timeout=60)
        assert resp.status_code == 504 and _error(resp)["type"] == "timeout_error"
    finally:
        stop_process(dead.proc)
        stop_process(slow.proc)


def test_sixteen_streams_go_on_while_one_client_disconnects(gateway, verifier, model):
    prompts = [f"Write a short poem about the number {i}." for i in range(15)]

    async def run() -> list[int]:
        async with openai.AsyncOpenAI(base_url=gateway.url, api_key="unused", max_retries=0, timeout=300) as client:

            async def finish(p: str) -> int:
                resp = await client.completions.create(
                    model=model, prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
                )
                return resp.usage.completion_tokens

            async def leave() -> int:
                stream = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "Count to 500."}],
                    max_tokens=500,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                seen = 0
                async for _ in stream:
                    seen += 1
                    if seen == 3:
                        break
                await stream.close()  # the client goes away mid-stream
                return seen

            return await asyncio.gather(leave(), *(finish(p) for p in prompts))

    _wait_idle(verifier)
    with Client(verifier.address) as c:
        cancelled = c.stats().server.cancelled_requests
        seen, *tokens = asyncio.run(run())
        assert seen == 3 and tokens == [24] * 15
        _wait_idle(verifier)
        assert c.stats().server.cancelled_requests == cancelled + 1  # the one that left, and only it


def test_async_sdk_closing_a_stream_cancels_the_rpc(verifier):
    async def run() -> None:
        async with AsyncClient(verifier.address) as c:
            gen = c.generate(
                "Count to 500.",
                SamplingParams(temperature=0, max_tokens=500, ignore_eos=True),
                SpecDecodeParams(proposer="none"),
                chat=True,
            )
            await anext(gen)
            await gen.aclose()
            deadline = time.time() + 10
            while (await c.stats()).server.running_requests and time.time() < deadline:
                await asyncio.sleep(0.05)
            assert (await c.stats()).server.running_requests == 0

    asyncio.run(run())


# The sampling controls and prompt logprobs, each streaming and not, through the official client's
# extra_body where it has no parameter. Each compares the gateway with the SDK over gRPC on the same
# SamplingParams (the gateway adds nothing and drops nothing), and shows the control's own effect.
PROMPT = "List the colours of the rainbow: red, orange, yellow,"


def _text(oai, model, stream: bool, **kw) -> str:
    """The completion of PROMPT, greedy unless ``kw`` says otherwise."""
    kw = {"temperature": 0, **kw}
    if not stream:
        return oai.completions.create(model=model, prompt=PROMPT, **kw).choices[0].text
    chunks = oai.completions.create(model=model, prompt=PROMPT, stream=True, **kw)
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("fields", "extra"),
    [
        ({"presence_penalty": 1.5}, {}),
        ({"frequency_penalty": 1.0}, {}),
        ({}, {"repetition_penalty": 1.5}),
        ({"temperature": 0.8, "seed": 3}, {"min_p": 0.2}),
    ],
    ids=["presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"],
)
def test_each_sampling_control_through_the_gateway_equals_the_sdks(oai, model, grpc_client, fields, extra, stream):
    none = SpecDecodeParams(proposer="none")  # a seeded sample repeats with speculation fixed
    params = SamplingParams(**{"temperature": 0.0, **fields, **extra}, max_tokens=12)
    want = grpc_client.complete(PROMPT, params, none).text
    got = _text(oai, model, stream, max_tokens=12, **fields, extra_body={**extra, "spec_decode": {"proposer": "none"}})
    assert got == want
    if "min_p" not in extra:  # a penalty changes greedy output on a list whose commas repeat
        assert want != grpc_client.complete(PROMPT, SamplingParams(temperature=0.0, max_tokens=12), none).text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logit_bias_moves_greedys_first_token_and_allowed_token_ids_restrict_every_token(
    oai, model, grpc_client, lm, stream
):
    plain = grpc_client.complete(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, logprobs=0))
    first = plain.token_ids[0]
    biased = _text(oai, model, stream, max_tokens=1, logit_bias={str(first): -100})
    assert biased and biased != plain.text
    allowed = lm.tokenizer.encode(" blue green", add_special_tokens=False)
    kw = {"max_tokens": 8, "logprobs": 0, "extra_body": {"allowed_token_ids": allowed, "ignore_eos": True}}
    if stream:
        chunks = list(oai.completions.create(model=model, prompt=PROMPT, temperature=0, stream=True, **kw))
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    else:
        tokens = oai.completions.create(model=model, prompt=PROMPT, temperature=0, **kw).choices[0].logprobs.tokens
    assert len(tokens) == 8 and set(tokens) <= {lm.tokenizer.decode([t]) for t in allowed}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_min_tokens_keeps_generating_past_the_end_of_sequence(oai, model, stream):
    kw = {"model": model, "messages": [{"role": "user", "content": "Reply with the single word OK."}], "temperature": 0}
    plain = oai.chat.completions.create(max_tokens=64, **kw)
    ended = plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and ended < 54  # greedy ends with EOS (no stop strings)
    kw |= {"max_tokens": ended + 10, "extra_body": {"min_tokens": ended + 10}}
    if stream:
        chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        assert chunks[-1].usage.completion_tokens == ended + 10
    else:
        assert oai.chat.completions.create(**kw).usage.completion_tokens == ended + 10


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_scores_a_token_id_prompt_with_max_tokens_0_as_transformers_does(oai, model, lm, stream):
    import torch

    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    kw = {"model": model, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    if stream:
        chunks = [c.choices[0] for c in oai.completions.create(stream=True, **kw) if c.choices]
        text = "".join(c.text for c in chunks)
        token_logprobs = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
        assert chunks[-1].finish_reason == "length"
    else:
        choice = oai.completions.create(**kw).choices[0]
        text, token_logprobs = choice.text, choice.logprobs.token_logprobs
        assert len(choice.logprobs.tokens) == len(choice.logprobs.top_logprobs) == len(ids)
        assert choice.logprobs.top_logprobs[0] is None and all(len(t) >= 1 for t in choice.logprobs.top_logprobs[1:])
    assert text == lm.tokenizer.decode(ids)
    assert token_logprobs[0] is None and len(token_logprobs) == len(ids)
    with torch.inference_mode():
        want = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    diff = max(abs(lp - float(want[q, ids[q + 1]])) for q, lp in enumerate(token_logprobs[1:]))
    assert diff < 1e-4, diff


def test_prompt_logprobs_in_vllms_shape_on_both_endpoints_and_refused_when_streaming(gateway, oai, model):
    out = oai.completions.create(
        model=model, prompt="Hello there, world", max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == out.usage.prompt_tokens
    for entry in plp[1:]:
        ranks = sorted(v["rank"] for v in entry.values())
        assert (
            2 <= len(entry) <= 3
            and ranks[:2] == [1, 2]
            and all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        )
    chat = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert (
        chat.model_extra["prompt_logprobs"][0] is None
        and len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    )
    body = {"model": model, "prompt": "Hello", "stream": True, "prompt_logprobs": 1}
    resp = httpx.post(f"{gateway.url}/completions", json=body, timeout=60)
    assert resp.status_code == 400 and _error(resp)["param"] == "prompt_logprobs"
