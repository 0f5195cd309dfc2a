"""OpenAI request bodies (what clients send) and their translation into SDK parameters.

Unknown fields are ignored, as OpenAI-compatible servers do. A field we know but cannot honour
(a non-zero penalty, tools, echo, min_tokens) is a 400 naming it, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from gateway_svc.errors import ApiError
from specmesh.params import SamplingParams, SpecDecodeParams

MAX_TOP_LOGPROBS = 20


class RequestError(ApiError):
    """A request the gateway refuses before it reaches the verifier: 400 naming the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(400, message, param=param)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


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
    include_usage: bool = False


class _Generation(_Body):
    """Fields both endpoints share (OpenAI's, then vLLM's extras, then ours)."""

    model: str
    max_tokens: int | None = None  # None: what remains of the model's context
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    # ours
    spec_decode: SpecDecode | None = None

    def check_supported(self, max_n: int) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported by this server (only 0)", name)
        if self.logit_bias:
            raise RequestError("logit_bias is not supported by this server", "logit_bias")
        if self.min_tokens:
            raise RequestError("min_tokens is not supported by this server (only 0)", "min_tokens")
        if not 1 <= self.n <= max_n:
            raise RequestError(f"n must be in [1, {max_n}], got {self.n}", "n")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be in [0, 2**63), got {self.seed}", "seed")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int | None, logprobs: int | None, choice: int) -> SamplingParams:
        """The SDK's SamplingParams for choice ``choice`` of n: choices get seeds seed, seed + 1, …
        (unseeded ones each a random seed from the verifier), so they are independent samples."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k or 0,
            seed=seed,
            max_tokens=max_tokens,
            stop=stop,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            stop_token_ids=tuple(self.stop_token_ids or ()),
        )

    def spec(self) -> SpecDecodeParams:
        return SpecDecodeParams(**self.spec_decode.model_dump()) if self.spec_decode else SpecDecodeParams()


class TextPart(_Body):
    type: str
    text: str | None = None


class Message(_Body):
    role: str
    content: str | list[TextPart] | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if bad := [p.type for p in self.content if p.type != "text"]:
            raise RequestError(f"content part of type {bad[0]!r} is not supported (text only)", f"messages.{index}")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def check(self, max_n: int) -> None:
        self.check_supported(max_n)
        if self.tools:
            raise RequestError("tools are not supported by this server", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise RequestError("only response_format type 'text' is supported", "response_format")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    def sampling_for(self, choice: int) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling(max_tokens, logprobs, choice)


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # completions: how many alternatives per token
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    max_tokens_param: Literal["max_tokens"] = "max_tokens"

    def check(self, max_n: int) -> None:
        self.check_supported(max_n)
        if self.echo:
            raise RequestError("echo is not supported by this server", "echo")
        if self.suffix:
            raise RequestError("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of other than n is not supported by this server", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "logprobs")
        if not self.prompts():
            raise RequestError("prompt must not be empty", "prompt")

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

    def sampling_for(self, choice: int) -> SamplingParams:
        return self.sampling(self.max_tokens, self.logprobs, choice)
