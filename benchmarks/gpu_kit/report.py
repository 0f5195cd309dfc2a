"""The check's report: time-boxed sections, each a status, tables and notes, written as Markdown and JSON
after every section (a run cut short still leaves what it measured)."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class Deadline:
    """A section's time box: ``left()`` seconds remain; loops ask ``spent()`` before each item.

    >>> d = Deadline(0.0)
    >>> d.spent(), d.left() == 0.0
    (True, True)
    """

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def spent(self) -> bool:
        return self.left() <= 0.0


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[Any]] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in self.rows]
        return "\n".join(lines)


def _cell(value: Any) -> str:
    """A table cell: floats to 4 significant digits.

    >>> _cell(0.000123456), _cell(12345.6), _cell("x"), _cell(None)
    ('0.0001235', '1.235e+04', 'x', '—')
    """
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@dataclass
class Section:
    """One section's outcome. ``status``: ok (every check held), fail (a check did not), partial
    (the budget ran out before every item ran), skipped (not run; ``notes`` say why), error (raised)."""

    name: str
    status: str = "ok"
    seconds: float = 0.0
    summary: str = ""
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def table(self, title: str, header: list[str]) -> Table:
        t = Table(title, header)
        self.tables.append(t)
        return t

    def fail(self, why: str) -> None:
        self.status = "fail"
        self.notes.append("FAIL: " + why)

    def budget_spent(self, done: int, total: int) -> None:
        if self.status == "ok":
            self.status = "partial"
        self.notes.append(f"budget spent: ran {done} of {total} items; the rest skipped")


SectionFn = Callable[[Any, Section, Deadline], None]


@dataclass
class Report:
    header: dict[str, Any]
    out_dir: Path
    sections: list[Section] = field(default_factory=list)

    def run(self, name: str, fn: SectionFn, ctx: Any, budget_s: float, total: Deadline) -> Section:
        """Run one section within ``min(budget_s, what the whole run has left)``; a section with no
        time left is skipped with a one-line reason; an exception fails that section only."""
        sec = Section(name)
        self.sections.append(sec)
        budget = min(budget_s, total.left())
        if budget < 1.0:
            sec.status = "skipped"
            sec.notes.append("skipped: the run's total budget is spent")
            self.write()
            return sec
        t0 = time.monotonic()
        print(f"gpu-check: {name} (budget {budget:.0f} s)", flush=True)
        try:
            fn(ctx, sec, Deadline(budget))
        except Exception as exc:  # one section's failure is a line of the report, not the end of the run
            sec.status = "error"
            sec.notes.append(f"error: {type(exc).__name__}: {exc}")
            sec.notes.append("```\n" + traceback.format_exc(limit=8).strip() + "\n```")
        sec.seconds = time.monotonic() - t0
        print(f"gpu-check: {name}: {sec.status} in {sec.seconds:.1f} s {sec.summary}", flush=True)
        self.write()
        return sec

    @property
    def ok(self) -> bool:
        return all(s.status in ("ok", "partial", "skipped") for s in self.sections)

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"header": self.header, "sections": [asdict(s) for s in self.sections]}
        (self.out_dir / "gpu-report.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
        (self.out_dir / "gpu-report.md").write_text(self.markdown())

    def markdown(self) -> str:
        h = self.header
        lines = ["# SpecMesh GPU check", ""]
        lines += [f"- {k}: {v}" for k, v in h.items()]
        lines += ["", "| section | status | seconds | summary |", "|---|---|---|---|"]
        lines += [f"| {s.name} | {s.status} | {s.seconds:.1f} | {s.summary} |" for s in self.sections]
        for s in self.sections:
            lines += ["", f"## {s.name}: {s.status}", ""]
            if s.summary:
                lines += [s.summary, ""]
            for t in s.tables:
                lines += [t.markdown(), ""]
            lines += [f"- {n}" if not n.startswith("```") else n for n in s.notes]
        return "\n".join(lines).rstrip() + "\n"
