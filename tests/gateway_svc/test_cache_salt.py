"""vLLM's ``cache_salt`` through the real gateway and verifier: a prompt's cached blocks are reused by a
request with the same salt, never by one with another salt or none (``prompt_tokens_details.cached_tokens``),
and the answers are the same either way."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

PROMPT = "Summarise the history of the printing press in Europe, from Gutenberg to the steam press, in detail. " * 3


@pytest.fixture(scope="module")
def gateway(ngram_gateway):
    return ngram_gateway


def _cached(oai, model, **extra) -> tuple[int, str]:
    r = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0, extra_body=extra
    )
    return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content


def test_a_salt_shares_cached_prompt_blocks_only_with_the_same_salt(oai, model):
    first, text = _cached(oai, model, cache_salt="alpha-7f3c")
    assert first == 0  # a salt no one used yet: nothing cached under it
    same, same_text = _cached(oai, model, cache_salt="alpha-7f3c")
    assert same > 0 and same_text == text
    other, other_text = _cached(oai, model, cache_salt="beta-91aa")
    assert other == 0 and other_text == text
    unsalted, _ = _cached(oai, model)
    # the salted requests' blocks are not the unsalted chain's: at most the chat template's opening block,
    # which other unsalted requests on this verifier share, is found
    assert unsalted < same, (unsalted, same)
    with pytest.raises(openai.BadRequestError) as exc:
        _cached(oai, model, cache_salt="")
    assert exc.value.body["param"] == "cache_salt"
