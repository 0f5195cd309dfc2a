"""Tokenize and Detokenize: text or a chat to the model's token ids and back, with its own tokenizer.

Pure functions of the wire message, the tokenizer and the verifier's limits. A chat renders exactly
as Generate renders it (the model's chat template, roles system / user / assistant), so a chat's
token count is the ``prompt_tokens`` Generate reports for it. Bad input raises ``InvalidRequest``
naming the field (the servicer answers ``INVALID_ARGUMENT``).
"""

from __future__ import annotations

from typing import Any

from specmesh.v1 import generation_pb2
from verifier_svc.requests import InvalidRequest, RequestLimits, chat_ids, check_size, check_vocab


def tokenize(
    msg: generation_pb2.TokenizeRequest, tokenizer: Any, limits: RequestLimits
) -> generation_pb2.TokenizeResponse:
    """Text → ``tokenizer.encode`` (special tokens unless ``add_special_tokens`` is false); a chat →
    its chat template (with the assistant header unless ``add_generation_prompt`` is false; the
    tokenizer's special tokens on top only if ``add_special_tokens`` is true, as vLLM). Text longer
    than any prompt that fits the context (``limits.max_prompt_bytes``) is refused untokenized; a
    prompt of more tokens than the context is answered (its count says so)."""
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("input", "nothing to tokenize: set text or chat")
    special = msg.add_special_tokens if msg.HasField("add_special_tokens") else kind == "text"
    if kind == "text":
        if not msg.text:
            raise InvalidRequest("input.text", "empty text")
        check_size("input.text", len(msg.text.encode("utf-8")), limits)
        ids = list(tokenizer.encode(msg.text, add_special_tokens=special))
    else:
        generation_prompt = msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True
        ids = chat_ids(msg.chat, tokenizer, limits, add_generation_prompt=generation_prompt, add_special_tokens=special)
    out = generation_pb2.TokenizeResponse(tokens=ids, max_model_len=limits.max_context)
    if msg.return_token_strs:
        out.token_strs.extend(tokenizer.convert_ids_to_tokens(ids))
    return out


def detokenize(
    msg: generation_pb2.DetokenizeRequest, tokenizer: Any, limits: RequestLimits
) -> generation_pb2.DetokenizeResponse:
    """Token ids → ``tokenizer.decode(ids)`` (special tokens kept). Every id must be in the
    vocabulary [0, ``limits.vocab_size``): the tokenizer would silently drop one outside it."""
    if not msg.tokens:
        raise InvalidRequest("tokens", "no token ids to detokenize")
    ids = check_vocab("tokens", msg.tokens, limits.vocab_size)
    return generation_pb2.DetokenizeResponse(text=tokenizer.decode(ids))
