"""A request field is defined once, in the proto (protos/specmesh/v1/params.proto).

The SDK's dataclasses mirror it field by field (their ``to_proto`` goes by name), the gateway's
``spec_decode`` body is made from the SDK dataclass, and the verifier's validated request carries
every field on: these tests fail the day a field is added in one layer and not the others.
"""

from __future__ import annotations

import dataclasses

import pytest

from gateway_svc.protocol import CompletionRequest, SpecDecode
from specmesh.params import SamplingParams, SpecDecodeParams, StructuredOutput
from specmesh.v1 import generation_pb2, params_pb2
from verifier_svc.requests import GenerationRequest, RequestLimits, SpecParams, build_request

PAIRS = [(SamplingParams, params_pb2.SamplingParams), (SpecDecodeParams, params_pb2.SpecDecodeParams)]
# One value per field, none of them the default, each one the verifier accepts.
SAMPLING = SamplingParams(
    temperature=0.5, top_p=0.9, top_k=7, seed=11, max_tokens=5, stop=("\n\n",), ignore_eos=True, logprobs=2,
    stop_token_ids=(3, 4), min_tokens=2, logit_bias={5: -1.5, 9: 100.0}, allowed_token_ids=(5, 6, 9),
    presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.25, min_p=0.05, prompt_logprobs=1,
)  # fmt: skip
# structured_output (which ignore_eos cannot go with) is carried by a copy of its own.
GRAMMAR = StructuredOutput(json_schema='{"type": "integer"}', any_whitespace=True)
CONSTRAINED = dataclasses.replace(SAMPLING, ignore_eos=False, structured_output=GRAMMAR)
SPEC = SpecDecodeParams(
    proposer="ngram", num_speculative_tokens=3, max_tree_nodes=9, workload_tag="qa", corpus="docs", cache_scope="t1"
)


@pytest.mark.parametrize(("sdk", "message"), PAIRS, ids=lambda x: getattr(x, "__name__", ""))
def test_each_sdk_dataclass_has_the_protos_fields_in_order_with_matching_defaults(sdk, message) -> None:
    proto_fields = message.DESCRIPTOR.fields
    assert [f.name for f in dataclasses.fields(sdk)] == [f.name for f in proto_fields]
    for f, pf in zip(dataclasses.fields(sdk), proto_fields, strict=True):
        if pf.message_type is not None and pf.message_type.GetOptions().map_entry:
            assert f.default_factory() == {}, f.name  # map: an empty dict
        elif pf.is_repeated:
            assert f.default == (), f.name  # repeated: an empty tuple
        elif pf.has_presence:
            assert f.default is None, f.name  # proto3 optional: None leaves it unset (the server's default)
        else:
            assert f.default == pf.default_value or (f.name == "proposer" and f.default == "auto"), f.name


@pytest.mark.parametrize(("sdk", "message"), PAIRS, ids=lambda x: getattr(x, "__name__", ""))
def test_to_proto_carries_every_field(sdk, message) -> None:
    params = CONSTRAINED if sdk is SamplingParams else SPEC
    msg = params.to_proto()
    for f in dataclasses.fields(sdk):
        value, want = getattr(msg, f.name), getattr(params, f.name)
        if f.name == "structured_output":
            want = want.to_proto()
        elif isinstance(want, tuple):
            value = tuple(value)
        elif isinstance(want, dict):
            value = dict(value)
        assert value == pytest.approx(want), f.name
    assert not SamplingParams().to_proto().HasField("temperature")  # None: unset, not 0
    assert not SamplingParams().to_proto().HasField("prompt_logprobs")


def test_the_gateways_spec_decode_body_is_the_sdk_dataclass() -> None:
    assert {name: f.default for name, f in SpecDecode.model_fields.items()} == {
        f.name: f.default for f in dataclasses.fields(SpecDecodeParams)
    }
    body = {"model": "m", "prompt": "x", "spec_decode": dataclasses.asdict(SPEC)}
    assert CompletionRequest.model_validate(body).spec() == SPEC
    with pytest.raises(ValueError, match="proposr"):  # our own parameters: a misspelt one is refused
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "spec_decode": {"proposr": "ngram"}})


def test_the_gateway_sets_every_sampling_field() -> None:
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 11, "stop": ["\n\n"],
         "ignore_eos": True, "stop_token_ids": [3, 4], "min_tokens": 2, "logit_bias": {"5": -1.5, "9": 100},
         "allowed_token_ids": [5, 6, 9], "presence_penalty": 0.5, "frequency_penalty": -0.25,
         "repetition_penalty": 1.25, "min_p": 0.05, "max_tokens": 5, "logprobs": 2, "prompt_logprobs": 1}
    )  # fmt: skip
    assert body.sampling_for(0) == SAMPLING


def test_every_field_reaches_the_verifiers_validated_request() -> None:
    msg = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[1, 2, 3]), sampling=SAMPLING.to_proto(), spec_decode=SPEC.to_proto()
    )
    limits = RequestLimits(max_context=64, vocab_size=100, configured_proposers=("ngram",))
    req = build_request(msg, tokenizer=None, limits=limits)
    msg.sampling.CopyFrom(CONSTRAINED.to_proto())
    grammar = build_request(msg, tokenizer=None, limits=limits).structured_output
    assert (grammar.kind, grammar.value, grammar.any_whitespace) == ("json_schema", GRAMMAR.json_schema, True)
    for f in dataclasses.fields(SamplingParams):
        if f.name == "structured_output":
            continue
        got, want = getattr(req, f.name), getattr(SAMPLING, f.name)
        got = dict(got) if f.name == "logit_bias" else sorted(got) if isinstance(got, frozenset) else got
        assert got == pytest.approx(list(want) if isinstance(want, tuple) and f.name != "stop" else want), f.name
    assert {f.name for f in dataclasses.fields(SpecParams)} == {f.name for f in dataclasses.fields(SpecDecodeParams)}
    assert {f.name: getattr(req.spec_params, f.name) for f in dataclasses.fields(SpecParams)} == dataclasses.asdict(
        SPEC
    )
    assert {f.name for f in dataclasses.fields(GenerationRequest)} >= {
        f.name for f in dataclasses.fields(SamplingParams)
    }
