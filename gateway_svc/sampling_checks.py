"""Range checks of request fields as OpenAI and vLLM bound them: each a pure function that returns the
value the SDK takes or raises a 400 naming the field. The verifier checks them again (and what only
it knows, such as the vocabulary's size); these answer before a request is opened, and keep a value
the gRPC message cannot carry (an int beyond int32) from becoming a 500."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from gateway_svc.errors import RequestError

INT32_MAX = 2**31 - 1
MAX_LOGIT_BIAS = 300  # entries, as OpenAI


def in_range(name: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` if it lies in [lo, hi] (or (lo, hi] with ``lo_open``).

    >>> in_range("min_p", 0.5, 0, 1)
    0.5
    >>> in_range("repetition_penalty", 0, 0, 2, lo_open=True)
    Traceback (most recent call last):
    gateway_svc.errors.RequestError: repetition_penalty must be in (0, 2], got 0
    """
    if not math.isfinite(value) or not lo <= value <= hi or (lo_open and value == lo):
        raise RequestError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", name)
    return float(value)


def int32(name: str, value: int, lo: int = 0) -> int:
    """``value`` if it lies in [lo, 2**31 - 1] (what the gRPC message carries).

    >>> int32("max_tokens", 16)
    16
    >>> int32("max_tokens", 2**40)
    Traceback (most recent call last):
    gateway_svc.errors.RequestError: max_tokens must be in [0, 2147483647], got 1099511627776
    """
    if not lo <= value <= INT32_MAX:
        raise RequestError(f"{name} must be in [{lo}, {INT32_MAX}], got {value}", name)
    return value


def token_ids(name: str, ids: Iterable[int] | None, *, allow_empty: bool = True) -> tuple[int, ...]:
    """Token ids as the SDK takes them (each a non-negative int32; the verifier checks the vocabulary).

    >>> token_ids("allowed_token_ids", [5, 6])
    (5, 6)
    >>> token_ids("allowed_token_ids", [], allow_empty=False)
    Traceback (most recent call last):
    gateway_svc.errors.RequestError: allowed_token_ids must not be empty (leave it out to allow every token)
    """
    out = tuple(int32(name, t) for t in ids or ())
    if ids is not None and not out and not allow_empty:
        raise RequestError(f"{name} must not be empty (leave it out to allow every token)", name)
    return out


def logit_bias(bias: Mapping[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) as the SDK's {id: bias}: at
    most 300 entries, each key an integer, each bias in [-100, 100].

    >>> logit_bias({"15": -100, "7": 2.5})
    {15: -100.0, 7: 2.5}
    >>> logit_bias({"the": 1.0})
    Traceback (most recent call last):
    gateway_svc.errors.RequestError: logit_bias keys must be token ids (integers as strings), got 'the'
    """
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(bias)} entries, at most {MAX_LOGIT_BIAS}", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key.strip())
        except ValueError:
            msg = f"logit_bias keys must be token ids (integers as strings), got {key!r}"
            raise RequestError(msg, "logit_bias") from None
        out[int32("logit_bias", token)] = in_range("logit_bias", value, -100, 100)
    return out


def printable(name: str, value: str, max_chars: int) -> str:
    """A label: printable and at most ``max_chars`` characters.

    >>> printable("request_id", "run-7", 200)
    'run-7'
    """
    if len(value) > max_chars or not value.isprintable():
        raise RequestError(f"{name} must be printable and at most {max_chars} characters", name)
    return value
