"""Tokenize and Detokenize as pure functions over the real tokenizer: what they answer, what they refuse."""

from __future__ import annotations

import pytest

from specmesh.v1 import generation_pb2
from verifier_svc.requests import InvalidRequest, RequestLimits
from verifier_svc.tokenization import detokenize, tokenize

LIMITS = RequestLimits(max_context=8192, vocab_size=49152, max_prompt_bytes=1000)
CHAT = [("system", "Answer briefly."), ("user", "What is 2 + 2?"), ("assistant", "4."), ("user", "And 3 + 3?")]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path())


def _chat(turns=CHAT) -> generation_pb2.ChatMessages:
    return generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in turns])


def _template(tokenizer, add_generation_prompt: bool = True) -> list[int]:
    messages = [{"role": r, "content": c} for r, c in CHAT]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def test_text_is_the_tokenizers_encode_and_reports_the_context(tokenizer):
    text = "Tokenizers split words: naïve café, 東京, and emoji 🙂."
    out = tokenize(generation_pb2.TokenizeRequest(text=text), tokenizer, LIMITS)
    assert list(out.tokens) == tokenizer.encode(text, add_special_tokens=True)
    assert out.max_model_len == 8192 and not out.token_strs
    plain = tokenize(generation_pb2.TokenizeRequest(text=text, add_special_tokens=False), tokenizer, LIMITS)
    assert list(plain.tokens) == tokenizer.encode(text, add_special_tokens=False)


def test_a_chat_is_the_template_generate_renders_and_token_strs_are_the_tokenizers(tokenizer):
    req = generation_pb2.TokenizeRequest(chat=_chat(), return_token_strs=True)
    out = tokenize(req, tokenizer, LIMITS)
    assert list(out.tokens) == _template(tokenizer)
    assert list(out.token_strs) == tokenizer.convert_ids_to_tokens(_template(tokenizer))
    bare = tokenize(generation_pb2.TokenizeRequest(chat=_chat(), add_generation_prompt=False), tokenizer, LIMITS)
    assert list(bare.tokens) == _template(tokenizer, add_generation_prompt=False)
    assert len(bare.tokens) < len(out.tokens)  # no assistant header
    special = tokenize(generation_pb2.TokenizeRequest(chat=_chat(), add_special_tokens=True), tokenizer, LIMITS)
    text = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in CHAT], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    assert list(special.tokens) == tokenizer.encode(text, add_special_tokens=True)


def test_detokenize_is_the_tokenizers_decode_and_round_trips(tokenizer):
    ids = _template(tokenizer)
    out = detokenize(generation_pb2.DetokenizeRequest(tokens=ids), tokenizer, LIMITS)
    assert out.text == tokenizer.decode(ids) and "What is 2 + 2?" in out.text
    text = "def f(x):\n    return x * 2  # double"
    ids = tokenize(generation_pb2.TokenizeRequest(text=text), tokenizer, LIMITS).tokens
    assert detokenize(generation_pb2.DetokenizeRequest(tokens=ids), tokenizer, LIMITS).text == text


@pytest.mark.parametrize(
    ("request_", "field", "words"),
    [
        (generation_pb2.TokenizeRequest(), "input", "set text or chat"),
        (generation_pb2.TokenizeRequest(text=""), "input.text", "empty"),
        (generation_pb2.TokenizeRequest(text="x" * 1001), "input.text", "1001 bytes"),
        (generation_pb2.TokenizeRequest(chat=generation_pb2.ChatMessages()), "input.chat", "no messages"),
        (generation_pb2.TokenizeRequest(chat=_chat([("robot", "hi")])), "input.chat", "unknown role 'robot'"),
        (generation_pb2.TokenizeRequest(chat=_chat([("user", "é" * 501)])), "input.chat", "1002 bytes"),
    ],
)
def test_bad_tokenize_input_names_its_field(tokenizer, request_, field, words):
    with pytest.raises(InvalidRequest) as err:
        tokenize(request_, tokenizer, LIMITS)
    assert err.value.field == field and words in str(err.value)


@pytest.mark.parametrize(("ids", "words"), [([], "no token ids"), ([5, 49152], "49152 outside"), ([-1], "-1 outside")])
def test_bad_detokenize_input_names_tokens(tokenizer, ids, words):
    with pytest.raises(InvalidRequest) as err:
        detokenize(generation_pb2.DetokenizeRequest(tokens=ids), tokenizer, LIMITS)
    assert err.value.field == "tokens" and words in str(err.value)
