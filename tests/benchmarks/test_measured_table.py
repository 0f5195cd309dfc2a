"""``benchmarks/measured_table.py``: the README's Measured table, built from one bench run's summary."""

from __future__ import annotations

import doctest
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import measured_table  # noqa: E402

SUMMARY_MD = """# specmesh bench — 2026-11-28 10:00:00 UTC

Machine: AMD EPYC (2 cores); verifier: M on cpu, 2 torch threads; git abcdef1234; 64 new tokens, 1 prompts per category.

Command: `specmesh bench --modes plain,suffix,ngram --mix --out docs/bench/fake`
"""


def _row(c: int, cat: str, mode: str, tps: float, speedup: float, lossless: bool | None = True) -> dict:
    return {"sampling": "greedy", "concurrency": c, "category": cat, "mode": mode, "tokens_per_s": tps,
            "speedup": speedup, "lossless": None if mode == "plain" else lossless}  # fmt: skip


def test_the_table_of_a_tiny_fake_summary() -> None:
    rows = [
        _row(1, "qa", "suffix", 30.0, 1.5),
        _row(1, "qa", "plain", 20.0, 1.0),
        _row(1, "code", "plain", 10.0, 1.0),
        _row(1, "code", "ngram", 25.0, 2.5),  # no suffix row for code: its cell is "–"
        _row(1, "overall", "plain", 14.1, 1.0),
        _row(1, "overall", "ngram", 25.0, 2.5),
        _row(1, "overall", "suffix", 30.0, 1.5),
        _row(8, "mix", "plain", 50.0, 1.0),
        _row(8, "mix", "ngram", 55.0, 1.1),
        _row(8, "mix", "suffix", 45.0, 0.9),
        {**_row(1, "qa", "ngram", 99.0, 9.9), "sampling": "sampled"},  # not in the greedy table
    ]
    run = measured_table.run_info(SUMMARY_MD, "docs/bench/fake")
    assert (run.commit, run.machine, run.date) == ("abcdef1234", "AMD EPYC (2 cores)", "2026-11-28 10:00:00 UTC")
    text = measured_table.measured_table(rows, run)
    lines = text.splitlines()
    assert lines[0].startswith("Run [docs/bench/fake](docs/bench/fake/summary.md): `specmesh bench --modes")
    assert "git abcdef1234" in lines[0] and "on AMD EPYC (2 cores)" in lines[1]
    assert "Every greedy output was token-identical" in text
    table = lines[lines.index("") + 1 :]
    assert table == [
        "| category (1 stream) | plain | ngram | suffix |",
        "|---|---|---|---|",
        "| code | 10.0 (1.00x) | 25.0 (2.50x) | – |",
        "| qa | 20.0 (1.00x) | – | 30.0 (1.50x) |",
        "| **overall (geo-mean)** | 14.1 (1.00x) | 25.0 (2.50x) | 30.0 (1.50x) |",
        "| **8 mixed streams** (aggregate) | 50.0 (1.00x) | 55.0 (1.10x) | 45.0 (0.90x) |",
    ]
    rows[0]["lossless"] = False
    assert "Not every greedy output" in measured_table.measured_table(rows, run)


def test_the_block_between_the_markers_is_replaced_alone() -> None:
    readme = "# X\n\n<!-- measured:begin -->\nold table\n<!-- measured:end -->\n\nprose\n"
    assert measured_table.replace_block(readme, "new") == (
        "# X\n\n<!-- measured:begin -->\nnew\n<!-- measured:end -->\n\nprose\n"
    )


def test_the_readme_shows_what_the_script_makes_of_the_run_it_names() -> None:
    """The README's table is generated, not edited by hand: regenerating it from its run changes nothing."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split(measured_table.BEGIN, 1)[1].split(measured_table.END, 1)[0].strip("\n")
    folder = block.split("](", 1)[0].removeprefix("Run [")
    rows = json.loads((ROOT / folder / "summary.json").read_text())
    run = measured_table.run_info((ROOT / folder / "summary.md").read_text(), folder)
    assert measured_table.measured_table(rows, run) == block


def test_doctests() -> None:
    assert doctest.testmod(measured_table).failed == 0
