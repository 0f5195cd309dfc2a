"""Request bodies → SDK parameters, and verifier statuses → OpenAI errors, without a server."""

import grpc
import pytest
from pydantic import ValidationError

from gateway_svc.errors import from_grpc
from gateway_svc.protocol import ChatCompletionRequest, CompletionRequest, RequestError


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def test_choices_get_consecutive_seeds_and_the_fields_openai_and_vllm_define():
    req = _chat(
        seed=41,
        n=3,
        temperature=0.5,
        top_p=0.9,
        top_k=7,
        stop="END",
        max_completion_tokens=12,
        stop_token_ids=[2],
        ignore_eos=True,
        logprobs=True,
        top_logprobs=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.3,
        min_p=0.05,
        min_tokens=4,
        logit_bias={"17": -100, " 5": 2.5},
        allowed_token_ids=[5, 17, 30],
        prompt_logprobs=2,
    )
    req.check(max_n=8)
    p = req.sampling_for(2)
    assert (p.seed, p.temperature, p.top_p, p.top_k, p.stop, p.max_tokens) == (43, 0.5, 0.9, 7, ("END",), 12)
    assert (p.logprobs, p.stop_token_ids, p.ignore_eos) == (3, (2,), True)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.5, -0.5, 1.3, 0.05)
    assert (p.min_tokens, p.logit_bias, p.allowed_token_ids) == (4, {17: -100.0, 5: 2.5}, (5, 17, 30))
    assert (p.prompt_logprobs, req.sampling_for(0).prompt_logprobs) == (None, 2)  # the first choice asks for them
    assert _chat().sampling_for(0).seed is None and _chat().sampling_for(0).max_tokens is None
    assert _chat(logprobs=True).sampling_for(0).logprobs == 0 and _chat().sampling_for(0).logprobs is None


def test_spec_decode_from_extra_body_reaches_the_sdk_params():
    spec = _chat(spec_decode={"proposer": "ngram", "num_speculative_tokens": 4, "workload_tag": "code"}).spec()
    assert (spec.proposer, spec.num_speculative_tokens, spec.workload_tag) == ("ngram", 4, "code")
    assert _chat().spec().proposer == "auto"


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"n": 9}, "n"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"the": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
        ({"min_tokens": 5, "max_completion_tokens": 3}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),  # chat: at least 1 (a completion may only prefill)
        ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"request_id": "x" * 201}, "request_id"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"structural_tag": "{}"}, "structural_tag"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"seed": -1}, "seed"),
    ],
)
def test_fields_the_server_cannot_honour_are_refused_by_name(kw, param):
    with pytest.raises(RequestError) as err:
        _chat(**kw).check(max_n=8)
    assert err.value.param == param and err.value.status == 400


def test_completion_prompts_and_their_refusals():
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
    CompletionRequest(model="m", prompt="x", max_tokens=0, echo=True, best_of=1).check(max_n=8)  # prefill only
    for kw, param in (
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "logprobs": 30}, "logprobs"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
    ):
        with pytest.raises(RequestError) as err:
            CompletionRequest(model="m", **kw).check(max_n=8)
        assert err.value.param == param


def test_text_parts_are_joined_and_other_parts_refused():
    req = _chat()
    req = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    )
    assert req.chat() == [{"role": "user", "content": "ab"}]
    img = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(RequestError, match="image_url") as err:
        img.chat()
    assert err.value.param == "messages.0"


def test_missing_messages_and_unknown_fields_fail_validation():
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[])
    with pytest.raises(ValidationError, match="extra_forbidden"):
        _chat(some_unknown_field=1)


@pytest.mark.parametrize(
    ("code", "details", "status", "kind", "param"),
    [
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.top_p: must be in (0, 1], got 3.0",
            400,
            "invalid_request_error",
            "top_p",
        ),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.max_tokens: the prompt has 9 tokens",
            400,
            "invalid_request_error",
            "max_completion_tokens",
        ),
        (
            grpc.StatusCode.FAILED_PRECONDITION,
            "spec_decode.proposer: proposer 'draft' is not configured",
            400,
            "invalid_request_error",
            "spec_decode.proposer",
        ),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.min_tokens: must be in [0, max_tokens = 3], got 5",
            400,
            "invalid_request_error",
            "min_tokens",
        ),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.allowed_token_ids: token id 99999 outside the vocabulary [0, 49152)",
            400,
            "invalid_request_error",
            "allowed_token_ids",
        ),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many concurrent requests", 429, "rate_limit_error", None),
        (  # too large for the KV budget even alone: retrying cannot help
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "the request needs up to 9000 KV cache positions (…) over this verifier's KV budget of 6826 positions "
            "(--kv-cache-memory); send a shorter prompt or a lower max_tokens",
            400,
            "invalid_request_error",
            "max_completion_tokens",
        ),
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses", 503, "service_unavailable_error", None),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", 504, "timeout_error", None),
        (grpc.StatusCode.INTERNAL, "engine step failed", 500, "server_error", None),
    ],
)
def test_grpc_statuses_map_to_openai_errors(code, details, status, kind, param):
    err = from_grpc(_RpcError(code, details), max_tokens_param="max_completion_tokens")
    assert (err.status, err.type, err.param) == (status, kind, param)
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    if param:  # the message names the field as the client sent it
        assert body["message"].startswith(param + ":")
