"""The client SDK's typed params map onto the contract."""

from specmesh import SamplingParams, SpecDecodeParams
from specmesh.params import build_request

# Importing without torch, transformers or any server package: tests/specmesh/test_client_install.py.


def test_unset_sampling_fields_stay_unset_on_the_wire():
    msg = SamplingParams(temperature=0.0, stop=("\n\n",)).to_proto()
    assert msg.HasField("temperature") and msg.temperature == 0.0
    assert not msg.HasField("top_p") and not msg.HasField("seed") and not msg.HasField("max_tokens")
    assert list(msg.stop) == ["\n\n"]


def test_prompt_kinds_map_to_the_input_oneof():
    spec = SpecDecodeParams(proposer="none", workload_tag="code")
    assert build_request("hi", None, spec, chat=False).WhichOneof("input") == "text"
    chat = build_request("hi", None, spec, chat=True)
    assert chat.WhichOneof("input") == "chat" and chat.chat.messages[0].role == "user"
    assert list(build_request([5, 6], None, None, chat=False).token_ids.ids) == [5, 6]
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert len(build_request(convo, None, None, chat=False).chat.messages) == 2
    assert chat.spec_decode.workload_tag == "code"


def test_tokenize_requests_leave_unset_flags_to_the_server_and_tokens_read_the_answer():
    from specmesh import Tokens
    from specmesh.params import build_tokenize_request
    from specmesh.v1 import generation_pb2

    text = build_tokenize_request("hi", chat=False)
    assert text.WhichOneof("input") == "text" and text.text == "hi"
    assert not text.HasField("add_special_tokens") and not text.HasField("add_generation_prompt")
    turn = build_tokenize_request("hi", chat=True, add_special_tokens=False, add_generation_prompt=False)
    assert turn.chat.messages[0].role == "user" and turn.HasField("add_special_tokens") and not turn.add_special_tokens
    assert build_tokenize_request([], chat=False).WhichOneof("input") == "chat"  # the server refuses it, naming it
    resp = generation_pb2.TokenizeResponse(tokens=[1, 2], token_strs=["a", "b"], max_model_len=8192)
    assert Tokens.from_proto(resp, with_strs=True) == Tokens([1, 2], ["a", "b"], 8192)
    assert Tokens.from_proto(resp, with_strs=False).token_strs is None
