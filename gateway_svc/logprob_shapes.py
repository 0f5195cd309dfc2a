"""Logprobs in the shapes clients read (pure functions, no I/O): the chat ``logprobs.content``, the
legacy completion's ``logprobs`` object (with echo, the prompt's tokens first: the first one has
nothing before it, so its entries are null), and vLLM's ``prompt_logprobs``.

A logprob of -inf (a token that logit_bias or allowed_token_ids removed) is written -9999.0, as vLLM
does: JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Sequence

from specmesh.params import PromptLogprobs, TokenLogprob

NO_CHANCE = -9999.0


def finite(logprob: float) -> float:
    """``logprob``, with -inf (and NaN) as -9999.0.

    >>> finite(-0.5), finite(float("-inf"))
    (-0.5, -9999.0)
    """
    return logprob if logprob > NO_CHANCE else NO_CHANCE


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict:
    """``choices[i].logprobs`` of a chat completion (or the delta of one chunk)."""
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": finite(lp.logprob),
                "bytes": _utf8(lp.token),
                "top_logprobs": [
                    {"token": t.token, "logprob": finite(t.logprob), "bytes": _utf8(t.token)} for t in lp.top
                ],
            }
            for lp in logprobs
        ]
    }


def _top(lp: TokenLogprob, n: int) -> dict[str, float]:
    """The N most likely tokens and the token itself (OpenAI: "up to logprobs + 1 elements")."""
    top = {t.token: finite(t.logprob) for t in lp.top[:n]}
    top.setdefault(lp.token, finite(lp.logprob))
    return top


def completion_logprobs(logprobs: Sequence[TokenLogprob], offset: int = 0, n: int = 20) -> dict:
    """``choices[i].logprobs`` of a legacy completion; ``offset``: characters of text before these tokens.

    >>> from specmesh.params import TopLogprob
    >>> lps = [TokenLogprob(-0.5, "Hi", (TopLogprob(1, -0.5, "Hi"),)), TokenLogprob(-1.0, "!", ())]
    >>> out = completion_logprobs(lps, offset=3)
    >>> out["text_offset"], out["top_logprobs"]
    ([3, 5], [{'Hi': -0.5}, {'!': -1.0}])
    """
    offsets, at = [], offset
    for lp in logprobs:
        offsets.append(at)
        at += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [finite(lp.logprob) for lp in logprobs],
        "top_logprobs": [_top(lp, n) for lp in logprobs],
        "text_offset": offsets,
    }


def echo_logprobs(prompt: PromptLogprobs, first_token: str, n: int) -> dict:
    """The legacy ``logprobs`` object of a prompt's tokens (echo): the first token's logprob and
    alternatives are null, each later one's are under the model given the tokens before it.

    >>> from specmesh.params import TopLogprob
    >>> p = PromptLogprobs([5, 6], [TokenLogprob(-2.0, " cat", (TopLogprob(7, -0.1, " dog"),), rank=4)])
    >>> out = echo_logprobs(p, "A", n=1)
    >>> out["tokens"], out["token_logprobs"], out["text_offset"]
    (['A', ' cat'], [None, -2.0], [0, 1])
    >>> out["top_logprobs"]
    [None, {' dog': -0.1, ' cat': -2.0}]
    """
    rest = completion_logprobs(prompt.logprobs, len(first_token), n)
    return {
        "tokens": [first_token, *rest["tokens"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
        "text_offset": [0, *rest["text_offset"]],
    }


def joined(first: dict, then: dict) -> dict:
    """Two legacy ``logprobs`` objects one after the other (the prompt's, then the completion's).

    >>> joined({"tokens": ["a"], "text_offset": [0]}, {"tokens": ["b"], "text_offset": [1]})
    {'tokens': ['a', 'b'], 'text_offset': [0, 1]}
    """
    return {key: [*first[key], *then[key]] for key in first}


def vllm_prompt_logprobs(prompt: PromptLogprobs, n: int) -> list[dict[int, dict] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, {token id: {logprob, rank, decoded_token}} for the
    token itself and the N most likely tokens at its position; the first token's entry is null.

    >>> from specmesh.params import TopLogprob
    >>> p = PromptLogprobs([5, 6], [TokenLogprob(-2.0, " cat", (TopLogprob(7, -0.1, " dog"),), rank=4)])
    >>> first, second = vllm_prompt_logprobs(p, n=1)
    >>> first, second[6], second[7]
    (None, {'logprob': -2.0, 'rank': 4, 'decoded_token': ' cat'}, {'logprob': -0.1, 'rank': 1, 'decoded_token': ' dog'})
    """
    out: list[dict[int, dict] | None] = [None]
    for token_id, lp in zip(prompt.token_ids[1:], prompt.logprobs, strict=True):
        entry = {token_id: {"logprob": finite(lp.logprob), "rank": lp.rank or None, "decoded_token": lp.token}}
        for rank, t in enumerate(lp.top[:n], start=1):
            entry.setdefault(t.token_id, {"logprob": finite(t.logprob), "rank": rank, "decoded_token": t.token})
        out.append(entry)
    return out
