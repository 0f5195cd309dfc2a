"""`specmesh bench` end to end with the suffix proposer: a warm-up, both mt_bench turns, real services
and model, kept tiny (1 row, 8 tokens, 1 warm-up row)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import cpu_only_env

from specmesh_bench.workload import DEV_MEASURED, DEV_WARMUP

ROOT = Path(__file__).resolve().parents[2]  # the repository

pytestmark = pytest.mark.slow


def test_a_warm_suffix_run_over_both_turns_is_lossless_and_says_how_it_was_warmed(tmp_path):
    cmd = [
        sys.executable, "-m", "specmesh", "bench", "--workload", str(DEV_MEASURED), "--warmup-workload",
        str(DEV_WARMUP), "--warmup-limit", "1", "--categories", "mt_bench", "--limit", "1", "--max-tokens", "8",
        "--modes", "plain,ngram,suffix", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=cpu_only_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert sorted((r["mode"], r["turn"]) for r in records) == [
        (m, t) for m in ("ngram", "plain", "suffix") for t in (1, 2)
    ]
    assert all(r["lossless"] for r in records if r["mode"] != "plain")
    row = records[0]["row_id"].split("#")[0]
    assert {r["row_id"] for r in records} == {row, f"{row}#2"}
    assert [r["row_id"] for r in records if r["mode"] == "plain"] == [row, f"{row}#2"], "turn 2 after turn 1"
    token = records[0]["cache_scope_token"]
    scope = f"bench-{token}-suffix-greedy-c1"
    assert {r["cache_scope"] for r in records if r["mode"] == "suffix"} == {scope}
    assert {r["cache_scope"] for r in records if r["mode"] == "ngram"} == {f"bench-{token}-ngram-greedy-c1"}
    assert records[0]["warmup_scopes"] == [scope] and records[0]["warmup_prompts"] == 1
    assert "warm-up, 1 prompts through suffix in scope " + scope in proc.stderr
    first = next(r for r in records if r["mode"] == "plain" and r["turn"] == 2)
    assert first["prompt_tokens"] > next(r for r in records if r["mode"] == "plain")["prompt_tokens"]
    summary = (tmp_path / "summary.md").read_text()
    assert f"`{scope}`" in summary and "suffix vs ngram (tokens/s, paired)" in summary
    assert "| category | plain | ngram | suffix |" in summary
