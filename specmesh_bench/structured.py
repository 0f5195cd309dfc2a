"""The structured-output workloads of ``specmesh bench --structured {json,tools}``.

``json``: every prompt is asked to answer as a small JSON object (``ANSWER_SCHEMA``: the answer,
the prompt's topic as one of the dev workload's 8 categories, a confidence), and the request
carries that schema: ``SamplingParams.structured_output`` over gRPC, ``response_format``
json_schema over HTTP. ``tools``: every prompt comes with ``TOOLS`` (3 functions) and is made to
call one of them (``FORCED``, by category): over gRPC the prompt lists the tools and the request
carries the function's parameters schema; over HTTP it goes to chat completions with ``tools``
and ``tool_choice`` naming the function. Either way the output (the JSON text, or the call's
arguments) must validate against ``Structured.schema`` (``schema_error``).

The instructions are appended to the user turn, so the prompts stay the dev workload's and the
gRPC and HTTP paths (json) send the same token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from specmesh_bench.workload import BenchPrompt, Encode

KINDS = ("json", "tools")
# The dev workload's categories (workloads/specbench_offline_dev.jsonl): the answer's topic.
TOPICS = ("code", "code_edit", "math_reasoning", "mt_bench", "qa", "rag", "summarization", "translation")

# Strings are bounded: a small model can loop inside an open string until max_tokens, where the bound
# makes the grammar close it (a bound costs compile time once: ~1.5 s for 100 characters, cached).
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 100},
        "topic": {"enum": list(TOPICS)},
        "confidence": {"type": "number"},
    },
    "required": ["answer", "topic", "confidence"],
    "additionalProperties": False,
}
JSON_INSTRUCTION = (
    "\n\nReply with a JSON object only: "
    '{"answer": <your answer, one or two sentences>, "topic": <one of ' + ", ".join(TOPICS) + ">, "
    '"confidence": <a number from 0 to 1>}.'
)


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    params = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


TOOLS: tuple[dict[str, Any], ...] = (
    _function(
        "run_python",
        "Run a Python program and return what it prints.",
        {"code": {"type": "string", "description": "the complete program", "maxLength": 300}},
    ),
    _function(
        "search_docs",
        "Search the documentation for passages.",
        {
            "query": {"type": "string", "maxLength": 100},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
        },
    ),
    _function(
        "reply",
        "Send the final reply to the user.",
        {"text": {"type": "string", "maxLength": 200}, "language": {"enum": ["en", "de", "fr", "es", "other"]}},
    ),
)
# The function each category's prompts must call.
FORCED = {"code": "run_python", "code_edit": "run_python", "math_reasoning": "run_python", "qa": "search_docs",
          "rag": "search_docs"}  # fmt: skip
DEFAULT_TOOL = "reply"


@dataclass(frozen=True)
class Structured:
    """What a prompt's output must be: ``schema`` (JSON text) is what it validates against and what
    the gRPC request carries; ``tools`` (JSON text of OpenAI tool objects) and ``tool`` (the forced
    function) are set for a tool call."""

    kind: str  # "json" | "tools"
    schema: str
    tools: str = ""
    tool: str = ""

    def response_format(self) -> dict[str, Any]:
        """OpenAI's ``response_format`` for this schema.

        >>> json_task("qa").response_format()["json_schema"]["name"]
        'answer'
        """
        return {"type": "json_schema", "json_schema": {"name": "answer", "schema": json.loads(self.schema),
                                                       "strict": True}}  # fmt: skip

    def tool_choice(self) -> dict[str, Any]:
        """OpenAI's ``tool_choice`` naming the forced function.

        >>> tools_task("qa").tool_choice()
        {'type': 'function', 'function': {'name': 'search_docs'}}
        """
        return {"type": "function", "function": {"name": self.tool}}


def json_task(category: str) -> Structured:
    """The ``json`` workload's structure (the same for every category)."""
    return Structured("json", json.dumps(ANSWER_SCHEMA))


def tools_task(category: str) -> Structured:
    """The ``tools`` workload's structure for a category: the tool set, its forced function and
    that function's parameters.

    >>> t = tools_task("code")
    >>> t.tool, json.loads(t.schema)["required"], len(json.loads(t.tools))
    ('run_python', ['code'], 3)
    """
    name = FORCED.get(category, DEFAULT_TOOL)
    fn = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
    return Structured("tools", json.dumps(fn["parameters"]), json.dumps(list(TOOLS)), name)


def instruction(task: Structured) -> str:
    """What is appended to the user turn: the JSON shape, or the tools and which one to call (the
    default model's chat template renders no tools, so the prompt lists them itself).

    >>> instruction(tools_task("qa")).splitlines()[-1]
    'Call the function search_docs now: reply with its arguments as a JSON object only.'
    """
    if task.kind == "json":
        return JSON_INSTRUCTION
    lines = [f"- {t['function']['name']}: {t['function']['description']} Arguments: "
             f"{json.dumps(t['function']['parameters']['properties'])}" for t in json.loads(task.tools)]  # fmt: skip
    return (
        "\n\nYou can call these functions:\n" + "\n".join(lines) + f"\n"
        f"Call the function {task.tool} now: reply with its arguments as a JSON object only."
    )


def structure(prompts: list[BenchPrompt], kind: str, encode: Encode) -> list[BenchPrompt]:
    """``prompts`` (first turns) with the workload's instruction appended to the user turn,
    re-encoded, and their ``structured`` set.

    >>> p = BenchPrompt("qa", 0, "q1", "", "Why?", (1,), turns=("Why?",))
    >>> [q] = structure([p], "json", lambda text: [len(text)])
    >>> q.text.startswith("Why?\\n\\nReply with a JSON object"), q.token_ids == (len(q.text),), q.structured.kind
    (True, True, 'json')
    """
    task = {"json": json_task, "tools": tools_task}[kind]
    out = []
    for p in prompts:
        t = task(p.category)
        text = p.text + instruction(t)
        out.append(replace(p, text=text, token_ids=tuple(encode(text)), turns=(text, *p.turns[1:]), structured=t))
    return out


def schema_error(text: str, task: Structured) -> str | None:
    """Why ``text`` is not a valid output (not JSON, or what jsonschema says), or None.

    >>> task = json_task("qa")
    >>> schema_error('{"answer": "yes", "topic": "qa", "confidence": 0.9}', task) is None
    True
    >>> schema_error('{"answer": "yes", "topic": "qa"}', task)
    "'confidence' is a required property"
    >>> schema_error('{"answer": "ye', task)[:14]
    'not JSON: Unte'
    """
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    try:
        jsonschema.validate(value, json.loads(task.schema))
    except jsonschema.ValidationError as exc:
        return exc.message
    return None
