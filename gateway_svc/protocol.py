"""OpenAI request bodies (what clients send) and their translation into SDK parameters.

No field is dropped silently. Each field of OpenAI's and vLLM's completion and chat request schemas is
honoured (a field of these models: it reaches ``SamplingParams`` or shapes the answer), accepted
with no effect on the output (``NO_EFFECT``: labels for OpenAI's own services), or known and
refused (``REFUSED``: a 400 naming it, unless its value is what this server does anyway). Any
other field is a 400 naming it, as OpenAI answers "Unrecognized request argument supplied".
``tests/gateway_svc/test_sampling_fields.py`` walks both schemas' every field name.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from gateway_svc import sampling_checks as checks
from gateway_svc import structured
from gateway_svc.errors import RequestError
from gateway_svc.messages import Message
from gateway_svc.tool_parsers import DEFAULT_PARSER
from gateway_svc.tools import ToolPlan
from gateway_svc.tools import plan as plan_tools
from specmesh.params import SamplingParams, SpecDecodeParams

__all__ = ["NO_EFFECT", "REFUSED", "ChatCompletionRequest", "CompletionRequest", "Message", "RequestError"]

MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT = 256  # bytes, as the verifier takes it (spec_decode.cache_salt)
MAX_REQUEST_ID = 200  # characters: the verifier's request ids are "<id>-<choice>", at most 256


@dataclass(frozen=True)
class Refusal:
    """Why a known field is refused, and the values it is accepted with: what the server does anyway
    (``None`` and an empty list or object always are)."""

    reason: str
    accepts: Callable[[Any, dict, bool], bool] = lambda value, body, chat: False

    def check(self, name: str, value: Any, body: dict, chat: bool) -> None:
        if value is None or value == [] or value == {} or self.accepts(value, body, chat):
            return
        raise RequestError(f"{name} is not supported by this server: {self.reason} (got {value!r})", name)


def _only(*values: Any) -> Callable[[Any, dict, bool], bool]:
    """Accepts exactly these values (a bool is not taken for 0 or 1, nor they for a bool)."""
    return lambda v, body, chat: any(v == a and isinstance(v, bool) == isinstance(a, bool) for a in values)


_NO_WHITESPACE = "JSON whitespace is compact or any (structured_outputs.disable_any_whitespace), not a pattern"
_NO_TOOLS = "the legacy function-calling fields are not supported (tools and tool_choice are)"
_NO_MEDIA = "this server generates text from text only"
_VLLM_ENGINE = "a vLLM engine feature this server does not have"
# Known fields this server cannot honour: name → why, and the values that ask for nothing else.
REFUSED: dict[str, Refusal] = {
    # OpenAI's
    "functions": Refusal(_NO_TOOLS),
    "function_call": Refusal(_NO_TOOLS, _only("none")),
    "suffix": Refusal("insertion (text after the completion) is not supported", _only("")),
    "best_of": Refusal("best_of other than n is not supported", lambda v, b, c: v == b.get("n", 1)),
    "audio": Refusal(_NO_MEDIA),
    "modalities": Refusal(_NO_MEDIA, lambda v, b, c: v == ["text"]),
    "prediction": Refusal("predicted outputs are not supported (spec_decode chooses this server's drafts)"),
    "store": Refusal("this server stores no completions", _only(False)),
    "reasoning_effort": Refusal("the served model has no reasoning modes"),
    "verbosity": Refusal("the served model has no verbosity setting"),
    "service_tier": Refusal("this server has one service tier", _only("auto", "default")),
    "web_search_options": Refusal("web search is not supported"),
    "moderation": Refusal("moderation is not supported"),
    "prompt_cache_options": Refusal("prompt-cache lifetimes and breakpoints are not configurable"),
    "prompt_cache_retention": Refusal("prompt-cache lifetimes are not configurable"),
    # vLLM's
    "echo": Refusal("chat echo (continuing the last message) is not supported", _only(False)),
    "use_beam_search": Refusal("beam search is not supported", _only(False)),
    "length_penalty": Refusal("it applies to beam search only, which is not supported", _only(1, 1.0)),
    "bad_words": Refusal("banned words are not supported"),
    "include_stop_str_in_output": Refusal("stop strings are always left out of the output", _only(False)),
    "skip_special_tokens": Refusal("special tokens are always left out of the output", _only(True)),
    "spaces_between_special_tokens": Refusal("special tokens are always left out of the output", _only(True)),
    "truncate_prompt_tokens": Refusal("prompts are never truncated (a prompt over the context is a 400)"),
    "truncation_side": Refusal("prompts are never truncated"),
    "add_special_tokens": Refusal(
        "the tokenizer's special tokens are added to text prompts, none beyond the template's to a chat",
        lambda v, b, chat: isinstance(v, bool) and v is not chat,
    ),
    "add_generation_prompt": Refusal("the chat template always adds the assistant's header", _only(True)),
    "continue_final_message": Refusal("a chat always gets a new assistant message", _only(False)),
    "chat_template": Refusal("the model's own chat template is used"),
    "chat_template_kwargs": Refusal("the model's own chat template is used, without arguments"),
    "documents": Refusal("the model's own chat template is used, without documents"),
    "include_reasoning": Refusal("the served model has no reasoning output to leave out", _only(True)),
    "thinking_token_budget": Refusal("the served model has no reasoning modes", _only(-1)),
    "media_io_kwargs": Refusal(_NO_MEDIA),
    "mm_processor_kwargs": Refusal(_NO_MEDIA),
    "prompt_embeds": Refusal("prompts are text or token ids"),
    "guided_whitespace_pattern": Refusal(_NO_WHITESPACE),
    "structural_tag": Refusal("structural tags are not supported (structured_outputs and response_format are)"),
    "logits_processors": Refusal("custom logits processors are not supported"),
    "logprob_token_ids": Refusal("logprobs of chosen token ids are not supported (top-N only)"),
    "priority": Refusal("requests are served in arrival order", _only(0)),
    "return_tokens_as_token_ids": Refusal("logprobs carry token text", _only(False)),
    "return_token_ids": Refusal("responses carry no token ids (prompt_logprobs do)", _only(False)),
    "return_prompt_text": Refusal("responses carry no rendered prompt", _only(False)),
    "return_token_offsets": Refusal("token offsets are not returned", _only(False)),
    "return_mm_kwargs": Refusal(_NO_MEDIA, _only(True)),
    "routed_experts_prompt_start": Refusal("the served model has no experts", _only(0)),
    "watermarking": Refusal("watermarking is not supported", _only(False)),
    "repetition_detection": Refusal("repetition detection is not supported (repetition_penalty is)"),
    "stream_interval": Refusal("every step's tokens are streamed as they come", _only(1)),
    "kv_transfer_params": Refusal("disaggregated prefill is not supported"),
    "ec_transfer_params": Refusal("disaggregated encoders are not supported"),
    "vllm_xargs": Refusal("vLLM engine extensions are not supported"),
}
# Accepted, with no effect on the output: labels and hints for OpenAI's own services.
NO_EFFECT = frozenset({"user", "safety_identifier", "prompt_cache_key", "metadata", "session_id"})


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _sdk_model(name: str, params: type, doc: str) -> type[BaseModel]:
    """A request model with exactly the fields of an SDK parameter dataclass, its types and defaults.

    The proto is the source of the fields; the SDK dataclass mirrors it (tests/test_request_fields.py),
    and this body is made from the dataclass, so a new field is added in the proto and the SDK only.
    An unknown key is a 400 naming it: these are our own parameters, not OpenAI's.
    """
    hints = typing.get_type_hints(params)
    fields = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(params)}
    return create_model(name, __config__=ConfigDict(extra="forbid"), __doc__=doc, **fields)


SpecDecode = _sdk_model("SpecDecode", SpecDecodeParams, '``extra_body={"spec_decode": {...}}``: SpecDecodeParams.')


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = None  # vLLM's: with include_usage, every chunk its choice's usage so far
    include_obfuscation: bool | None = None  # OpenAI's: random padding on every chunk (refused when true)


class _Generation(_Body):
    """Fields both endpoints honour (OpenAI's, then vLLM's extras, then ours)."""

    is_chat: ClassVar[bool] = False
    model: str
    max_tokens: int | None = None  # None: what remains of the model's context
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = 0
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    request_id: str | None = None  # the response's id is "cmpl-<request_id>" (or "chatcmpl-…"), as vLLM's
    # accepted, no effect on the output (NO_EFFECT)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    session_id: str | None = None
    # structured outputs (gateway_svc/structured.py): OpenAI's, vLLM's, vLLM's older names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    cache_salt: str | None = None  # vLLM's: salts the request's prefix-cache chain
    # ours
    spec_decode: SpecDecode | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_known_fields(cls, data: Any) -> Any:
        """REFUSED fields leave the body here: a 400 naming one unless its value asks for nothing else."""
        if isinstance(data, dict) and (known := [k for k in data if k in REFUSED and k not in cls.model_fields]):
            for name in known:
                REFUSED[name].check(name, data[name], data, cls.is_chat)
            data = {k: v for k, v in data.items() if k not in known}
        return data

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    @property
    def completion_tokens(self) -> int | None:
        return self.max_tokens

    def check_supported(self, max_n: int) -> None:
        if self.cache_salt is not None and not 0 < len(self.cache_salt.encode()) <= MAX_CACHE_SALT:
            raise RequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} bytes", "cache_salt")
        if not 1 <= self.n <= max_n:
            raise RequestError(f"n must be in [1, {max_n}], got {self.n}", "n")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be in [0, 2**63), got {self.seed}", "seed")
        if self.stream_options is not None:
            if not self.stream:
                raise RequestError("stream_options is only allowed when stream is true", "stream_options")
            if self.stream_options.include_obfuscation:
                name = "stream_options.include_obfuscation"
                raise RequestError(f"{name} is not supported (only false)", name)
        lowest = 1 if self.is_chat else 0  # completions: 0 only prefills (to score a prompt, with echo)
        if self.completion_tokens is not None:
            checks.int32(self.max_tokens_param, self.completion_tokens, lowest)
        self._check_sampling()
        if self.prompt_logprobs is not None:
            checks.int32("prompt_logprobs", self.prompt_logprobs)
            if self.prompt_logprobs > MAX_TOP_LOGPROBS:
                raise RequestError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "prompt_logprobs")
            if self.stream:  # as vLLM: the prompt's logprobs come with the whole response only
                raise RequestError("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.request_id is not None:
            checks.printable("request_id", self.request_id, MAX_REQUEST_ID)
        _ = self.grammar  # a malformed one is a 400 before any stream opens

    @functools.cached_property
    def grammar(self) -> structured.Grammar | None:
        """The grammar the structured-output fields ask for (None: free text)."""
        return structured.from_fields({name: getattr(self, name) for name in structured.FIELDS})

    @property
    def structured_output_param(self) -> str:
        """The request field a verifier refusal of ``sampling.structured_output`` is about."""
        return self.grammar.param if self.grammar else "response_format"

    def _check_sampling(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if (value := getattr(self, name)) is not None:
                checks.in_range(name, value, -2, 2)
        if self.repetition_penalty is not None:
            checks.in_range("repetition_penalty", self.repetition_penalty, 0, 2, lo_open=True)
        if self.min_p is not None:
            checks.in_range("min_p", self.min_p, 0, 1)
        if self.top_k is not None:
            checks.int32("top_k", self.top_k, -1)  # vLLM's -1: disabled, as 0
        checks.logit_bias(self.logit_bias)
        checks.token_ids("stop_token_ids", self.stop_token_ids)
        checks.token_ids("allowed_token_ids", self.allowed_token_ids, allow_empty=False)
        min_tokens = checks.int32("min_tokens", self.min_tokens or 0)
        if self.completion_tokens is not None and min_tokens > self.completion_tokens:
            raise RequestError(
                f"min_tokens ({min_tokens}) must be at most {self.max_tokens_param} ({self.completion_tokens})",
                "min_tokens",
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def response_id(self, uuid_hex: str) -> str:
        return f"{'chatcmpl' if self.is_chat else 'cmpl'}-{self.request_id or uuid_hex}"

    def sampling(
        self, max_tokens: int | None, logprobs: int | None, choice: int, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The SDK's SamplingParams for choice ``choice`` of n: choices get seeds seed, seed + 1, …
        (unseeded ones each a random seed from the verifier), so they are independent samples."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=seed,
            max_tokens=max_tokens,
            stop=stop,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens or 0,
            logit_bias=checks.logit_bias(self.logit_bias),
            allowed_token_ids=tuple(self.allowed_token_ids or ()),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p or 0.0,
            prompt_logprobs=prompt_logprobs,
            structured_output=self.grammar.output if self.grammar else None,
        )

    def spec(self) -> SpecDecodeParams:
        spec = SpecDecodeParams(**self.spec_decode.model_dump()) if self.spec_decode else SpecDecodeParams()
        return dataclasses.replace(spec, cache_salt=self.cache_salt) if self.cache_salt else spec


class ChatCompletionRequest(_Generation):
    is_chat: ClassVar[bool] = True
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # tool calling (gateway_svc/tools.py)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def completion_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check(self, max_n: int) -> None:
        self.check_supported(max_n)
        if self.top_logprobs is not None:
            if self.top_logprobs and not self.logprobs:
                raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        self.tool_plan()

    def tool_plan(self, parser: str = DEFAULT_PARSER) -> ToolPlan | None:
        """The request's tool calling, calls read by ``parser`` (None: no tools); a 400 naming a bad field."""
        grammar = self.grammar.output if self.grammar else None
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, parser, grammar)

    def chat(self) -> list[dict[str, Any]]:
        return [m.chat(i) for i, m in enumerate(self.messages)]

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    @property
    def prompt_logprobs_param(self) -> str:
        return "prompt_logprobs"

    def sampling_for(self, choice: int) -> SamplingParams:
        """Choice ``choice``'s parameters; the prompt's logprobs are asked of the first choice only
        (every choice has the same prompt)."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        prompt_logprobs = self.prompt_logprobs if choice == 0 else None
        return self.sampling(self.completion_tokens, logprobs, choice, prompt_logprobs)


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # completions: how many alternatives per token
    echo: bool | None = False  # the prompt before each choice's text (and, with logprobs, its tokens)

    def check(self, max_n: int) -> None:
        self.check_supported(max_n)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
        if not self.prompts() or any(not p for p in self.prompts()):
            raise RequestError("prompt must not be empty", "prompt")
        for p in self.prompts():
            if not isinstance(p, str):
                checks.token_ids("prompt", p)

    def prompts(self) -> list[str | list[int]]:
        """One prompt per entry: a string, a list of strings, token ids, or a list of token-id lists.

        >>> CompletionRequest(model="m", prompt=[[1, 2], [3]]).prompts()
        [[1, 2], [3]]
        >>> CompletionRequest(model="m", prompt="hi").prompts(), CompletionRequest(model="m", prompt=[5, 6]).prompts()
        (['hi'], [[5, 6]])
        """
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def echo_logprobs(self) -> int | None:
        """N of the prompt's logprobs that echo shows (None: none)."""
        return self.logprobs if self.echo else None

    @property
    def prompt_logprobs_param(self) -> str:
        """The field a verifier refusal of ``sampling.prompt_logprobs`` is about."""
        return "prompt_logprobs" if self.prompt_logprobs is not None else "logprobs"

    def sampling_for(self, choice: int) -> SamplingParams:
        """Choice ``choice`` of a prompt; its first choice asks for the prompt's logprobs that echo
        and ``prompt_logprobs`` show (the most alternatives either wants; each takes its own N)."""
        wanted = [n for n in (self.echo_logprobs, self.prompt_logprobs) if n is not None]
        prompt_logprobs = max(wanted) if wanted and choice == 0 else None
        return self.sampling(self.max_tokens, self.logprobs, choice, prompt_logprobs)
