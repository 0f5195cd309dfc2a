"""Errors in OpenAI's JSON shape, and the verifier's gRPC statuses mapped onto HTTP.

``{"error": {"message", "type", "param", "code"}}``: INVALID_ARGUMENT / FAILED_PRECONDITION → 400
with the offending request field in ``param``, RESOURCE_EXHAUSTED → 429 with ``Retry-After`` (but 400
``context_length_exceeded`` for a request too large for the verifier's KV budget),
UNAVAILABLE → 503, DEADLINE_EXCEEDED → 504, anything else → 500 (a message, never a traceback).
"""

from __future__ import annotations

from typing import Any, TypeVar

import grpc
from pydantic import BaseModel

T = TypeVar("T", bound=BaseModel)

# The verifier's field names (verifier_svc/requests.py) → the OpenAI request field a client sent, where
# not the same name: ``sampling.<name>`` is the request field <name> (max_tokens, logprobs and
# prompt_logprobs go by the names the endpoint gives them: ``param_of``).
_FIELD_PARAMS = {
    "input.chat": "messages",
    "input.chat.tools_json": "tools",
    "input.text": "prompt",
    "input.token_ids": "prompt",
    "request_id": "request_id",
    "tokens": "tokens",  # Detokenize
}
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),
}
# The verifier's RESOURCE_EXHAUSTED for a request that could not fit its KV budget even alone.
NEVER_FITS = "(--kv-cache-memory)"
_CODES = {429: "rate_limit_exceeded", 503: "service_unavailable", 504: "timeout"}


class ApiError(Exception):
    """An error answer; a plain exception (frameworks set ``__traceback__`` on what they catch)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class RequestError(ApiError):
    """A request the gateway refuses before it reaches the verifier: 400 naming the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(400, message, param=param)


def _field(details: str) -> str:
    """The verifier field a message names: its messages start with ``field: …`` (or ``field 'x' …``)."""
    return details.split(":", 1)[0].split(" ", 1)[0]


def param_of(
    details: str,
    max_tokens_param: str,
    logprobs_param: str,
    prompt_logprobs_param: str = "prompt_logprobs",
    structured_output_param: str = "response_format",
) -> str | None:
    """The request field a verifier message names (its messages start with ``field: …``); a grammar's
    (``sampling.structured_output.<kind>``) is the field the request sent it in.

    >>> param_of("sampling.top_p: must be in (0, 1], got 2.0", "max_tokens", "logprobs")
    'top_p'
    >>> param_of("sampling.max_tokens: the prompt has 9 tokens …", "max_completion_tokens", "top_logprobs")
    'max_completion_tokens'
    >>> param_of("sampling.prompt_logprobs: must be in [0, 20]", "max_tokens", "logprobs", "logprobs")
    'logprobs'
    >>> param_of("sampling.logit_bias: token id 99999 outside the vocabulary", "max_tokens", "logprobs")
    'logit_bias'
    >>> param_of("spec_decode.proposer 'x' refused the request: …", "max_tokens", "logprobs")
    'spec_decode.proposer'
    >>> param_of("input.chat.messages.2.tool_calls.0.name: a tool call names its function", "max_tokens", "logprobs")
    'messages.2.tool_calls.0.name'
    >>> param_of("sampling.structured_output.regex: bad", "max_tokens", "logprobs", "logprobs", "guided_regex")
    'guided_regex'
    """
    field = _field(details)
    if field == "sampling.structured_output" or field.startswith("sampling.structured_output."):
        return structured_output_param
    renamed = {
        "sampling.max_tokens": max_tokens_param,
        "sampling.logprobs": logprobs_param,
        "sampling.prompt_logprobs": prompt_logprobs_param,
    }
    if field in renamed:
        return renamed[field]
    if field.startswith("sampling."):
        return field.removeprefix("sampling.")
    if field.startswith("spec_decode."):
        return field
    if field.startswith("input.chat.messages."):  # a chat message's field, as the client named it
        return field.removeprefix("input.chat.")
    return _FIELD_PARAMS.get(field)


def from_grpc(
    exc: grpc.RpcError,
    max_tokens_param: str = "max_tokens",
    logprobs_param: str = "logprobs",
    prompt_logprobs_param: str = "prompt_logprobs",
    structured_output_param: str = "response_format",
) -> ApiError:
    code, details = exc.code(), exc.details() or ""
    status, kind = _STATUS.get(code, (500, "server_error"))
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and NEVER_FITS in details:  # retrying cannot help: 400
        message = f"{max_tokens_param}: {details}"
        return ApiError(400, message, "invalid_request_error", max_tokens_param, "context_length_exceeded")
    params = (max_tokens_param, logprobs_param, prompt_logprobs_param, structured_output_param)
    param = param_of(details, *params) if status == 400 else None
    message = param + details[len(_field(details)) :] if param else details  # the field as the client named it
    if status == 503:
        message = f"the verifier is unavailable: {details}"
    return ApiError(status, message, kind, param, _CODES.get(status, code.name.lower()))


def validation_error(exc: Exception) -> ApiError:
    """A body that does not validate (pydantic's ``ValidationError``, FastAPI's ``RequestValidationError``):
    a 400 naming the first field at fault, in OpenAI's words for a field it does not know."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('msg', '')}", code="json_invalid")
    param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param)
    return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param)


def parse_body(raw: bytes, model: type[T]) -> T:
    """A route's JSON body as ``model``, or the 400 saying what is wrong with it (as FastAPI's bodies get)."""
    import json

    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="json_invalid") from None
    return validated(data, model)


def validated(data: Any, model: type[T]) -> T:
    """``data`` as ``model``, or the 400 naming the field at fault (``validation_error``)."""
    from pydantic import ValidationError

    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
