"""vLLM's /tokenize and /detokenize through the gateway, and the SDK's tokenize/detokenize over gRPC,
against one real verifier: the tokenizer's own answers, the prompt Generate sees, and every refusal."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
from support import start_gateway, stop_process

from specmesh import AsyncClient, Client, Tokens

pytestmark = pytest.mark.slow
MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What colour is the sky on a clear day?"},
]
TEXT = "Tokenizers split words: naïve café, 東京 🙂."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, verifier):
    g = start_gateway(tmp_path_factory.mktemp("gateway"), verifier.address)
    yield g
    stop_process(g.proc)


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway.url.removesuffix("/v1"), timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def _template(lm, messages, add_generation_prompt: bool = True) -> list[int]:
    ids = lm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _error(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_tokenize_text_is_the_tokenizers_and_detokenize_round_trips(http, model, lm):
    body = http.post("/tokenize", json={"model": model, "prompt": TEXT}).json()
    want = lm.tokenizer.encode(TEXT, add_special_tokens=True)
    assert body == {"count": len(want), "max_model_len": 8192, "tokens": want, "token_strs": None}
    plain = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True})
    assert plain.json()["tokens"] == lm.tokenizer.encode(TEXT, add_special_tokens=False)  # model may be left out
    assert plain.json()["token_strs"] == lm.tokenizer.convert_ids_to_tokens(plain.json()["tokens"])
    back = http.post("/detokenize", json={"model": model, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}


def test_tokenize_chat_is_the_prompt_a_chat_completion_sees(http, gateway, model, lm):
    body = http.post("/tokenize", json={"model": model, "messages": MESSAGES, "return_token_strs": True}).json()
    want = _template(lm, MESSAGES)
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["token_strs"] == lm.tokenizer.convert_ids_to_tokens(want)
    with openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0, timeout=300) as oai:
        resp = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, temperature=0)
    assert resp.usage.prompt_tokens == body["count"]
    bare = http.post("/tokenize", json={"model": model, "messages": MESSAGES, "add_generation_prompt": False})
    assert bare.json()["tokens"] == _template(lm, MESSAGES, add_generation_prompt=False)
    halves = [{"type": "text", "text": "What colour "}, {"type": "text", "text": "is it?"}]
    parts = [{"role": "user", "content": halves}]
    joined = http.post("/tokenize", json={"messages": parts}).json()["tokens"]
    assert joined == _template(lm, [{"role": "user", "content": "What colour is it?"}])
    assert http.post("/detokenize", json={"tokens": want}).json()["prompt"] == lm.tokenizer.decode(want)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/tokenize", {"prompt": "hi", "echo": True}, "echo"),  # unknown fields: 400, never dropped
        ("/tokenize", {"messages": MESSAGES, "n": 2}, "n"),
        ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
        ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools.0.function"),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
        ("/tokenize", {"messages": MESSAGES, "mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
        ("/tokenize", {"messages": MESSAGES, "prompt": "hi"}, "messages"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"add_special_tokens": True}, "prompt"),
        ("/tokenize", {"prompt": ""}, "prompt"),  # the verifier's refusal, named as the client sent it
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),  # the verifier's refusal
        ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens.1"),
        ("/detokenize", {"tokens": [1, 49152]}, "tokens"),  # outside the vocabulary: the verifier's refusal
        ("/detokenize", {}, "tokens"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(http, model, path, extra, param):
    err = _error(http.post(path, json={"model": model, **extra}))
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_an_unknown_model_is_a_404_and_bad_json_a_400(http):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        err = _error(http.post(path, json={"model": "gpt-4", **body}), 404)
        assert err["param"] == "model" and err["code"] == "model_not_found"
    assert _error(http.post("/tokenize", content=b"{not json", headers={"content-type": "application/json"}))
    assert _error(http.post("/tokenize", json=["hi"]))["message"].startswith("body")
    metrics = http.get("/metrics").text
    assert 'specmesh_gateway_requests_total{endpoint="/tokenize",status="404"}' in metrics


def test_the_sdk_tokenizes_and_detokenizes_blocking_and_async(verifier, lm):
    chat_ids = _template(lm, MESSAGES)
    with Client(verifier.address) as c:
        text = c.tokenize(TEXT)
        assert text == Tokens(lm.tokenizer.encode(TEXT), None, 8192)
        chat = c.tokenize(MESSAGES, return_token_strs=True)
        assert chat.tokens == chat_ids and chat.token_strs == lm.tokenizer.convert_ids_to_tokens(chat_ids)
        single = c.tokenize("Hi", chat=True, add_generation_prompt=False)
        assert single.tokens == _template(lm, [{"role": "user", "content": "Hi"}], add_generation_prompt=False)
        assert c.detokenize(text.tokens) == TEXT
        with pytest.raises(grpc.RpcError) as err:
            c.detokenize([0, 49152])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("tokens:")
        with pytest.raises(grpc.RpcError) as err:
            c.tokenize([{"role": "robot", "content": "x"}])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown role 'robot'" in err.value.details()

    async def run() -> tuple[Tokens, str, grpc.StatusCode]:
        async with AsyncClient(verifier.address) as c:
            tokens = await c.tokenize(MESSAGES)
            text = await c.detokenize(tokens.tokens)
            try:
                await c.detokenize([-5])
            except grpc.aio.AioRpcError as exc:
                return tokens, text, exc.code()
        raise AssertionError("an id outside the vocabulary was answered")

    tokens, text, code = asyncio.run(run())
    assert tokens == Tokens(chat_ids, None, 8192) and text == lm.tokenizer.decode(chat_ids)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
