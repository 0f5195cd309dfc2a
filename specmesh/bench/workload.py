"""Benchmark prompts: rows of a Spec-Bench-shaped JSONL, chat-templated for the target.

Each row has ``id``, ``category``, ``source`` (attribution, kept in every result line) and
``turns`` (user messages). Multi-turn rows are benchmarked on their first turn: a second turn
would need the model's own first answer, which differs per model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "workloads" / "specbench_offline_dev.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    category: str
    index: int  # position within its category
    row_id: str
    source: str
    text: str
    token_ids: tuple[int, ...]


def read_rows(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not row.get("turns") or "category" not in row:
            raise ValueError(f"{path}:{n}: a row needs 'category' and non-empty 'turns'")
        rows.append(row)
    return rows


def select_rows(rows: list[dict], categories: list[str] | None, limit: int) -> list[dict]:
    """The first ``limit`` rows of each category (all categories when None), in file order.

    >>> rows = [{"category": c, "turns": ["x"]} for c in "aabbbc"]
    >>> [r["category"] for r in select_rows(rows, ["b", "a"], 2)]
    ['a', 'a', 'b', 'b']
    """
    seen: dict[str, int] = {}
    out = []
    for row in rows:
        cat = row["category"]
        if categories is not None and cat not in categories:
            continue
        if seen.get(cat, 0) < limit:
            seen[cat] = seen.get(cat, 0) + 1
            out.append(row)
    return out


def load_prompts(
    path: Path, categories: list[str] | None, limit: int, encode: Callable[[str], list[int]]
) -> list[BenchPrompt]:
    rows = select_rows(read_rows(path), categories, limit)
    if categories is not None:
        missing = sorted(set(categories) - {r["category"] for r in rows})
        if missing:
            raise ValueError(f"no rows for categories {missing} in {path}")
    counters: dict[str, int] = {}
    prompts = []
    for row in rows:
        cat = row["category"]
        idx = counters.get(cat, 0)
        counters[cat] = idx + 1
        text = row["turns"][0]
        prompts.append(
            BenchPrompt(cat, idx, str(row.get("id", "")), str(row.get("source", "")), text, tuple(encode(text)))
        )
    return prompts


_PASSAGE = re.compile(r"^\[\d+\] \(([^)\n]+)\) (.*?)(?=\n\n\[\d+\] \(|\n\nQuestion:|\Z)", re.S | re.M)


def rag_passages(prompt: str) -> list[tuple[str, str]]:
    r"""(source, text) of each ``[n] (source) text`` passage of a Spec-Bench rag prompt: the
    documents a retrieval datastore would hold.

    >>> rag_passages("[1] (doc/a) Alpha beta.\n\n[2] (doc/b) Gamma.\n\nQuestion: why?")
    [('doc/a', 'Alpha beta.'), ('doc/b', 'Gamma.')]
    """
    return [(m.group(1), m.group(2).strip()) for m in _PASSAGE.finditer(prompt)]
