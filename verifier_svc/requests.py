"""Validated generation requests: the wire message turned into what the engine runs.

Every rule names the field it checks, so a client gets ``INVALID_ARGUMENT`` with a message
that says which field to fix.
"""

from __future__ import annotations

import functools
import json
import math
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from specmesh.v1 import generation_pb2
from specmesh_router.policy import PolicyLimits
from specmesh_server.sampling import GREEDY_BELOW
from verifier_svc.chat_tools import ChatError, template_inputs

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_TAG_CHARS = 64
MAX_SCOPE_CHARS = 128  # a cache_scope: room for the gateway's 17-character tenant prefix
MAX_CACHE_SALT = 256  # bytes of a cache_salt (it is hashed, never stored)
# The client's request_id is a label only (echoed in every response chunk, logged; the engine files
# requests under keys of its own): a longer one is refused, as one that would not print on one line.
MAX_REQUEST_ID_CHARS = 256
MAX_GRAMMAR_BYTES = 1 << 16  # a structured output's schema, regex, grammar or choices, in UTF-8 bytes
BUILTIN_PROPOSERS = ("ngram", "suffix", "draft", "rag", "head")
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ProposerNotConfigured(ValueError):
    """A known proposer kind that this verifier has no service address for."""


@dataclass(frozen=True)
class SpecParams:
    proposer: str  # "auto" | "none" | a proposer name
    num_speculative_tokens: int  # 0 = router decides
    max_tree_nodes: int  # 0 = server default
    workload_tag: str
    corpus: str
    cache_scope: str = ""  # partition of the proposers' learned caches (suffix)
    cache_salt: str = ""  # salts the prefix cache's hash chain (vLLM's cache_salt)

    @property
    def unservable(self) -> tuple[str, ...]:
        """Proposers ``auto`` must not pick for this request: retrieval needs a corpus to look in."""
        return () if self.corpus else ("rag",)


@dataclass(frozen=True)
class GrammarSpec:
    """A structured output as the verifier compiles it (``grammar.GrammarCompiler``): one of
    ``params.proto``'s ``StructuredOutput`` kinds; hashable, so compiled grammars are cached by it."""

    kind: str  # "json_schema" | "json_object" | "regex" | "choice" | "grammar"
    value: str = ""  # the JSON schema, regex or EBNF text
    choices: tuple[str, ...] = ()
    any_whitespace: bool = False  # JSON: any whitespace between elements (else compact)

    @property
    def field(self) -> str:
        """The request field it came from, for error messages."""
        return f"sampling.structured_output.{self.kind}"


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    temperature: float  # 0 = greedy
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: tuple[str, ...]
    ignore_eos: bool
    spec_params: SpecParams  # the client's speculation parameters
    logprobs: int | None = None  # None: none; N: each token's logprob and its N most likely alternatives
    stop_token_ids: frozenset[int] = frozenset()
    # Logits controls (``logits_controls``) and min_p (``sampling.filter_logits``); params.proto has the formulas.
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ascending ids
    allowed_token_ids: frozenset[int] = frozenset()  # empty: every token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    prompt_logprobs: int | None = (
        None  # None: none; N: each prompt token's logprob (after the first) and N alternatives
    )
    structured_output: GrammarSpec | None = None  # the output follows this grammar (``grammar``)

    @property
    def has_controls(self) -> bool:
        """Whether any logits control is set (``logits_controls.process_logits`` skips requests without)."""
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @functools.cached_property
    def prompt_token_set(self) -> torch.Tensor:
        """The prompt's distinct token ids (the repetition penalty's prompt tokens), made once."""
        return torch.tensor(sorted(set(self.prompt_ids)), dtype=torch.long)

    @functools.cached_property
    def allowed_tensor(self) -> torch.Tensor:
        """``allowed_token_ids`` as a tensor, made once."""
        return torch.tensor(sorted(self.allowed_token_ids), dtype=torch.long)


@dataclass(frozen=True)
class RequestLimits:
    max_context: int
    vocab_size: int
    # One set of bounds for a request's knobs and the admin policy's (``policy_limits``).
    max_speculative_tokens: int = PolicyLimits.max_speculative_tokens
    max_tree_nodes: int = PolicyLimits.max_tree_nodes
    configured_proposers: tuple[str, ...] = ()
    # Prompt text (UTF-8 bytes) beyond this cannot fit the context whatever it tokenizes to, so it is
    # refused before tokenizing (``max_prompt_bytes``); None: no pre-check.
    max_prompt_bytes: int | None = None
    # Tokens (prompt + output) one request can hold within the KV cache budget; an unset max_tokens
    # stops there rather than at the model's context. None: the context is the only bound.
    max_sequence: int | None = None

    def policy_limits(self) -> PolicyLimits:
        return PolicyLimits(self.max_speculative_tokens, self.max_tree_nodes)


def max_prompt_bytes(tokenizer: Any, max_context: int) -> int:
    """The most UTF-8 bytes a prompt of ``max_context`` tokens can hold: no token stands for more
    bytes than its vocabulary string's UTF-8 length (byte-level BPE writes each byte as one char of
    1-2 bytes, SentencePiece "▁" as 3 for 1), so longer text cannot fit and is refused untokenized.

    >>> class Vocab:
    ...     def get_vocab(self): return {"a": 0, "Ġthe": 1, "<|endoftext|>": 2}
    >>> max_prompt_bytes(Vocab(), 100)
    1300
    """
    return max_context * max(len(t.encode("utf-8")) for t in tokenizer.get_vocab())


def build_request(msg: generation_pb2.GenerateRequest, tokenizer: Any, limits: RequestLimits) -> GenerationRequest:
    if len(msg.request_id) > MAX_REQUEST_ID_CHARS or not msg.request_id.isprintable():
        raise InvalidRequest(
            "request_id",
            f"must be printable and at most {MAX_REQUEST_ID_CHARS} characters (a label echoed in every "
            f"response), got {len(msg.request_id)} characters",
        )
    prompt_ids = _prompt_ids(msg, tokenizer, limits)
    s = msg.sampling
    temperature = s.temperature if s.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest("sampling.temperature", f"must be >= 0, got {temperature}")
    if temperature < GREEDY_BELOW:  # logits / 1e-45 overflow to inf: such temperatures mean greedy
        temperature = 0.0
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (0 < top_p <= 1):  # also rejects NaN
        raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {top_p}")
    if s.top_k < 0:
        raise InvalidRequest("sampling.top_k", f"must be >= 0 (0 = disabled), got {s.top_k}")
    room = limits.max_context - len(prompt_ids)  # > 0: _prompt_ids checked it
    default = room if limits.max_sequence is None else min(room, max(limits.max_sequence - len(prompt_ids), 1))
    max_tokens = s.max_tokens if s.HasField("max_tokens") else default  # unset: the rest of the context (as vLLM)
    if max_tokens < 0:
        raise InvalidRequest("sampling.max_tokens", f"must be >= 0 (0: prefill only), got {max_tokens}")
    if max_tokens > room:
        raise InvalidRequest(
            "sampling.max_tokens",
            f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}: together "
            f"{len(prompt_ids) + max_tokens}, over the model's context of {limits.max_context} tokens",
        )
    if len(s.stop) > MAX_STOP_STRINGS or any(not stop for stop in s.stop):
        raise InvalidRequest("sampling.stop", f"at most {MAX_STOP_STRINGS} non-empty strings")
    if len(s.stop_token_ids) > MAX_STOP_STRINGS or any(not 0 <= t < limits.vocab_size for t in s.stop_token_ids):
        raise InvalidRequest(
            "sampling.stop_token_ids", f"at most {MAX_STOP_STRINGS} ids in the vocabulary [0, {limits.vocab_size})"
        )
    logprobs = s.logprobs if s.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidRequest("sampling.logprobs", f"must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    prompt_logprobs = s.prompt_logprobs if s.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise InvalidRequest("sampling.prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}")
    seed = s.seed if s.HasField("seed") else secrets.randbits(63)
    return GenerationRequest(
        request_id=msg.request_id or uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(s.top_k),
        seed=int(seed) & (2**63 - 1),
        max_tokens=int(max_tokens),
        stop=tuple(s.stop),
        ignore_eos=s.ignore_eos,
        spec_params=_spec_params(msg, limits),
        logprobs=logprobs,
        stop_token_ids=frozenset(s.stop_token_ids),
        **_controls(s, int(max_tokens), limits.vocab_size),
        prompt_logprobs=prompt_logprobs,
        structured_output=_grammar(s),
    )


def _grammar(s: Any) -> GrammarSpec | None:
    """``SamplingParams.structured_output`` checked as far as can be without compiling it."""
    if not s.HasField("structured_output"):
        return None
    so = s.structured_output
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(
            "sampling.structured_output", "set one of json_schema, json_object, regex, choice, grammar"
        )
    field = f"sampling.structured_output.{kind}"
    if s.ignore_eos:  # a complete grammar allows only EOS: generation could not go on
        raise InvalidRequest(field, "cannot be combined with sampling.ignore_eos (a complete output allows only EOS)")
    choices = tuple(so.choice.choices) if kind == "choice" else ()
    value = "" if kind in ("choice", "json_object") else getattr(so, kind)
    if sum(len(c.encode("utf-8")) for c in (value, *choices)) > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(field, f"at most {MAX_GRAMMAR_BYTES} bytes")
    if kind == "json_object" and not so.json_object:
        raise InvalidRequest(field, "must be true when set")
    if kind == "choice" and (not choices or any(not c for c in choices)):
        raise InvalidRequest(field, "at least one choice, each a non-empty string")
    if kind in ("regex", "grammar") and not value:
        raise InvalidRequest(field, "empty")
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except ValueError as exc:
            raise InvalidRequest(field, f"not valid JSON: {exc}") from exc
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(field, f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    return GrammarSpec(kind, value, choices, so.any_whitespace)


def _controls(s: Any, max_tokens: int, vocab_size: int) -> dict[str, Any]:
    """The logits controls and min_p of ``SamplingParams`` ``s``, checked (ranges as OpenAI's and vLLM's)."""

    def in_range(name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> float:
        if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
            raise InvalidRequest(f"sampling.{name}", f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
        return float(value)

    if not 0 <= s.min_tokens <= max_tokens:
        raise InvalidRequest("sampling.min_tokens", f"must be in [0, max_tokens = {max_tokens}], got {s.min_tokens}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(s.logit_bias)}")
    check_vocab("sampling.logit_bias", s.logit_bias, vocab_size)
    bias = {t: in_range("logit_bias", v, -100, 100) for t, v in s.logit_bias.items()}
    repetition = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
    return {
        "min_tokens": int(s.min_tokens),
        "logit_bias": tuple(sorted(bias.items())),
        "allowed_token_ids": frozenset(check_vocab("sampling.allowed_token_ids", s.allowed_token_ids, vocab_size)),
        "presence_penalty": in_range("presence_penalty", s.presence_penalty, -2, 2),
        "frequency_penalty": in_range("frequency_penalty", s.frequency_penalty, -2, 2),
        "repetition_penalty": in_range("repetition_penalty", repetition, 0, 2, lo_open=True),
        "min_p": in_range("min_p", s.min_p, 0, 1),
    }


def _prompt_ids(msg: generation_pb2.GenerateRequest, tokenizer: Any, limits: RequestLimits) -> list[int]:
    kind = msg.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("input", "empty prompt: set text, token_ids or chat")
    if kind == "text":
        if not msg.text:
            raise InvalidRequest("input.text", "empty prompt")
        check_size("input.text", len(msg.text.encode("utf-8")), limits)
        ids = tokenizer.encode(msg.text, add_special_tokens=True)
    elif kind == "token_ids":
        ids = list(msg.token_ids.ids)
        if not ids:
            raise InvalidRequest("input.token_ids", "empty prompt")
        check_vocab("input.token_ids", ids, limits.vocab_size)
    else:
        if all(not m.content and not m.tool_calls for m in msg.chat.messages):
            raise InvalidRequest("input.chat", "empty prompt: no message content")
        ids = chat_ids(msg.chat, tokenizer, limits)
    if not ids:
        raise InvalidRequest(f"input.{kind}", "prompt tokenizes to nothing")
    if len(ids) >= limits.max_context:
        raise InvalidRequest(
            f"input.{kind}", f"prompt has {len(ids)} tokens; the model's context is {limits.max_context} tokens"
        )
    return ids


def chat_ids(
    chat: generation_pb2.ChatMessages,
    tokenizer: Any,
    limits: RequestLimits,
    *,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> list[int]:
    """A conversation's token ids: the model's chat template (``apply_chat_template(..., tokenize=True)``,
    no special tokens beyond the template's), as Generate and Tokenize render it; with
    ``add_special_tokens``, the rendered text encoded with the tokenizer's special tokens (vLLM's
    ``add_special_tokens`` for a chat). Tools, tool calls and tool results: ``chat_tools``."""
    if not chat.messages:
        raise InvalidRequest("input.chat", "no messages")
    if bad_roles := {m.role for m in chat.messages} - CHAT_ROLES:
        raise InvalidRequest("input.chat", f"unknown role {sorted(bad_roles)[0]!r}")
    calls = [c.arguments for m in chat.messages for c in m.tool_calls]
    texts = [chat.tools_json, *(m.content for m in chat.messages), *calls]
    check_size("input.chat", sum(len(t.encode("utf-8")) for t in texts), limits)
    try:
        messages, tools = template_inputs(chat, tokenizer.chat_template)
    except ChatError as exc:
        raise InvalidRequest(exc.field, exc.reason) from None
    try:
        if add_special_tokens:
            text = tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            return list(tokenizer.encode(text, add_special_tokens=True))
        ids = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    except Exception as exc:  # template errors are the request's fault (e.g. role order)
        raise InvalidRequest("input.chat", f"chat template failed: {exc}") from exc
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def check_vocab(field: str, ids: Any, vocab_size: int) -> list[int]:
    """``ids`` as a list, each in the vocabulary [0, ``vocab_size``) (else refused naming ``field``)."""
    if (bad := next((t for t in ids if not 0 <= t < vocab_size), None)) is not None:
        raise InvalidRequest(field, f"token id {bad} outside the vocabulary [0, {vocab_size})")
    return list(ids)


def check_size(field: str, n_bytes: int, limits: RequestLimits) -> None:
    """Text of ``n_bytes`` UTF-8 bytes that no tokenization fits in the context: refused untokenized."""
    if limits.max_prompt_bytes is not None and n_bytes > limits.max_prompt_bytes:
        raise InvalidRequest(
            field,
            f"prompt of {n_bytes} bytes cannot fit the model's context of {limits.max_context} tokens "
            f"(at most {limits.max_prompt_bytes} bytes); refused before tokenizing",
        )


def _spec_params(msg: generation_pb2.GenerateRequest, limits: RequestLimits) -> SpecParams:
    p = msg.spec_decode
    name = (p.proposer or "auto").lower()
    known = ("auto", "none", *BUILTIN_PROPOSERS, *limits.configured_proposers)
    if name not in known:
        raise InvalidRequest(
            "spec_decode.proposer", f"unknown proposer {p.proposer!r}; known: {', '.join(dict.fromkeys(known))}"
        )
    if name in BUILTIN_PROPOSERS and name not in limits.configured_proposers:
        raise ProposerNotConfigured(f"spec_decode.proposer: proposer {name!r} is not configured on this verifier")
    if not 0 <= p.num_speculative_tokens <= limits.max_speculative_tokens:
        raise InvalidRequest(
            "spec_decode.num_speculative_tokens",
            f"must be in [0, {limits.max_speculative_tokens}], got {p.num_speculative_tokens}",
        )
    if not 0 <= p.max_tree_nodes <= limits.max_tree_nodes:
        raise InvalidRequest(
            "spec_decode.max_tree_nodes", f"must be in [0, {limits.max_tree_nodes}], got {p.max_tree_nodes}"
        )
    if len(p.workload_tag) > MAX_TAG_CHARS or not p.workload_tag.isprintable():
        raise InvalidRequest(
            "spec_decode.workload_tag", f"must be printable and at most {MAX_TAG_CHARS} characters (it keys statistics)"
        )
    if len(p.corpus) > MAX_TAG_CHARS or not p.corpus.isprintable():
        raise InvalidRequest(
            "spec_decode.corpus", f"must be printable and at most {MAX_TAG_CHARS} characters (a corpus name)"
        )
    if len(p.cache_scope) > MAX_SCOPE_CHARS or not p.cache_scope.isprintable():
        raise InvalidRequest(
            "spec_decode.cache_scope", f"must be printable and at most {MAX_SCOPE_CHARS} characters (a cache partition)"
        )
    if len(p.cache_salt.encode()) > MAX_CACHE_SALT:
        size = len(p.cache_salt.encode())
        raise InvalidRequest("spec_decode.cache_salt", f"must be at most {MAX_CACHE_SALT} bytes, got {size}")
    return SpecParams(
        name, p.num_speculative_tokens, p.max_tree_nodes, p.workload_tag, p.corpus, p.cache_scope, p.cache_salt
    )
