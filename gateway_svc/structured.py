"""Structured outputs: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older
``guided_*`` fields, each mapped onto the one ``StructuredOutput`` the verifier enforces (a JSON
schema, any JSON object, a regex, a choice list or an EBNF grammar, compiled by xgrammar).

A request asks for one grammar at most: two fields that each ask for one are a 400 naming the
second. What the verifier cannot honour (another backend, a whitespace pattern, structural tags) is
a 400 naming it, as is a malformed value; a grammar only the verifier can judge (a schema or regex
xgrammar cannot compile) comes back as INVALID_ARGUMENT, answered as a 400 naming the request field
it came from (``Grammar.param``).

Whitespace between JSON elements: vLLM's fields follow vLLM (any whitespace unless
``disable_any_whitespace`` or the backend option ``disable-any-whitespace``); ``response_format`` is
compact (JSON's ``", "`` and ``": "`` separators only), as the contract's default. Free whitespace
lets a sampled small model spend its tokens on newlines and spaces the grammar allows forever (the
"stuck in whitespace until max_tokens" failure OpenAI warns of for JSON mode); compact output is
also what ``json.dumps`` writes and costs fewer tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway_svc.errors import RequestError
from specmesh.params import StructuredOutput

# The request fields that ask for a grammar or tune one (both endpoints).
FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
)
BACKENDS = ("xgrammar", "auto")  # vLLM's names for what this server runs; another is refused
# vLLM's older per-request backend options ("xgrammar:disable-any-whitespace,no-fallback")
_BACKEND_OPTIONS = ("disable-any-whitespace", "no-fallback", "no-additional-properties")
# vLLM's StructuredOutputsParams: the grammar kinds, then the options (older versions' too).
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback", "whitespace_pattern",
            "backend")  # fmt: skip
_REFUSED_KINDS = {
    "structural_tag": "structural tags are not supported (json, regex, choice, grammar and json_object are)",
}


@dataclass(frozen=True)
class Grammar:
    """The grammar a request asks for, and the request field it came from (what a 400 names)."""

    output: StructuredOutput
    param: str


def from_fields(fields: Mapping[str, Any]) -> Grammar | None:
    """The one grammar that a request's ``FIELDS`` (name → value, ``None`` when unset) ask for.

    >>> g = from_fields({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}})
    >>> g.output.json_schema, g.output.any_whitespace, g.param
    ('{}', False, 'response_format')
    >>> from_fields({"guided_choice": ["yes", "no"]}).output.choice
    ('yes', 'no')
    >>> from_fields({"structured_outputs": {"regex": "[0-9]+"}}).param
    'structured_outputs.regex'
    >>> from_fields({"response_format": {"type": "text"}, "guided_json": None}) is None
    True
    >>> from_fields({"response_format": {"type": "json_object"}, "guided_regex": "a+"})
    Traceback (most recent call last):
    gateway_svc.errors.RequestError: guided_regex: one grammar per request, and response_format already asks for one
    """
    found = [g for g in (_response_format(fields.get("response_format")),
                         _structured_outputs(fields.get("structured_outputs")),
                         _guided(fields)) if g is not None]  # fmt: skip
    if len(found) > 1:
        msg = f"{found[1].param}: one grammar per request, and {found[0].param} already asks for one"
        raise RequestError(msg, found[1].param)
    return found[0] if found else None


def schema_text(param: str, schema: Any) -> str:
    """A JSON schema (an object or a boolean, or JSON text of one) as compact JSON text, its keys in
    the order given (a schema's property order is the order the output writes them).

    >>> schema_text("guided_json", '{"type": "object", "properties": {"b": {}, "a": {}}}')
    '{"type":"object","properties":{"b":{},"a":{}}}'
    >>> schema_text("guided_json", [1])
    Traceback (most recent call last):
    gateway_svc.errors.RequestError: guided_json: a JSON schema is an object or a boolean, got list
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise RequestError(f"{param}: not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict | bool):
        raise RequestError(f"{param}: a JSON schema is an object or a boolean, got {type(schema).__name__}", param)
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _response_format(value: Any) -> Grammar | None:
    """OpenAI's ``response_format``: text (no grammar), json_object, or json_schema (``strict`` true
    or false alike: the grammar enforces the schema either way). Always compact (module docstring)."""
    p = "response_format"
    if value is None:
        return None
    kind = _object(p, value).get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        why = "; structural tags are not supported" if kind == "structural_tag" else ""
        raise RequestError(f"{p}.type must be text, json_object or json_schema, got {kind!r}{why}", f"{p}.type")
    _known(p, value, allowed[kind])
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar(StructuredOutput(json_object=True), p)
    spec = _object(f"{p}.json_schema", value.get("json_schema"))
    _known(f"{p}.json_schema", spec, {"name", "schema", "strict", "description"})
    if not isinstance(spec.get("name"), str):
        raise RequestError(f"{p}.json_schema.name is required (a string)", f"{p}.json_schema.name")
    for key, kind_ in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kind_):
            raise RequestError(f"{p}.json_schema.{key} must be a {kind_.__name__}", f"{p}.json_schema.{key}")
    if "schema" not in spec:
        raise RequestError(f"{p}.json_schema.schema is required (a JSON schema object)", p)
    if not isinstance(spec["schema"], dict | bool):  # OpenAI's: an object, never JSON text
        raise RequestError(f"{p}: json_schema.schema must be a JSON schema object", p)
    return Grammar(StructuredOutput(json_schema=schema_text(p, spec["schema"])), p)


def _structured_outputs(value: Any) -> Grammar | None:
    """vLLM's ``structured_outputs`` (StructuredOutputsParams): one kind, and its options."""
    p = "structured_outputs"
    if value is None:
        return None
    _known(p, _object(p, value), {*_KINDS, *_OPTIONS})
    for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if value.get(name) is not None and not isinstance(value[name], bool):
            raise RequestError(f"{p}.{name} must be a boolean", f"{p}.{name}")
    if value.get("whitespace_pattern") is not None:
        msg = f"{p}.whitespace_pattern is not supported: JSON whitespace is compact or any (disable_any_whitespace)"
        raise RequestError(msg, f"{p}.whitespace_pattern")
    _backend(f"{p}.backend", value.get("backend"))
    kinds = [k for k in _KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(kinds) != 1:
        got = f"got {', '.join(kinds)}" if kinds else "got none"
        raise RequestError(f"{p} takes exactly one of json, regex, choice, grammar, json_object ({got})", p)
    kind = kinds[0]
    if kind in _REFUSED_KINDS:
        raise RequestError(f"{p}.{kind} is not supported: {_REFUSED_KINDS[kind]}", f"{p}.{kind}")
    return _kind(f"{p}.{kind}", kind, value[kind], any_whitespace=not value.get("disable_any_whitespace"))


def _guided(fields: Mapping[str, Any]) -> Grammar | None:
    """vLLM's older top-level ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
    tuned by ``guided_decoding_backend`` ("xgrammar", "auto", or "xgrammar:<options>")."""
    names = [n for n in ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if fields.get(n) is not None]
    if len(names) > 1:
        raise RequestError(f"{names[1]}: one grammar per request, and {names[0]} already asks for one", names[1])
    options = _backend("guided_decoding_backend", fields.get("guided_decoding_backend"))
    if not names:
        return None
    kind = names[0].removeprefix("guided_")
    return _kind(names[0], kind, fields[names[0]], any_whitespace="disable-any-whitespace" not in options)


def _kind(param: str, kind: str, value: Any, any_whitespace: bool) -> Grammar:
    """One vLLM grammar kind's value as a StructuredOutput (any_whitespace: JSON kinds only)."""
    if kind == "json":
        return Grammar(StructuredOutput(json_schema=schema_text(param, value), any_whitespace=any_whitespace), param)
    if kind == "json_object":
        if value is not True:
            raise RequestError(f"{param} must be true (leave it out for free text)", param)
        return Grammar(StructuredOutput(json_object=True, any_whitespace=any_whitespace), param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise RequestError(f"{param} must be a non-empty list of strings", param)
        return Grammar(StructuredOutput(choice=tuple(value)), param)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{param} must be a non-empty string", param)
    return Grammar(StructuredOutput(**{kind: value}), param)


def _backend(param: str, value: Any) -> tuple[str, ...]:
    """A vLLM backend name (with the older ``name:opt,opt`` options): this server's, or a 400.

    >>> _backend("guided_decoding_backend", "xgrammar:disable-any-whitespace,no-fallback")
    ('disable-any-whitespace', 'no-fallback')
    >>> _backend("structured_outputs.backend", "outlines")
    Traceback (most recent call last):
    gateway_svc.errors.RequestError: structured_outputs.backend 'outlines' is not supported: this server runs xgrammar
    """
    if value is None:
        return ()
    if not isinstance(value, str):
        raise RequestError(f"{param} must be a string", param)
    name, _, opts = value.partition(":")
    options = tuple(o.strip() for o in opts.split(",") if o.strip())
    if name.strip() not in BACKENDS:
        msg = f"{param} {name!r} is not supported: this server runs xgrammar"
        raise RequestError(msg, param)
    if unknown := [o for o in options if o not in _BACKEND_OPTIONS]:
        raise RequestError(f"{param}: unknown options {unknown} (known: {', '.join(_BACKEND_OPTIONS)})", param)
    return options


def _object(param: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise RequestError(f"{param} must be an object", param)
    return value


def _known(param: str, value: dict, names: set[str] | tuple[str, ...]) -> None:
    """OpenAI's words for a key it does not know, naming it."""
    if unknown := sorted(set(value) - set(names)):
        raise RequestError(f"Unrecognized request argument supplied: {param}.{unknown[0]}", f"{param}.{unknown[0]}")
