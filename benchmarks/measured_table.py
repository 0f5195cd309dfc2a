"""The README's "Measured" table, regenerated from one ``specmesh bench`` run's summary.

    .venv/bin/python benchmarks/measured_table.py docs/bench/issue46-tp1 [--readme README.md]
        [--machine "AMD EPYC 7B13 (2 cores)"] [--command "specmesh bench …"]

Reads the run's ``summary.json`` (its rows) and the head of its ``summary.md`` (date, machine, commit, the
verifier's settings and the ``Command:`` line that made it) and rewrites what stands between
``<!-- measured:begin -->`` and ``<!-- measured:end -->`` in the README: one line naming the run, then
the table (greedy; one row per category at 1 stream, the geometric mean over categories, one overall row
per further concurrency). ``--machine`` and ``--command`` stand in where the summary lacks them.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

BEGIN = "<!-- measured:begin -->"
END = "<!-- measured:end -->"
OVERALL = "overall"
MIX = "mix"
# columns: plain first, then the proposers, then the router; modes not named here follow in run order
MODE_ORDER = ("plain", "ngram", "ngram-local", "suffix", "rag", "draft", "head", "auto", "oracle", "hf-pld")


@dataclass(frozen=True)
class RunInfo:
    """Where a run came from, as its summary says."""

    folder: str  # the run's folder as the README links it, e.g. "docs/bench/issue46-tp1"
    date: str  # "2026-11-27 15:41:42 UTC"
    machine: str  # "AMD EPYC (2 cores)"
    commit: str  # "531590602d"
    setup: str  # "SmolLM2-135M-Instruct float32 on cpu, TP=1, 2 torch threads; 128 new tokens, 2 prompts per category"
    command: str  # "specmesh bench --modes plain,ngram --out docs/bench/x"


def run_info(summary_md: str, folder: str, machine: str = "", command: str = "") -> RunInfo:
    """The run's date, machine, commit, setup and command from the head of its ``summary.md``.

    >>> head = '''# specmesh bench — 2026-11-27 15:41:42 UTC
    ...
    ... Machine: AMD EPYC (2 cores); verifier: M on cpu; git 531590602d; 128 new tokens, 2 prompts per category.
    ...
    ... Command: `specmesh bench --modes plain,ngram --out x`
    ... '''
    >>> info = run_info(head, "docs/bench/x")
    >>> info.date, info.machine, info.commit, info.command
    ('2026-11-27 15:41:42 UTC', 'AMD EPYC (2 cores)', '531590602d', 'specmesh bench --modes plain,ngram --out x')
    >>> info.setup
    'M on cpu; 128 new tokens, 2 prompts per category'
    >>> run_info(head, "docs/bench/x", machine="AMD EPYC 7B13 (2 cores)").machine
    'AMD EPYC 7B13 (2 cores)'
    """
    title = re.search(r"^# specmesh bench — (.+)$", summary_md, re.M)
    head = re.search(r"^Machine: ([^;]+); (?:verifier|server): (.+?); git (\w+); (.+?)\.?$", summary_md, re.M)
    recorded = re.search(r"^Command: `(.+)`", summary_md, re.M)
    if title is None or head is None:
        raise ValueError(f"{folder}: not a `specmesh bench` summary.md (no title or Machine line)")
    if not (command or recorded):
        raise ValueError(f"{folder}: summary.md states no Command; pass --command")
    return RunInfo(
        folder=folder,
        date=title.group(1).strip(),
        machine=machine or head.group(1).strip(),
        commit=head.group(3),
        setup=f"{head.group(2)}; {head.group(4)}",
        command=command or (recorded.group(1) if recorded else ""),
    )


def _modes(rows: list[dict]) -> list[str]:
    """The run's modes in column order.

    >>> _modes([{"mode": "auto"}, {"mode": "x"}, {"mode": "plain"}, {"mode": "suffix"}])
    ['plain', 'suffix', 'auto', 'x']
    """
    seen = list(dict.fromkeys(r["mode"] for r in rows))
    known = [m for m in MODE_ORDER if m in seen]
    return known + [m for m in seen if m not in MODE_ORDER]


def _cell(row: dict | None) -> str:
    """One table cell: tokens/s and the speed-up over plain.

    >>> _cell({"tokens_per_s": 33.46, "speedup": 1.0}), _cell({"tokens_per_s": 5.0, "speedup": None}), _cell(None)
    ('33.5 (1.00x)', '5.0 (–)', '–')
    """
    if row is None:
        return "–"
    speedup = "–" if row.get("speedup") is None else f"{row['speedup']:.2f}x"
    return f"{row['tokens_per_s']:.1f} ({speedup})"


def measured_table(rows: list[dict], run: RunInfo) -> str:
    """The README's Measured block (between the markers) for a run's ``summary.json`` rows.

    >>> rows = [
    ...     {"sampling": "greedy", "concurrency": c, "category": cat, "mode": m, "tokens_per_s": t,
    ...      "speedup": s, "lossless": None if m == "plain" else True}
    ...     for c, cat, m, t, s in [
    ...         (1, "code", "plain", 10.0, 1.0), (1, "code", "ngram", 15.0, 1.5),
    ...         (1, "overall", "plain", 10.0, 1.0), (1, "overall", "ngram", 15.0, 1.5),
    ...         (8, "code", "plain", 40.0, 1.0), (8, "code", "ngram", 44.0, 1.1),
    ...         (8, "overall", "plain", 40.0, 1.0), (8, "overall", "ngram", 44.0, 1.1)]]
    >>> run = RunInfo("docs/bench/x", "2026-11-27 15:41:42 UTC", "AMD EPYC (2 cores)", "531590602d",
    ...               "M on cpu; 64 new tokens, 2 prompts per category", "specmesh bench --out docs/bench/x")
    >>> print(measured_table(rows, run))  # doctest: +NORMALIZE_WHITESPACE
    Run [docs/bench/x](docs/bench/x/summary.md): `specmesh bench --out docs/bench/x` at git 531590602d,
    2026-11-27 15:41:42 UTC, on AMD EPYC (2 cores) (M on cpu; 64 new tokens, 2 prompts per category).
    Greedy; tokens/s end to end per request (prefill included), median; in parentheses the speed-up
    paired with plain on the same prompt. Every greedy output was token-identical to plain decoding.
    <BLANKLINE>
    | category (1 stream) | plain | ngram |
    |---|---|---|
    | code | 10.0 (1.00x) | 15.0 (1.50x) |
    | **overall (geo-mean)** | 10.0 (1.00x) | 15.0 (1.50x) |
    | **8 streams** (geo-mean over categories of wave aggregates) | 40.0 (1.00x) | 44.0 (1.10x) |
    """
    greedy = [r for r in rows if r["sampling"] == "greedy"]
    modes = _modes(greedy)
    cell = {(r["concurrency"], r["category"], r["mode"]): r for r in greedy}
    cats = sorted({r["category"] for r in greedy if r["concurrency"] == 1} - {OVERALL, MIX})
    checked = [r["lossless"] for r in greedy if r.get("lossless") is not None]
    lossless = (
        "Every greedy output was token-identical to plain decoding."
        if checked and all(checked)
        else "**Not every greedy output equalled plain decoding's: see the run's summary.**"
        if checked
        else "Outputs were not compared with plain decoding."
    )
    lines = [
        f"Run [{run.folder}]({run.folder}/summary.md): `{run.command}` at git {run.commit},",
        f"{run.date}, on {run.machine} ({run.setup}).",
        "Greedy; tokens/s end to end per request (prefill included), median; in parentheses the speed-up",
        f"paired with plain on the same prompt. {lossless}",
        "",
        "| category (1 stream) | " + " | ".join(modes) + " |",
        "|---" * (len(modes) + 1) + "|",
    ]
    for cat in [*cats, OVERALL]:
        label = "**overall (geo-mean)**" if cat == OVERALL else cat
        lines.append(f"| {label} | " + " | ".join(_cell(cell.get((1, cat, m))) for m in modes) + " |")
    for c in sorted({r["concurrency"] for r in greedy} - {1}):
        mixed = any((c, MIX, m) in cell for m in modes)
        label = (
            f"**{c} mixed streams** (aggregate)"
            if mixed
            else f"**{c} streams** (geo-mean over categories of wave aggregates)"
        )
        key = MIX if mixed else OVERALL
        lines.append(f"| {label} | " + " | ".join(_cell(cell.get((c, key, m))) for m in modes) + " |")
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """``text`` with what stands between the Measured markers replaced by ``block``.

    >>> replace_block("a\\n<!-- measured:begin -->\\nold\\n<!-- measured:end -->\\nb", "new")
    'a\\n<!-- measured:begin -->\\nnew\\n<!-- measured:end -->\\nb'
    """
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} … {END} block")
    return text[: start + len(BEGIN)] + "\n" + block + "\n" + text[end:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a `specmesh bench --out` folder (summary.json + summary.md)")
    p.add_argument("--readme", type=Path, default=Path("README.md"))
    p.add_argument("--machine", default="", help="the CPU model and cores, where summary.md's is too vague")
    p.add_argument("--command", default="", help="the command that made the run, where summary.md states none")
    a = p.parse_args()
    rows = json.loads((a.run / "summary.json").read_text())
    info = run_info((a.run / "summary.md").read_text(), a.run.as_posix().rstrip("/"), a.machine, a.command)
    a.readme.write_text(replace_block(a.readme.read_text(), measured_table(rows, info)))
    print(f"measured_table: {a.readme} now shows {info.folder} (git {info.commit}, {info.date})")


if __name__ == "__main__":
    main()
