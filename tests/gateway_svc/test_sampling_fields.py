"""No request field is dropped silently: every field of OpenAI's and vLLM's completion and chat request
schemas is honoured (it reaches the verifier's SamplingParams or shapes the answer), accepted with no
effect on the output, or refused with a 400 naming it; and the README's field list is the code's.

In process: the gateway's FastAPI app with a scripted stand-in for the SDK's AsyncClient (no verifier),
so what each field sends to the verifier is seen directly. OpenAI's field names are read from the
installed ``openai`` package (a field OpenAI adds fails here until it is classified); vLLM's are data,
copied from vllm-project/vllm at the commits named below.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from gateway_svc.app import create_app
from gateway_svc.config import GatewayConfig
from gateway_svc.metrics import GatewayMetrics
from gateway_svc.protocol import NO_EFFECT, REFUSED, ChatCompletionRequest, CompletionRequest
from specmesh.params import Chunk, PromptLogprobs, SamplingParams, Summary, TokenLogprob, TopLogprob
from specmesh.v1 import params_pb2

README = Path(__file__).resolve().parents[2] / "README.md"


def _names(text: str) -> list[str]:
    return text.split()


# vllm/entrypoints/openai/completion/protocol.py and chat_completion/protocol.py at vllm-project/vllm
# 002032ee2b18e1f7bd924ec47b62504ba3866063: CompletionRequest's and ChatCompletionRequest's fields, in order.
VLLM_COMPLETION = _names("""
model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop
stream stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty watermarking
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs
logprob_token_ids bad_words prompt_embeds add_special_tokens response_format structured_outputs priority request_id
session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection
thinking_token_budget stream_interval""")
VLLM_CHAT = _names("""
messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n
presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice reasoning_effort
thinking_token_budget include_reasoning parallel_tool_calls user use_beam_search top_k min_p repetition_penalty
watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens truncation_side prompt_logprobs logprob_token_ids
allowed_token_ids bad_words echo add_generation_prompt continue_final_message add_special_tokens documents
chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs structured_outputs priority request_id
session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
return_prompt_text return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection
stream_interval""")
# Older names clients still send: vllm/entrypoints/openai/protocol.py at 0052bed36509c7a5a2d8e48265334e40cf2f5a0e
# (both requests; chat also had structural_tag).
VLLM_OLDER = _names("""best_of guided_json guided_regex guided_choice guided_grammar guided_decoding_backend
guided_whitespace_pattern logits_processors""")
VLLM = {"completions": [*VLLM_COMPLETION, *VLLM_OLDER], "chat": [*VLLM_CHAT, *VLLM_OLDER, "structural_tag"]}


def openai_fields(chat: bool) -> set[str]:
    """Every field of the installed ``openai`` package's create-params, streaming or not."""
    mod = chat_params if chat else completion_params
    names: set[str] = set()
    for td in (mod.CompletionCreateParamsNonStreaming, mod.CompletionCreateParamsStreaming):
        names |= td.__required_keys__ | td.__optional_keys__
    return names


def all_fields(endpoint: str) -> list[str]:
    return sorted(openai_fields(endpoint == "chat") | set(VLLM[endpoint]))


# A value for every field that asks for something (not the default); a callable takes ``chat``.
SAMPLES = {
    "audio": {"voice": "alloy", "format": "wav"}, "best_of": 3, "echo": True, "frequency_penalty": 0.5,
    "function_call": "auto", "functions": [{"name": "f"}], "logit_bias": {"5": -100}, "max_tokens": 3,
    "max_completion_tokens": 3, "metadata": {"k": "v"}, "modalities": ["text", "audio"], "moderation": {"model": "x"},
    "n": 2, "parallel_tool_calls": False, "prediction": {"type": "content", "content": "x"}, "presence_penalty": -0.5,
    "prompt_cache_key": "k", "prompt_cache_options": {"ttl": "1h"}, "prompt_cache_retention": "24h",
    "reasoning_effort": "low", "response_format": {"type": "json_object"}, "safety_identifier": "s", "seed": 7,
    "service_tier": "flex", "stop": ["\n"], "store": True, "stream": True, "stream_options": {"include_usage": True},
    "suffix": "end", "temperature": 0.5, "tool_choice": "required",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "top_logprobs": 2, "top_p": 0.5, "user": "u", "verbosity": "low", "web_search_options": {"user_location": {}},
    "use_beam_search": True, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "watermarking": True,
    "length_penalty": 0.5, "stop_token_ids": [2], "include_stop_str_in_output": True, "ignore_eos": True,
    "min_tokens": 1, "skip_special_tokens": False, "spaces_between_special_tokens": False, "truncate_prompt_tokens": 5,
    "truncation_side": "left", "allowed_token_ids": [7, 8], "prompt_logprobs": 2, "logprob_token_ids": [5],
    "bad_words": ["x"], "prompt_embeds": "AAAA", "add_special_tokens": lambda chat: chat,
    "structured_outputs": {"json": {}}, "priority": 1, "request_id": "mine", "session_id": "s1",
    "return_tokens_as_token_ids": True, "return_token_ids": True, "routed_experts_prompt_start": 2,
    "return_token_offsets": True, "return_mm_kwargs": False, "return_prompt_text": True, "cache_salt": "salt",
    "kv_transfer_params": {"a": 1}, "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1},
    "repetition_detection": {"max_pattern_size": 4}, "thinking_token_budget": 100, "stream_interval": 4,
    "include_reasoning": False, "add_generation_prompt": False, "continue_final_message": True,
    "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ x }}", "chat_template_kwargs": {"a": True},
    "media_io_kwargs": {"image": {"a": 1}}, "mm_processor_kwargs": {"a": 1}, "guided_json": {"type": "object"},
    "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "root ::= x",
    "guided_decoding_backend": "xgrammar:disable-any-whitespace",
    "guided_whitespace_pattern": " ", "structural_tag": "{}", "logits_processors": ["m.P"],
    "logprobs": lambda chat: True if chat else 2, "prompt": [1, 2, 3],
}  # fmt: skip
BASE = {
    "completions": {"model": "m", "prompt": "a b c"},
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
}
NEEDS = {  # what a sample needs beside it
    "stream_options": {"stream": True},
    "top_logprobs": {"logprobs": True},
    "guided_decoding_backend": {"guided_json": {}},
    "tool_choice": {"tools": SAMPLES["tools"]},
    "parallel_tool_calls": {"tools": SAMPLES["tools"], "tool_choice": "required"},
}


def _sent(out: Answer, name: str, value) -> bool:
    return getattr(out.sampling, name) == value


def _grammar(out: Answer, *_) -> dict:
    """The structured output the verifier was sent, as {kind: value, any_whitespace}."""
    g = out.sampling.structured_output
    kinds = ("json_schema", "json_object", "regex", "choice", "grammar")
    return {**{k: getattr(g, k) for k in kinds if getattr(g, k) not in (None, False, ())}, "ws": g.any_whitespace}


# How each honoured field shows: in what the verifier was sent, or in the answer.
EFFECTS = {
    "frequency_penalty": _sent, "presence_penalty": _sent, "temperature": _sent, "top_p": _sent, "seed": _sent,
    "top_k": _sent, "min_p": _sent, "repetition_penalty": _sent, "ignore_eos": _sent, "min_tokens": _sent,
    "prompt_logprobs": _sent, "max_tokens": _sent,
    "logit_bias": lambda out, *_: out.sampling.logit_bias == {5: -100.0},
    "stop": lambda out, *_: out.sampling.stop == ("\n",),
    "stop_token_ids": lambda out, *_: out.sampling.stop_token_ids == (2,),
    "allowed_token_ids": lambda out, *_: out.sampling.allowed_token_ids == (7, 8),
    "max_completion_tokens": lambda out, *_: out.sampling.max_tokens == 3,
    "top_logprobs": lambda out, *_: out.sampling.logprobs == 2,
    "logprobs": lambda out, *_: out.sampling.logprobs == (0 if out.chat else 2),
    "n": lambda out, *_: len(out.body["choices"]) == 2,
    "echo": lambda out, *_: out.body["choices"][0]["text"].startswith("a b c"),
    "stream": lambda out, *_: out.events[-1] == "[DONE]",
    "stream_options": lambda out, *_: out.events[-2]["usage"]["completion_tokens"] == 2,
    "request_id": lambda out, *_: out.first["id"].endswith("-mine"),
    "cache_salt": lambda out, *_: out.spec.cache_salt == "salt",
    "prompt": lambda out, *_: out.prompt == [1, 2, 3],
    "messages": lambda out, *_: out.prompt == [{"role": "user", "content": "hi"}],
    "tools": lambda out, *_: out.tools == SAMPLES["tools"],
    "tool_choice": lambda out, *_: json.loads(out.sampling.structured_output.json_schema)["minItems"] == 1,
    "parallel_tool_calls": lambda out, *_: json.loads(out.sampling.structured_output.json_schema)["maxItems"] == 1,
    "response_format": lambda out, *_: _grammar(out) == {"json_object": True, "ws": False},
    "structured_outputs": lambda out, *_: _grammar(out) == {"json_schema": "{}", "ws": True},
    "guided_json": lambda out, *_: _grammar(out) == {"json_schema": '{"type":"object"}', "ws": True},
    "guided_regex": lambda out, *_: _grammar(out) == {"regex": "a+", "ws": False},
    "guided_choice": lambda out, *_: _grammar(out) == {"choice": ("a",), "ws": False},
    "guided_grammar": lambda out, *_: _grammar(out) == {"grammar": "root ::= x", "ws": False},
    "guided_decoding_backend": lambda out, *_: _grammar(out) == {"json_schema": "{}", "ws": False},
}  # fmt: skip


class FakeVerifier:
    """The SDK's ``AsyncClient`` as the gateway uses it, scripted: a prompt's tokens are 10, 11, … (a token-id
    prompt's own); each choice yields two tokens, 7 and 8 (``max_tokens`` fewer), text ``<7><8>``, with logprobs
    and the prompt's logprobs (each prompt token at logprob -1, rank 3) when asked; then its Summary."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, SamplingParams]] = []

    async def stats(self, timeout: float | None = None):
        return types.SimpleNamespace(server=types.SimpleNamespace(model="m", max_context_tokens=8192))

    async def detokenize(self, tokens, *, timeout: float | None = None) -> str:
        return "".join(f"<{t}>" for t in tokens)

    async def generate(self, prompt, sampling, spec, *, chat, request_id, timeout, tools=None):
        self.sent.append((prompt, sampling))
        self.tools, self.spec = tools, spec
        ids = list(prompt) if prompt and isinstance(prompt[0], int) else [10 + i for i in range(3)]
        lp = None
        if sampling.prompt_logprobs is not None:
            tops = tuple(TopLogprob(900 + k, -0.5 - k, f"<{900 + k}>") for k in range(sampling.prompt_logprobs))
            lp = PromptLogprobs(ids, [TokenLogprob(-1.0, f"<{t}>", tops, rank=3) for t in ids[1:]])
        out = [7, 8][: 2 if sampling.max_tokens is None else sampling.max_tokens]
        tops = tuple(TopLogprob(7, -0.25, "<7>") for _ in range(sampling.logprobs or 0))
        lps = [TokenLogprob(-0.25, f"<{t}>", tops, rank=1) for t in out] if sampling.logprobs is not None else None
        yield Chunk(out, "".join(f"<{t}>" for t in out), lps, lp)
        yield Summary("length", len(ids), len(out), 1.0, 2.0, params_pb2.SpeculationMetrics())

    async def close(self) -> None:
        pass


@pytest.fixture
def fake() -> FakeVerifier:
    return FakeVerifier()


@pytest.fixture
def http(fake):
    app = create_app(GatewayConfig(served_model_name="m"), GatewayMetrics(CollectorRegistry()))
    app.state.gateway.client = fake  # no lifespan: the stand-in is the gateway's client
    return TestClient(app)


class Answer:
    def __init__(self, resp, fake: FakeVerifier, chat: bool) -> None:
        self.status, self.chat = resp.status_code, chat
        self.prompt, self.sampling = fake.sent[0] if fake.sent else (None, None)
        self.tools, self.spec = getattr(fake, "tools", None), getattr(fake, "spec", None)
        text = resp.text
        if text.startswith("data: "):
            self.events = [e if e == "[DONE]" else json.loads(e) for e in re.findall(r"data: (.*)\n\n", text)]
            self.body = None
        else:
            self.events, self.body = None, resp.json()
        self.first = self.body or self.events[0]  # the body, or the first event


def post(http, fake, endpoint: str, **fields) -> Answer:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    fake.sent.clear()
    return Answer(http.post(path, json={**BASE[endpoint], **fields}), fake, endpoint == "chat")


def _error(answer: Answer) -> dict:
    assert answer.status == 400, answer.body
    assert set(answer.body) == {"error"} and set(answer.body["error"]) == {"message", "type", "param", "code"}
    return answer.body["error"]


def _honoured(endpoint: str) -> set[str]:
    model = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
    return set(model.model_fields) - {"spec_decode"}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_openai_and_vllm_field_is_honoured_accepted_or_refused_by_the_registry(endpoint):
    unknown = set(all_fields(endpoint)) - _honoured(endpoint) - set(REFUSED)
    assert not unknown, f"classify these fields in gateway_svc/protocol.py (honour, NO_EFFECT or REFUSED): {unknown}"
    assert not _honoured(endpoint) & set(REFUSED) - {"echo"}  # echo: honoured by completions, refused by chat
    assert _honoured("chat") >= NO_EFFECT


@pytest.mark.parametrize(
    ("endpoint", "name"), [(e, n) for e in ("completions", "chat") for n in all_fields(e) if n not in ("model",)]
)
def test_each_field_with_a_value_is_honoured_or_refused_naming_it(http, fake, endpoint, name):
    assert name in SAMPLES or name in BASE[endpoint], f"give {name!r} a sample value"
    value = SAMPLES.get(name, BASE[endpoint].get(name))
    value = value(endpoint == "chat") if callable(value) else value
    out = post(http, fake, endpoint, **NEEDS.get(name, {}), **{name: value})
    if name in _honoured(endpoint):
        assert out.status == 200, out.body
        if name not in NO_EFFECT:
            assert name in EFFECTS, f"say how {name!r} shows in EFFECTS"
            assert EFFECTS[name](out, name, value), f"{name}={value!r} had no effect"
    else:
        err = _error(out)
        assert err["param"] == name and err["type"] == "invalid_request_error", err
        assert name in err["message"]


@pytest.mark.parametrize(
    ("name", "value"),
    [("response_format", {"type": "text"}), ("skip_special_tokens", True),
     ("best_of", 1), ("store", False), ("priority", 0), ("bad_words", []), ("echo", False), ("modalities", ["text"]),
     ("add_special_tokens", False), ("length_penalty", 1.0), ("service_tier", "auto"), ("stream_interval", 1)],
)  # fmt: skip
def test_a_refused_field_is_accepted_with_the_value_the_server_honours_anyway(http, fake, name, value):
    assert post(http, fake, "chat", **{name: value}).status == 200


def test_an_unknown_field_is_400_as_openai_says_it_naming_the_field(http, fake):
    err = _error(post(http, fake, "completions", frobnicate=1))
    assert err["message"] == "Unrecognized request argument supplied: frobnicate" and err["param"] == "frobnicate"
    assert _error(post(http, fake, "chat", stream=True, stream_options={"x": 1}))["param"] == "stream_options.x"
    msgs = [{"role": "user", "content": "hi", "name": "alice"}]
    assert _error(post(http, fake, "chat", messages=msgs))["param"] == "messages.0.name"
    replayed = [{"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None, "audio": None}]
    assert post(http, fake, "chat", messages=[*BASE["chat"]["messages"], *replayed]).status == 200


def test_echo_with_logprobs_and_max_tokens_0_scores_a_token_id_prompt(http, fake):
    out = post(http, fake, "completions", prompt=[1, 2, 3], echo=True, logprobs=1, max_tokens=0, temperature=0)
    assert out.status == 200 and (out.sampling.max_tokens, out.sampling.prompt_logprobs) == (0, 1)
    choice = out.body["choices"][0]
    assert choice["text"] == "<1><2><3>"  # the verifier's decoding of the ids
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<1>", "<2>", "<3>"] and lp["token_logprobs"] == [None, -1.0, -1.0]
    assert lp["top_logprobs"] == [None, {"<900>": -0.5, "<2>": -1.0}, {"<900>": -0.5, "<3>": -1.0}]
    assert lp["text_offset"] == [0, 3, 6] and "prompt_logprobs" not in choice


def test_echo_prepends_each_choices_own_prompt_and_asks_its_logprobs_once(http, fake):
    out = post(http, fake, "completions", prompt=[[1, 2], [4, 5, 6]], echo=True, logprobs=0, max_tokens=1, n=2)
    texts = [c["text"] for c in out.body["choices"]]
    assert texts == ["<1><2><7>", "<1><2><7>", "<4><5><6><7>", "<4><5><6><7>"]
    lps = [c["logprobs"] for c in out.body["choices"]]
    assert [len(lp["tokens"]) for lp in lps] == [3, 3, 4, 4] and lps[2]["text_offset"] == [0, 3, 6, 9]
    assert [s.prompt_logprobs for _, s in fake.sent] == [0, None, 0, None]  # a prompt's first choice only
    text = post(http, fake, "completions", prompt="a b c", echo=True, max_tokens=2)
    assert text.body["choices"][0]["text"] == "a b c<7><8>" and text.sampling.prompt_logprobs is None


def test_lm_evaluation_harness_reads_its_loglikelihoods_from_the_echo(http, fake):
    lm_eval = pytest.importorskip("lm_eval.models.openai_completions")
    harness = lm_eval.LocalCompletionsAPI
    contexts = [[1, 2, 3, 4], [5, 6]]  # context + continuation token ids, as the harness sends them
    payload = harness._create_payload(types.SimpleNamespace(model="m"), contexts, generate=False)
    assert payload["echo"] is True and payload["max_tokens"] == 1 and payload["logprobs"] == 1
    resp = http.post("/v1/completions", json=payload)
    assert resp.status_code == 200, resp.text
    (ll, greedy), (ll2, _) = harness.parse_logprobs(resp.json(), contexts, ctxlens=[2, 1])
    assert ll == -2.0 and greedy is False and ll2 == -1.0  # continuation tokens 3, 4 and 6 at -1 each


def test_streamed_echo_sends_the_prompt_first_then_the_completion_after_it(http, fake):
    out = post(http, fake, "completions", prompt=[1, 2], echo=True, logprobs=0, stream=True)
    first, second = out.events[0]["choices"][0], out.events[1]["choices"][0]
    assert first["text"] == "<1><2>" and first["logprobs"]["token_logprobs"] == [None, -1.0]
    assert second["text"] == "<7><8>" and second["logprobs"]["text_offset"] == [6, 9]


def test_prompt_logprobs_in_vllms_shape_per_choice_and_at_the_top_of_a_chat(http, fake):
    itself = {"logprob": -1.0, "rank": 3, "decoded_token": "<11>"}
    want = [None, {"11": itself, "900": {"logprob": -0.5, "rank": 1, "decoded_token": "<900>"}}]
    out = post(http, fake, "completions", prompt_logprobs=1, n=2)
    assert [c["prompt_logprobs"][:2] for c in out.body["choices"]] == [want, want]
    assert [s.prompt_logprobs for _, s in fake.sent] == [1, None]
    chat = post(http, fake, "chat", prompt_logprobs=0)
    assert chat.body["prompt_logprobs"][1] == {"11": itself}
    assert "prompt_logprobs" not in chat.body["choices"][0]
    both = post(http, fake, "completions", prompt=[1, 2], echo=True, logprobs=0, prompt_logprobs=2)
    assert both.sampling.prompt_logprobs == 2  # the most either wants; each shows its own N
    assert both.body["choices"][0]["logprobs"]["top_logprobs"][1] == {"<2>": -1.0}
    assert len(both.body["choices"][0]["prompt_logprobs"][1]) == 3


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompt_logprobs_are_refused_when_streaming_as_vllm_does(http, fake, endpoint):
    assert _error(post(http, fake, endpoint, prompt_logprobs=0, stream=True))["param"] == "prompt_logprobs"
    assert not fake.sent


def _readme_bullet(title: str) -> str:
    """The text of the README bullet that starts ``- **<title>**`` (its continuation lines joined)."""
    text = README.read_text()
    start = text.index(f"\n- **{title}**") + 1
    end = text.index("\n- **", start)
    return " ".join(text[start:end].split())


def _fields_named(text: str) -> set[str]:
    """The `field` names of README text, outside parentheses (which hold notes and accepted values)."""
    while (stripped := re.sub(r"\([^()]*\)", "", text)) != text:
        text = stripped
    return set(re.findall(r"`([a-z_]+)`", text))


def test_the_readme_lists_exactly_the_fields_the_code_honours_accepts_and_refuses():
    honoured, accepted = _readme_bullet("Fields").split("**Accepted**")
    code = (_honoured("completions") | _honoured("chat")) - NO_EFFECT
    assert _fields_named(honoured) == code
    assert _fields_named(accepted) == NO_EFFECT
    assert _fields_named(_readme_bullet("Fields refused")) == set(REFUSED)
