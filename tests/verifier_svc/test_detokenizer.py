"""Incremental detokenization with the real tokenizer: multi-byte text, spaces, stop strings."""

import pytest

from verifier_svc.detokenizer import StopStringFilter, StreamDetokenizer, WindowDetokenizer, detokenizer_for


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path())


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! Ça va? 東京タワー 🚀🎉 naïve café",
        "  leading spaces\n\ttabs and\r\nnewlines",
        "def f(x):\n    return x**2",
    ],
)
@pytest.mark.parametrize("kind", ["decode-stream", "window"])
def test_token_by_token_pieces_concatenate_to_the_full_decode_without_broken_characters(tokenizer, text, kind):
    prompt = tokenizer.encode("Say something:")
    ids = tokenizer.encode(text)
    if kind == "window":
        detok = WindowDetokenizer.for_prompt(tokenizer, prompt)
    else:
        detok = detokenizer_for(tokenizer, prompt)
        assert isinstance(detok, StreamDetokenizer)  # a fast tokenizer gets tokenizers' DecodeStream
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_chunks_of_several_tokens_and_a_cut_character_at_the_end(tokenizer):
    """A speculative step pushes several tokens at once; a generation cut inside a multi-byte
    character flushes what is left as replacement characters, as the window method does."""
    ids = tokenizer.encode("Ça va? 東京タワー 🚀 fin")
    stream, window = detokenizer_for(tokenizer, []), WindowDetokenizer.for_prompt(tokenizer, [])
    chunks = [ids[i : i + 3] for i in range(0, len(ids), 3)]
    assert "".join(stream.push(c) for c in chunks) + stream.flush() == tokenizer.decode(ids)
    rocket = tokenizer.encode("🚀")
    assert len(rocket) > 1  # byte-level pieces of one character
    cut = detokenizer_for(tokenizer, [])
    assert cut.push(rocket[:1]) == "" and window.push(rocket[:1]) == ""
    assert cut.flush() == window.flush() == "\ufffd"


def test_stop_string_split_across_chunks_is_found_and_never_emitted():
    f = StopStringFilter(["</answer>", "STOP"])
    out = [f.push(x) for x in ["The answer is 42.</", "ans", "wer> trailing"]]
    assert "".join(out) == "The answer is 42."
    assert f.matched == "</answer>"
    assert f.push("more") == ""


def test_held_back_prefix_is_released_when_it_cannot_become_a_stop_string():
    f = StopStringFilter(["STOP"])
    assert f.push("ST") == ""
    assert f.push("AR") == "STAR"
    assert f.push("S") == ""
    assert f.flush() == "S"
