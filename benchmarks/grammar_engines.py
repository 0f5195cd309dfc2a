"""Grammar engines for structured outputs on this CPU: xgrammar vs llguidance, with the verifier's tokenizer.

For each grammar (the bench's JSON workload schema, a tool-call schema, a nested schema with arrays
and enums, any JSON object, a regex, a choice list, and the bench schema with a bounded string):

Grammars are compiled as the verifier compiles them (verifier_svc/grammar.py: JSON without free
whitespace, xgrammar's default ", " and ": " separators; ``json_object`` as the schema {"type": "object"}).

- compile, cold: xgrammar ``compile_*`` on a new ``GrammarCompiler`` (cache off), llguidance
  ``LLMatcher(tokenizer, grammar)``; then the time to the first mask (matcher + first fill), where
  llguidance builds its lexer lazily;
- mask per token: a valid output of the grammar (a JSON instance, compact, tokenized as the model's
  tokenizer does) walked token by token, ``fill_next_token_bitmask`` timed at every position
  (xgrammar ``GrammarMatcher``; llguidance ``LLMatcher`` + ``llguidance.torch.fill_next_token_bitmask``),
  and the token's advance (accept/consume) timed apart; the first walk (cold) is reported apart from
  the median and p99 over the following walks; the masks of both engines compared position by position;
- a 9-node draft tree (the root and 8 drafted nodes, 3 of them off the valid path) at every position
  of the bench schema's output: xgrammar's ``traverse_draft_tree`` in one call, against the walk a
  caller would do without it (per node: accept, fill, roll back) with each engine, and against 9 bare
  xgrammar fills at one state (a floor).

.venv/bin/python benchmarks/grammar_engines.py [--walks 20] [--compiles 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from common import cpu_name

from specmesh_bench.structured import ANSWER_SCHEMA, TOOLS, TOPICS

VOCAB = 49152  # SmolLM2's
# JSON without free whitespace, as the verifier asks xgrammar for it (any_whitespace=False: its default
# separators ", " and ": "); llguidance told the same. (xgrammar 0.2.8 ignores custom separators inside
# values a schema leaves untyped, so the verifier keeps the defaults.)
SEPARATORS = (", ", ": ")
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # llguidance's JSON options


def _required_tool_call() -> dict:
    """A tool call as ``tool_choice: "required"`` is forced (vLLM's shape): a non-empty array of
    {"name", "parameters"}, one variant per function of the bench's tool set."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "parameters": t["function"]["parameters"]},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in TOOLS
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


NESTED = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "size": {"enum": ["XS", "S", "M", "L", "XL"]},
                    "tags": {"type": "array", "items": {"enum": ["gift", "fragile", "sale", "new"]}},
                },
                "required": ["sku", "quantity", "size"],
                "additionalProperties": False,
            },
        },
        "shipping": {
            "type": "object",
            "properties": {
                "method": {"enum": ["standard", "express", "pickup"]},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "zip": {"type": "string"},
                        "country": {"type": "string"},
                    },
                    "required": ["street", "city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["method", "address"],
            "additionalProperties": False,
        },
        "total": {"type": "number"},
        "paid": {"type": "boolean"},
    },
    "required": ["order_id", "status", "items", "shipping", "total", "paid"],
    "additionalProperties": False,
}
BOUNDED = json.loads(json.dumps(ANSWER_SCHEMA))
BOUNDED["properties"]["answer"]["maxLength"] = 200
REGEX = r"(INFO|WARN|ERROR) \d{4}-\d{2}-\d{2} [a-z_]{1,20}: [A-Za-z ,.]{1,60}"


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # json_schema | json_object | regex | choice
    spec: object  # the schema (dict), the regex, or the choices
    output: str  # a valid output


def one_line(value: object) -> str:
    """JSON text as the grammars require: one line, ", " and ": " between items."""
    return json.dumps(value, separators=SEPARATORS)


ANSWER = {"answer": "The function returns True when two numbers are closer than the threshold.",
          "topic": "code", "confidence": 0.85}  # fmt: skip
CASES = (
    Case("bench json (answer, topic, confidence)", "json_schema", ANSWER_SCHEMA, one_line(ANSWER)),
    Case("tool call (required, 3 tools)", "json_schema", _required_tool_call(),
         one_line([{"name": "search_docs", "parameters": {"query": "python books for beginners", "max_results": 5}}])),
    Case("nested (arrays, enums, objects)", "json_schema", NESTED, one_line(
        {"order_id": "A-1042", "status": "paid",
         "items": [{"sku": "TS-01", "quantity": 2, "size": "M", "tags": ["gift"]},
                   {"sku": "HD-7", "quantity": 1, "size": "L", "tags": []}],
         "shipping": {"method": "express", "address": {"street": "1 Main St", "city": "Berlin", "country": "DE"}},
         "total": 59.9, "paid": True})),
    Case("any JSON object", "json_object", None, one_line(
        {"name": "Ada", "languages": ["en", "fr"], "age": 36, "active": True})),
    Case("regex (log line)", "regex", REGEX, "WARN 2026-11-27 disk_monitor: Usage above ninety percent, cleaning up."),
    Case("choice (8 categories)", "choice", list(TOPICS), "math_reasoning"),
    Case("bench json, answer maxLength 200", "json_schema", BOUNDED, one_line(ANSWER)),
)  # fmt: skip


def _us(seconds: list[float]) -> tuple[float, float]:
    """(median, p99) in microseconds."""
    s = sorted(seconds)
    return statistics.median(s) * 1e6, s[min(len(s) - 1, int(0.99 * len(s)))] * 1e6


@dataclass
class Engine:
    """One engine behind a common face: ``compile(case)`` → compiled, ``matcher(compiled)``,
    ``fill(matcher, mask, row)``, ``accept(matcher, token)`` → bool, ``rollback(matcher, n)``."""

    name: str
    compile: Callable
    matcher: Callable
    fill: Callable
    accept: Callable
    rollback: Callable
    setup_s: float = 0.0  # the tokenizer's preparation, once per process
    extra: dict = field(default_factory=dict)


def xgrammar_engine(tok, threads: int) -> Engine:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
    setup = time.perf_counter() - t0

    def compile_(case: Case):
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)  # cold: a new compiler
        t0 = time.perf_counter()
        if case.kind == "json_schema":
            out = compiler.compile_json_schema(json.dumps(case.spec), any_whitespace=False)
        elif case.kind == "json_object":
            out = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)  # as the verifier
        elif case.kind == "regex":
            out = compiler.compile_regex(case.spec)
        else:
            out = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in case.spec))
        return out, time.perf_counter() - t0

    return Engine(
        f"xgrammar {_version('xgrammar')}",
        compile_,
        lambda compiled: xgr.GrammarMatcher(compiled),
        lambda m, mask, row=0: m.fill_next_token_bitmask(mask, row),
        lambda m, t: m.accept_token(t),
        lambda m, n: m.rollback(n),
        setup,
    )


def llguidance_engine(tok) -> Engine:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB)
    setup = time.perf_counter() - t0

    def grammar(case: Case) -> str:
        if case.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(case.spec, overrides=COMPACT)
        if case.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=COMPACT)
        if case.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(case.spec)
        return llguidance.grammar_from("choice", json.dumps(case.spec))

    def compile_(case: Case):
        text = grammar(case)
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(lltok, text, log_level=0)  # compiles the grammar; the lexer is built lazily
        elapsed = time.perf_counter() - t0
        if m.is_error():
            raise RuntimeError(f"llguidance: {case.name}: {m.get_error()}")
        return text, elapsed

    def matcher(text: str):
        return llguidance.LLMatcher(lltok, text, log_level=0)

    def accept(m, t: int) -> bool:
        return m.consume_token(t) and not m.is_error()

    return Engine(
        f"llguidance {llguidance.get_version()}",
        compile_,
        matcher,
        lambda m, mask, row=0: llguidance.torch.fill_next_token_bitmask(m, mask, row),
        accept,
        lambda m, n: m.rollback(n),
        setup,
    )


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def cold_compile(engine: Engine, case: Case, repeats: int) -> tuple[float, float]:
    """Median (compile s, compile + matcher + first mask s) over ``repeats`` cold compiles."""
    mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    comp, first = [], []
    for _ in range(repeats):
        compiled, elapsed = engine.compile(case)
        t0 = time.perf_counter()
        engine.fill(engine.matcher(compiled), mask)
        comp.append(elapsed)
        first.append(elapsed + time.perf_counter() - t0)
    return statistics.median(comp), statistics.median(first)


def walk(engine: Engine, compiled, tokens: list[int], eos: int) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """One walk over a valid output: the fill time at every position (and after the last token,
    where EOS must be allowed), the advance time of every token, and the masks."""
    m = engine.matcher(compiled)
    mask = torch.empty((1, (VOCAB + 31) // 32), dtype=torch.int32)
    fills, advances, masks = [], [], []
    for t in [*tokens, eos]:
        t0 = time.perf_counter()
        engine.fill(m, mask)
        fills.append(time.perf_counter() - t0)
        masks.append(mask[0].clone())
        if not (mask[0, t // 32] >> (t % 32)) & 1:
            raise AssertionError(f"{engine.name}: token {t} of the valid output is masked out")
        if t == eos:
            break
        t0 = time.perf_counter()
        ok = engine.accept(m, t)
        advances.append(time.perf_counter() - t0)
        assert ok, f"{engine.name} refused token {t}"
    return fills, advances, masks


def _allowed(row: torch.Tensor) -> set[int]:
    bits = ((row.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()
    return set(torch.nonzero(bits).flatten().tolist())


def mask_differences(ref: list[torch.Tensor], masks: list[torch.Tensor], special: set[int]) -> str:
    """Where two engines' masks differ along a walk: how many positions differ, how many of them
    only by the tokenizer's special (added) tokens, and the most tokens only one side allows.

    >>> a, b = torch.tensor([0b110], dtype=torch.int32), torch.tensor([0b100], dtype=torch.int32)
    >>> mask_differences([a, a], [a, b], {1}), mask_differences([a], [b], set())
    ('1/2 (1 only by special tokens; at most 1 / 0 tokens only the first / this allows)', \
'1/1 (at most 1 / 0 tokens only the first / this allows)')
    """
    differ, only_special, first_only, this_only = 0, 0, 0, 0
    for x, y in zip(ref, masks, strict=True):
        if torch.equal(x, y):
            continue
        a, b = _allowed(x), _allowed(y)
        differ += 1
        only_special += (a ^ b) <= special
        first_only, this_only = max(first_only, len(a - b)), max(this_only, len(b - a))
    if not differ:
        return "same"
    note = f"{only_special} only by special tokens; " if only_special else ""
    return f"{differ}/{len(ref)} ({note}at most {first_only} / {this_only} tokens only the first / this allows)"


# The draft tree: node 0 is the root (the last accepted token, not consumed); the valid path
# 1 → 3 → 5 → 7 → 8 and an off-path sibling at each of the first three levels (2, 4, 6).
FIRST_CHILD = [1, 3, -1, 5, -1, 7, -1, 8, -1]
NEXT_SIBLING = [-1, 2, -1, 4, -1, 6, -1, -1, -1]
PARENT = [-1, 0, 0, 1, 1, 3, 3, 5, 7]


def tree_tokens(tokens: list[int], p: int, alt: int) -> list[int]:
    """The tree's draft tokens at position p (0 < p ≤ len − 5): the valid path tokens[p:p+5],
    ``alt`` at the off-path nodes."""
    path = tokens[p : p + 5]
    return [tokens[p - 1], path[0], alt, path[1], alt, path[2], alt, path[3], path[4]]


def sequential_tree(engine: Engine, m, draft: list[int], mask: torch.Tensor) -> None:
    """The tree's masks without a tree API: depth first, accept on the way down, fill, roll back."""

    def visit(node: int) -> None:
        engine.fill(m, mask, node)
        child = FIRST_CHILD[node]
        while child != -1:
            if engine.accept(m, draft[child]):
                visit(child)
                engine.rollback(m, 1)
            else:
                mask[child].zero_()
            child = NEXT_SIBLING[child]

    visit(0)


def tree_bench(engines: dict[str, Engine], compiled: dict[str, object], tokens: list[int], alt: int, reps: int):
    """Per position of the output, the 9-node tree: traverse_draft_tree, the sequential walk of each
    engine and 9 bare xgrammar fills; the (median, p99) µs over positions × reps, and whether the tree
    API's masks equal the walk's."""
    import xgrammar as xgr

    words = (VOCAB + 31) // 32
    nxt, sib = torch.tensor(FIRST_CHILD, dtype=torch.int64), torch.tensor(NEXT_SIBLING, dtype=torch.int64)
    times: dict[str, list[float]] = {}
    agree = True
    xg = next(k for k in engines if k.startswith("xgrammar"))
    for p in range(1, len(tokens) - 4):
        draft = tree_tokens(tokens, p, alt)
        masks = {}
        for name, engine in engines.items():
            m = engine.matcher(compiled[name])
            for t in tokens[:p]:
                assert engine.accept(m, t)
            if name == xg:
                mask = torch.empty((9, words), dtype=torch.int32)
                dt = torch.tensor(draft, dtype=torch.int64)
                for _ in range(reps):
                    t0 = time.perf_counter()
                    assert m.traverse_draft_tree(nxt, sib, dt, mask)
                    times.setdefault("xgrammar traverse_draft_tree", []).append(time.perf_counter() - t0)
                masks["tree"] = mask.clone()
                assert isinstance(m, xgr.GrammarMatcher)
            mask = torch.empty((9, words), dtype=torch.int32)
            for _ in range(reps):
                t0 = time.perf_counter()
                sequential_tree(engine, m, draft, mask)
                times.setdefault(f"{engine.name.split()[0]} per node: accept, fill, roll back", []).append(
                    time.perf_counter() - t0
                )
            masks[name] = mask.clone()
            if name == xg:  # a floor: llguidance keeps a state's mask, so its repeats would cost nothing
                bare = torch.empty((9, words), dtype=torch.int32)
                for _ in range(reps):
                    t0 = time.perf_counter()
                    for row in range(9):
                        engine.fill(m, bare, row)
                    times.setdefault("xgrammar 9 fills at one state (no moves: a floor)", []).append(
                        time.perf_counter() - t0
                    )
        agree &= torch.equal(masks["tree"], masks[xg])  # the tree API gives the walk's masks
    return {k: _us(v) for k, v in times.items()}, agree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--walks", type=int, default=20, help="warm walks per grammar (after one cold walk)")
    ap.add_argument("--compiles", type=int, default=5, help="cold compiles per grammar (median)")
    ap.add_argument(
        "--threads", type=int, default=1, help="xgrammar's compile threads (max_threads; the verifier's: 1)"
    )
    ap.add_argument("--tree-reps", type=int, default=20, help="repeats of each tree method per position")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    eos = tok.eos_token_id
    special = set(tok.added_tokens_decoder) - {eos}
    engines = {e.name: e for e in (xgrammar_engine(tok, a.threads), llguidance_engine(tok))}
    print(f"machine: {cpu_name()}; tokenizer SmolLM2-135M-Instruct ({VOCAB} tokens); xgrammar max_threads {a.threads}")
    print("tokenizer preparation, once: " + ", ".join(f"{n} {e.setup_s * 1e3:.0f} ms" for n, e in engines.items()))
    print()
    print("| grammar | tokens | engine | compile ms | + first mask ms | cold walk mask µs (median) "
          "| mask µs median | mask µs p99 | advance µs median | allowed sets vs the first engine's |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    compiled_answer: dict[str, object] = {}
    for case in CASES:
        tokens = tok.encode(case.output, add_special_tokens=False)
        per_engine = {}
        for name, engine in engines.items():
            comp, first = cold_compile(engine, case, a.compiles)
            compiled, _ = engine.compile(case)
            cold_fills, _, masks = walk(engine, compiled, tokens, eos)
            fills, advances = [], []
            for _ in range(a.walks):
                f, adv, _ = walk(engine, compiled, tokens, eos)
                fills += f
                advances += adv
            per_engine[name] = (comp, first, statistics.median(cold_fills) * 1e6, _us(fills), _us(advances), masks)
            if case is CASES[0]:
                compiled_answer[name] = compiled
        ref = next(iter(per_engine.values()))[5]
        for name, (comp, first, cold, (med, p99), (adv, _), masks) in per_engine.items():
            agree = mask_differences(ref, masks, special)
            print(f"| {case.name} | {len(tokens)} | {name} | {comp * 1e3:.1f} | {first * 1e3:.1f} | {cold:.0f} "
                  f"| {med:.0f} | {p99:.0f} | {adv:.0f} | {agree} |")  # fmt: skip
        sys.stdout.flush()
    print()
    answer_tokens = tok.encode(CASES[0].output, add_special_tokens=False)
    alt = tok.encode(" the", add_special_tokens=False)[0]
    results, agree = tree_bench(engines, compiled_answer, answer_tokens, alt, a.tree_reps)
    print(f"9-node draft tree over the bench json output ({len(answer_tokens) - 5} positions x {a.tree_reps}; "
          f"off-path token {tok.decode([alt])!r}); xgrammar's tree masks equal its walk's: {agree}")  # fmt: skip
    print()
    print("| method | µs per tree, median | p99 |")
    print("|---|---|---|")
    for name, (med, p99) in results.items():
        print(f"| {name} | {med:.0f} | {p99:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
