"""Typed request parameters and results of the client SDK (no torch)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specmesh.v1 import generation_pb2, params_pb2

FINISH_REASONS = {
    generation_pb2.FINISH_REASON_LENGTH: "length",
    generation_pb2.FINISH_REASON_EOS: "eos",
    generation_pb2.FINISH_REASON_STOP: "stop",
}


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow; set exactly one of the kinds (params.proto says each).

    >>> StructuredOutput(json_schema='{"type": "integer"}').to_proto().WhichOneof("kind")
    'json_schema'
    """

    json_schema: str | None = None  # a JSON Schema as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] = ()  # exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF), rule "root" starts
    any_whitespace: bool = False  # JSON: any whitespace between elements (default: compact)

    def __post_init__(self) -> None:
        kinds = [self.json_schema is not None, self.json_object, self.regex is not None, bool(self.choice),
                 self.grammar is not None]  # fmt: skip
        if sum(kinds) != 1:
            raise ValueError("StructuredOutput: set exactly one of json_schema, json_object, regex, choice, grammar")

    def to_proto(self) -> params_pb2.StructuredOutput:
        msg = params_pb2.StructuredOutput(any_whitespace=self.any_whitespace)
        if self.choice:
            msg.choice.choices.extend(self.choice)
        for name in ("json_schema", "regex", "grammar"):
            if getattr(self, name) is not None:
                setattr(msg, name, getattr(self, name))
        if self.json_object:
            msg.json_object = True
        return msg


@dataclass(frozen=True)
class SamplingParams:
    """``None`` leaves a field to the server default (temperature 1.0, top_p 1.0, max_tokens: what
    remains of the model's context, logprobs: none)."""

    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # N in [0, 20]: each token's logprob and the N most likely alternatives
    stop_token_ids: tuple[int, ...] = ()
    # Logits processing, as vLLM (params.proto says each formula):
    min_tokens: int = 0  # EOS and stop_token_ids masked (and stop strings ignored) before this many tokens
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id → added to its logit
    allowed_token_ids: tuple[int, ...] = ()  # only these may be generated (empty: all)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: 1.0 (off)
    min_p: float = 0.0
    prompt_logprobs: int | None = None  # N in [0, 20]: each prompt token's logprob (after the first)
    structured_output: StructuredOutput | None = None  # None: free text

    def to_proto(self) -> params_pb2.SamplingParams:
        # the proto's fields, by name (tests/test_request_fields.py); None leaves an optional one unset
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.structured_output is not None:
            fields["structured_output"] = self.structured_output.to_proto()
        return params_pb2.SamplingParams(**{k: v for k, v in fields.items() if v is not None})


@dataclass(frozen=True)
class SpecDecodeParams:
    proposer: str = "auto"  # "auto" | "none" | "ngram" | "suffix" | "draft" | "rag"
    num_speculative_tokens: int = 0  # 0 = the router decides
    max_tree_nodes: int = 0  # 0 = the server default
    workload_tag: str = ""
    corpus: str = ""
    cache_scope: str = ""  # suffix-cache partition: proposals only from this scope's past outputs
    cache_salt: str = ""  # salts the prefix cache (vLLM's cache_salt): cached prompts shared only under it

    def to_proto(self) -> params_pb2.SpecDecodeParams:
        return params_pb2.SpecDecodeParams(**dataclasses.asdict(self))


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability and the most likely alternatives at its position."""

    logprob: float
    token: str
    top: tuple[TopLogprob, ...] = ()
    rank: int = 0  # 1 + the number of tokens more likely than it (0: not reported)

    @classmethod
    def from_proto(cls, msg: generation_pb2.TokenLogprob) -> TokenLogprob:
        top = tuple(TopLogprob(t.token_id, t.logprob, t.token) for t in msg.top_logprobs)
        return cls(msg.logprob, msg.token, top, msg.rank)


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's token ids as the model saw them, and each one's log-probability after the first."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]  # logprobs[i] is token_ids[i + 1]'s

    @classmethod
    def from_proto(cls, msg: generation_pb2.PromptLogprobs) -> PromptLogprobs:
        return cls(list(msg.token_ids), [TokenLogprob.from_proto(lp) for lp in msg.logprobs])


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token, when SamplingParams.logprobs was set
    prompt: PromptLogprobs | None = None  # the first chunk's, when SamplingParams.prompt_logprobs was set
    prompt_tokens: int = 0  # the first chunk's: the prompt's length in tokens (0 in the others)

    @classmethod
    def from_proto(cls, msg: generation_pb2.TokenChunk) -> Chunk:
        lps = [TokenLogprob.from_proto(lp) for lp in msg.logprobs] if msg.logprobs else None
        prompt = PromptLogprobs.from_proto(msg.prompt) if msg.HasField("prompt") else None
        return cls(list(msg.token_ids), msg.text, lps, prompt, msg.prompt_tokens)


@dataclass(frozen=True)
class Summary:
    finish_reason: str  # "length" | "eos" | "stop"
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    total_ms: float
    speculation: params_pb2.SpeculationMetrics
    stop_string: str = ""
    cached_tokens: int = 0  # prompt tokens whose KV came from the verifier's prefix cache

    @classmethod
    def from_proto(cls, msg: generation_pb2.GenerationSummary) -> Summary:
        return cls(
            finish_reason=FINISH_REASONS.get(msg.finish_reason, "unspecified"),
            prompt_tokens=msg.usage.prompt_tokens,
            completion_tokens=msg.usage.completion_tokens,
            time_to_first_token_ms=msg.timing.time_to_first_token_ms,
            total_ms=msg.timing.total_ms,
            speculation=msg.speculation,
            stop_string=msg.stop_string,
            cached_tokens=msg.usage.cached_tokens,
        )


@dataclass
class Completion:
    """A whole generation: what ``Client.complete`` returns."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    summary: Summary | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs was set

    def add(self, chunk: Chunk) -> None:
        if chunk.prompt is not None:
            self.prompt = chunk.prompt
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *chunk.logprobs]


# A chat message is OpenAI's: {"role", "content"}, an assistant's "tool_calls" ([{"id", "type": "function",
# "function": {"name", "arguments"}}], arguments as JSON text or an object), a tool message's "tool_call_id"
# and "name".
Prompt = str | list[int] | list[dict[str, Any]]
Tools = Sequence[Mapping[str, Any]]  # OpenAI tool objects: {"type": "function", "function": {"name", …}}


def chat_messages(messages: Sequence[Mapping[str, Any]], tools: Tools | None = None) -> generation_pb2.ChatMessages:
    """OpenAI-shaped chat messages (content None or absent: empty) and tools as ``ChatMessages``.

    >>> call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    >>> tool = {"type": "function", "function": {"name": "f"}}
    >>> chat = chat_messages([{"role": "assistant", "content": None, "tool_calls": [call]},
    ...     {"role": "tool", "content": "2", "tool_call_id": "c1"}], tools=[tool])
    >>> chat.messages[0].tool_calls[0].arguments, chat.messages[1].tool_call_id, chat.tools_json
    ('{"x": 1}', 'c1', '[{"type": "function", "function": {"name": "f"}}]')
    """
    chat = generation_pb2.ChatMessages(tools_json=json.dumps(list(tools), ensure_ascii=False) if tools else "")
    for m in messages:
        calls = []
        for c in m.get("tool_calls") or ():
            fn = c["function"]
            args = fn.get("arguments", "")
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            calls.append(generation_pb2.ToolCall(id=c.get("id") or "", name=fn["name"], arguments=args))
        chat.messages.add(
            role=m["role"],
            content=m.get("content") or "",
            tool_calls=calls,
            tool_call_id=m.get("tool_call_id") or "",
            name=m.get("name") or "",
        )
    return chat


def build_request(
    prompt: Prompt,
    sampling: SamplingParams | None,
    spec: SpecDecodeParams | None,
    chat: bool,
    request_id: str = "",
    tools: Tools | None = None,
) -> generation_pb2.GenerateRequest:
    """str → text (or a single user turn when ``chat``); list[int] → token ids; list[dict] → chat.
    ``tools`` (OpenAI tool objects) go with a chat only."""
    req = generation_pb2.GenerateRequest(
        sampling=(sampling or SamplingParams()).to_proto(),
        spec_decode=(spec or SpecDecodeParams()).to_proto(),
        request_id=request_id,
    )
    if isinstance(prompt, str):
        if chat:
            req.chat.CopyFrom(chat_messages([{"role": "user", "content": prompt}], tools))
        else:
            req.text = prompt
    elif not prompt:  # empty: the server answers INVALID_ARGUMENT naming the field
        req.token_ids.SetInParent()
    elif all(isinstance(t, int) for t in prompt):
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    else:
        req.chat.CopyFrom(chat_messages(prompt, tools))  # type: ignore[arg-type]
    if tools and req.WhichOneof("input") != "chat":
        raise ValueError("tools go with a chat prompt (messages, or a string with chat=True)")
    return req


@dataclass(frozen=True)
class Tokens:
    """What ``Client.tokenize`` returns: the prompt's token ids, each one's string in the tokenizer's
    own form (``"Ġthe"``) when asked for (else None), and the model's context length in tokens."""

    tokens: list[int]
    token_strs: list[str] | None
    max_model_len: int

    @classmethod
    def from_proto(cls, msg: generation_pb2.TokenizeResponse, with_strs: bool) -> Tokens:
        return cls(list(msg.tokens), list(msg.token_strs) if with_strs else None, msg.max_model_len)


def build_tokenize_request(
    prompt: str | list[dict[str, Any]],
    chat: bool,
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool | None = None,
    return_token_strs: bool = False,
    tools: Tools | None = None,
) -> generation_pb2.TokenizeRequest:
    """str → text (or a single user turn when ``chat``); list[dict] → chat (with ``tools``, a chat's
    only). ``None`` leaves a flag to the server: special tokens for text, none beyond the template's
    for a chat; a generation prompt."""
    req = generation_pb2.TokenizeRequest(
        add_special_tokens=add_special_tokens,
        add_generation_prompt=add_generation_prompt,
        return_token_strs=return_token_strs,
    )
    if isinstance(prompt, str) and not chat:
        if tools:
            raise ValueError("tools go with a chat prompt (messages, or a string with chat=True)")
        req.text = prompt
    else:  # an empty list: the server answers INVALID_ARGUMENT naming the field
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        req.chat.CopyFrom(chat_messages(messages, tools))
    return req
