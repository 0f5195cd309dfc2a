"""Tokenize and Detokenize: text or a chat to the model's token ids and back, with its own tokenizer.

Pure functions of the wire message, the tokenizer and the verifier's limits. A chat renders exactly
as Generate renders it (the model's chat template, roles system / user / assistant), so a chat's
token count is the ``prompt_tokens`` Generate reports for it. Bad input raises ``InvalidRequest``
naming the field (the servicer answers ``INVALID_ARGUMENT``).
"""

from __future__ import annotations

from typing import Any

from specmesh.v1 import generation_pb2
from verifier_svc.requests import InvalidRequest, RequestLimits, check_size

CHAT_ROLES = frozenset({"system", "user", "assistant"})


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


def chat_ids(
    chat: generation_pb2.ChatMessages,
    tokenizer: Any,
    limits: RequestLimits,
    *,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> list[int]:
    """A conversation's token ids: ``apply_chat_template(..., tokenize=True)`` as Generate renders it
    (no special tokens beyond the template's); with ``add_special_tokens``, the rendered text encoded
    with the tokenizer's special tokens (vLLM's ``add_special_tokens`` for a chat)."""
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    if not messages:
        raise InvalidRequest("input.chat", "no messages")
    if bad_roles := {m["role"] for m in messages} - CHAT_ROLES:
        raise InvalidRequest("input.chat", f"unknown role {sorted(bad_roles)[0]!r}")
    check_size("input.chat", sum(len(m["content"].encode("utf-8")) for m in messages), limits)
    try:
        if add_special_tokens:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
            return list(tokenizer.encode(text, add_special_tokens=True))
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    except Exception as exc:  # template errors are the request's fault (e.g. role order)
        raise InvalidRequest("input.chat", f"chat template failed: {exc}") from exc
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def detokenize(
    msg: generation_pb2.DetokenizeRequest, tokenizer: Any, limits: RequestLimits
) -> generation_pb2.DetokenizeResponse:
    """Token ids → ``tokenizer.decode(ids)`` (special tokens kept). Every id must be in the
    vocabulary [0, ``limits.vocab_size``): the tokenizer would silently drop one outside it."""
    ids = list(msg.tokens)
    if not ids:
        raise InvalidRequest("tokens", "no token ids to detokenize")
    if (bad := next((t for t in ids if not 0 <= t < limits.vocab_size), None)) is not None:
        raise InvalidRequest("tokens", f"token id {bad} outside the vocabulary [0, {limits.vocab_size})")
    return generation_pb2.DetokenizeResponse(text=tokenizer.decode(ids))
