"""Request validation names the offending field; good requests get their defaults."""

import pytest

from specmesh.params import SamplingParams, SpecDecodeParams
from specmesh.params import build_request as client_request
from verifier_svc.requests import InvalidRequest, ProposerNotConfigured, RequestLimits, build_request


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path())


LIMITS = RequestLimits(max_context=64, vocab_size=49152, configured_proposers=("ngram",))


def _build(tokenizer, prompt="Hello", sampling=None, spec=None, chat=False):
    return build_request(client_request(prompt, sampling, spec, chat), tokenizer, LIMITS)


@pytest.mark.parametrize(
    ("prompt", "sampling", "spec", "field"),
    [
        ("", None, None, "input.text"),
        ([], None, None, "input.token_ids"),
        ([{"role": "user", "content": ""}], None, None, "input.chat"),
        ([1, 2, 49152], None, None, "input.token_ids"),
        ("word " * 100, None, None, "input.text"),
        ("hi", SamplingParams(max_tokens=-1), None, "sampling.max_tokens"),
        ("hi", SamplingParams(max_tokens=4, min_tokens=5), None, "sampling.min_tokens"),
        ("hi", SamplingParams(min_tokens=-1), None, "sampling.min_tokens"),
        ("hi", SamplingParams(logit_bias={49152: 1.0}), None, "sampling.logit_bias"),
        ("hi", SamplingParams(logit_bias={5: 101.0}), None, "sampling.logit_bias"),
        ("hi", SamplingParams(logit_bias={5: float("nan")}), None, "sampling.logit_bias"),
        ("hi", SamplingParams(logit_bias=dict.fromkeys(range(301), 1.0)), None, "sampling.logit_bias"),
        ("hi", SamplingParams(allowed_token_ids=(3, -1)), None, "sampling.allowed_token_ids"),
        ("hi", SamplingParams(presence_penalty=2.5), None, "sampling.presence_penalty"),
        ("hi", SamplingParams(frequency_penalty=-2.5), None, "sampling.frequency_penalty"),
        ("hi", SamplingParams(frequency_penalty=float("inf")), None, "sampling.frequency_penalty"),
        ("hi", SamplingParams(repetition_penalty=0.0), None, "sampling.repetition_penalty"),
        ("hi", SamplingParams(repetition_penalty=2.1), None, "sampling.repetition_penalty"),
        ("hi", SamplingParams(min_p=1.5), None, "sampling.min_p"),
        ("hi", SamplingParams(min_p=-0.1), None, "sampling.min_p"),
        ("hi", SamplingParams(prompt_logprobs=21), None, "sampling.prompt_logprobs"),
        ("hi", SamplingParams(max_tokens=64), None, "sampling.max_tokens"),
        ("hi", SamplingParams(logprobs=21), None, "sampling.logprobs"),
        ("hi", SamplingParams(logprobs=-1), None, "sampling.logprobs"),
        ("hi", SamplingParams(stop_token_ids=(49152,)), None, "sampling.stop_token_ids"),
        ("hi", SamplingParams(temperature=-0.1), None, "sampling.temperature"),
        ("hi", SamplingParams(temperature=float("nan")), None, "sampling.temperature"),
        ("hi", SamplingParams(top_p=0.0), None, "sampling.top_p"),
        ("hi", SamplingParams(top_p=1.5), None, "sampling.top_p"),
        ("hi", SamplingParams(top_k=-1), None, "sampling.top_k"),
        ("hi", None, SpecDecodeParams(proposer="medusa"), "spec_decode.proposer"),
        ("hi", None, SpecDecodeParams(num_speculative_tokens=-1), "spec_decode.num_speculative_tokens"),
        ("hi", None, SpecDecodeParams(max_tree_nodes=10_000), "spec_decode.max_tree_nodes"),
        ("hi", None, SpecDecodeParams(workload_tag="x" * 65), "spec_decode.workload_tag"),
        ("hi", None, SpecDecodeParams(workload_tag="a\nb"), "spec_decode.workload_tag"),
        ("hi", None, SpecDecodeParams(num_speculative_tokens=2**31 - 1), "spec_decode.num_speculative_tokens"),
        ("hi", None, SpecDecodeParams(max_tree_nodes=2**31 - 1), "spec_decode.max_tree_nodes"),
        ("hi", None, SpecDecodeParams(corpus="x" * 65), "spec_decode.corpus"),
        ("hi", None, SpecDecodeParams(corpus="a\nb"), "spec_decode.corpus"),
        ("hi", None, SpecDecodeParams(cache_scope="x" * 129), "spec_decode.cache_scope"),
        ("hi", None, SpecDecodeParams(cache_scope="a\tb"), "spec_decode.cache_scope"),
    ],
)
def test_bad_input_is_rejected_naming_the_field(tokenizer, prompt, sampling, spec, field):
    with pytest.raises(InvalidRequest) as err:
        _build(tokenizer, prompt, sampling, spec)
    assert err.value.field == field
    assert str(err.value).startswith(field)


def test_known_but_unconfigured_proposer_is_a_precondition_failure(tokenizer):
    with pytest.raises(ProposerNotConfigured, match="'draft' is not configured"):
        _build(tokenizer, spec=SpecDecodeParams(proposer="draft"))
    assert _build(tokenizer, spec=SpecDecodeParams(proposer="NGRAM")).spec_params.proposer == "ngram"


def test_defaults_and_chat_template(tokenizer):
    req = _build(tokenizer, "Hi there", chat=True)
    # max_tokens unset: what remains of the context after the prompt
    assert (req.temperature, req.top_p, req.top_k, req.max_tokens) == (1.0, 1.0, 0, 64 - len(req.prompt_ids))
    assert req.logprobs is None and req.stop_token_ids == frozenset()
    assert req.spec_params.proposer == "auto" and req.request_id
    assert tokenizer.decode(req.prompt_ids).rstrip().endswith("assistant")
    seeded = _build(tokenizer, sampling=SamplingParams(seed=7, temperature=0))
    assert seeded.seed == 7 and seeded.temperature == 0.0


def test_prompt_plus_max_tokens_over_the_context_names_both_numbers(tokenizer):
    prompt = client_request("Hello", None, None, False)
    n = len(build_request(prompt, tokenizer, LIMITS).prompt_ids)
    assert _build(tokenizer, sampling=SamplingParams(max_tokens=64 - n)).max_tokens == 64 - n  # exactly fits
    with pytest.raises(InvalidRequest, match=rf"prompt has {n} tokens and max_tokens is {65 - n}.*context of 64"):
        _build(tokenizer, sampling=SamplingParams(max_tokens=65 - n))


def test_logprobs_and_stop_token_ids_reach_the_request(tokenizer):
    req = _build(tokenizer, sampling=SamplingParams(logprobs=0, stop_token_ids=(2, 7)))
    assert req.logprobs == 0 and req.stop_token_ids == frozenset({2, 7})


def test_logits_controls_reach_the_request_and_only_they_turn_processing_on(tokenizer):
    plain = _build(tokenizer, sampling=SamplingParams(max_tokens=0, min_p=0.2, prompt_logprobs=3))
    assert (plain.max_tokens, plain.prompt_logprobs, plain.repetition_penalty) == (0, 3, 1.0)
    assert plain.min_p == pytest.approx(0.2)
    assert not plain.has_controls  # min_p acts in the sampler, prompt logprobs in prefill
    req = _build(
        tokenizer,
        sampling=SamplingParams(
            max_tokens=8, min_tokens=2, logit_bias={9: -1.5, 4: 2.0}, allowed_token_ids=(4, 9, 11),
            presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.1,
        ),
    )  # fmt: skip
    assert req.has_controls and req.logit_bias == ((4, 2.0), (9, -1.5)) and req.allowed_token_ids == {4, 9, 11}
    assert (req.min_tokens, req.presence_penalty, req.frequency_penalty) == (2, 0.5, -0.25)
    assert req.repetition_penalty == pytest.approx(1.1)
    for one in (dict(min_tokens=1), dict(logit_bias={1: 0.5}), dict(repetition_penalty=0.9)):
        assert _build(tokenizer, sampling=SamplingParams(max_tokens=4, **one)).has_controls, one


def test_temperatures_below_the_greedy_epsilon_are_greedy():
    for t in (1e-45, 1e-38, 9e-6):
        assert _build(tokenizer=None, prompt=[1, 2], sampling=SamplingParams(temperature=t)).temperature == 0.0
    assert _build(tokenizer=None, prompt=[1, 2], sampling=SamplingParams(temperature=1e-4)).temperature > 0


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_a_prompt_too_long_to_fit_in_any_tokenization_is_refused_before_tokenizing(tokenizer, chat):
    """64 tokens of this vocabulary hold at most ``max_prompt_bytes`` bytes: longer text cannot fit,
    so it is refused from its size alone; text just under that is tokenized (and refused by count)."""
    from dataclasses import replace

    from specmesh.params import build_request as message
    from verifier_svc.requests import max_prompt_bytes

    limits = replace(LIMITS, max_prompt_bytes=max_prompt_bytes(tokenizer, LIMITS.max_context))
    assert 64 * 4 < limits.max_prompt_bytes <= 64 * 256  # the longest vocabulary entry, times the context
    field = "input.chat" if chat else "input.text"

    def prompt(n: int):
        text = "x" * n
        return [{"role": "user", "content": text}] if chat else text

    with pytest.raises(InvalidRequest, match="refused before tokenizing") as over:
        build_request(message(prompt(limits.max_prompt_bytes + 1), None, None, chat), tokenizer, limits)
    assert over.value.field == field
    with pytest.raises(InvalidRequest, match="tokens; the model's context") as under:
        build_request(message(prompt(limits.max_prompt_bytes), None, None, chat), tokenizer, limits)
    assert under.value.field == field


def test_request_id_is_a_bounded_printable_label_and_a_missing_one_is_made():
    from verifier_svc.requests import MAX_REQUEST_ID_CHARS

    def build(request_id: str):
        return build_request(client_request([1, 2], None, None, False, request_id), None, LIMITS)

    assert build("a" * MAX_REQUEST_ID_CHARS).request_id == "a" * MAX_REQUEST_ID_CHARS
    for bad in ("a" * (MAX_REQUEST_ID_CHARS + 1), "x" * 2**20, "a\nb"):
        with pytest.raises(InvalidRequest, match=f"at most {MAX_REQUEST_ID_CHARS} characters") as err:
            build(bad)
        assert err.value.field == "request_id" and len(str(err.value)) < 200  # the id is not echoed
    made = {build("").request_id for _ in range(2)}
    assert len(made) == 2 and all(len(rid) == 32 for rid in made)  # a fresh uuid each
