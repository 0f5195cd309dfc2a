"""Request validation names the offending field; good requests get their defaults."""

import pytest

from specmesh.params import SamplingParams, SpecDecodeParams
from specmesh.params import build_request as client_request
from verifier_svc.requests import InvalidRequest, ProposerNotConfigured, RequestLimits, build_request


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from specmesh.model_loading import resolve_model_path

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
        ("hi", SamplingParams(max_tokens=0), None, "sampling.max_tokens"),
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
    assert _build(tokenizer, spec=SpecDecodeParams(proposer="NGRAM")).spec.proposer == "ngram"


def test_defaults_and_chat_template(tokenizer):
    req = _build(tokenizer, "Hi there", chat=True)
    assert (req.temperature, req.top_p, req.top_k, req.max_tokens) == (1.0, 1.0, 0, 256)
    assert req.spec.proposer == "auto" and req.request_id
    assert tokenizer.decode(req.prompt_ids).rstrip().endswith("assistant")
    seeded = _build(tokenizer, sampling=SamplingParams(seed=7, temperature=0))
    assert seeded.seed == 7 and seeded.temperature == 0.0
