"""`specmesh bench` end to end on a tiny run: real services, real model, every output file checked."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from support import cpu_only_env

ROOT = Path(__file__).resolve().parents[2]  # the repository

pytestmark = pytest.mark.slow

FIELDS = {
    "mode", "category", "prompt_index", "source", "sampling", "concurrency", "wave", "token_ids", "wall_s",
    "tokens_per_s", "completion_tokens", "model", "dtype", "device", "cpu", "threads", "git_commit",
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable, "-m", "specmesh", "bench", "--categories", "code_edit", "--limit", "2", "--max-tokens", "16",
        "--modes", "plain,ngram,oracle,hf-greedy", "--concurrency", "1,2", "--out", str(out), "--corrupt", "ngram",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=cpu_only_env())
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    return proc, out, records


def test_every_request_of_every_mode_is_one_well_formed_record(tiny_run):
    _, _, records = tiny_run
    # 2 prompts x (plain, ngram, oracle, hf-greedy) at 1 stream + one wave of 2 x (plain, ngram, oracle)
    assert len(records) == 2 * 4 + 2 * 3
    for r in records:
        assert r.keys() >= FIELDS, FIELDS - r.keys()
        assert r["category"] == "code_edit" and r["source"]
        assert 0 < r["completion_tokens"] <= 16 and r["tokens_per_s"] > 0
    oracle = [r for r in records if r["mode"] == "oracle"]
    assert all(r["drafted"] > 0 and r["accepted"] == r["drafted"] for r in oracle), "the oracle is always right"


def test_a_corrupted_mode_is_flagged_as_a_losslessness_failure(tiny_run):
    proc, out, records = tiny_run
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "LOSSLESSNESS FAILURE" in proc.stderr
    assert "LOSSLESSNESS FAILURES" in (out / "summary.md").read_text()
    flagged = {r["mode"] for r in records if r.get("lossless") is False}
    assert flagged == {"ngram"}
    assert all(r["lossless"] for r in records if r["mode"] in ("oracle", "hf-greedy"))


def test_speedups_are_computed_from_plain_in_the_same_run(tiny_run):
    _, out, records = tiny_run
    rows = {(r["concurrency"], r["category"], r["mode"]): r for r in json.loads((out / "summary.json").read_text())}
    assert len({r["started"] for r in records}) == 1
    tps = {(r["mode"], r["prompt_index"]): r["tokens_per_s"] for r in records if r["concurrency"] == 1}
    expected = statistics.median(tps[("oracle", i)] / tps[("plain", i)] for i in (0, 1))
    assert rows[(1, "code_edit", "oracle")]["speedup"] == pytest.approx(expected)
    wave = {r["mode"]: r["wave_tokens_per_s"] for r in records if r["concurrency"] == 2}
    assert rows[(2, "code_edit", "oracle")]["speedup"] == pytest.approx(wave["oracle"] / wave["plain"])
    assert rows[(1, "code_edit", "oracle")]["efficiency"] == pytest.approx(1.0)


def test_plots_and_summary_are_written(tiny_run):
    _, out, _ = tiny_run
    for name in ("summary.md", "summary.json", "tokens_per_s.png", "accepted_length.png", "speedup_vs_concurrency.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "tokens_per_s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_router_statistics_are_kept_as_each_block_left_them(tiny_run):
    _, out, _ = tiny_run
    text = (out / "router_stats.txt").read_text()
    after_c1, after_c2 = text.split("# after greedy c=2\n")
    assert after_c1.startswith("# after greedy c=1\n")

    def ngram_served(block: str) -> tuple[float, list[float]]:
        row = next(r for r in block.split("stats {")[1:] if 'proposer: "ngram"' in r)
        values = [(k.strip(), float(v)) for k, v in (line.split(":") for line in row.splitlines() if ":" in line)
                  if k.strip() in ("served_steps", "served_steps_by_batch")]  # fmt: skip
        by_batch = [v for k, v in values if k == "served_steps_by_batch"]
        return next(v for k, v in values if k == "served_steps"), by_batch

    total, by_batch = ngram_served(after_c1)
    assert total > 0 and len(by_batch) == 1 and by_batch[0] == pytest.approx(total)  # 1-row steps only
    assert ngram_served(after_c2)[0] > total  # the block at 2 streams added its steps
