"""The benchmark's arithmetic on hand-made records: pairing, best-of-sweep, oracle efficiency."""

from __future__ import annotations

import math

import pytest

from specmesh_bench.report import OVERALL, losslessness_failures, markdown, pipeline_overhead, summarize


def rec(mode: str, cat: str, idx: int, tps: float, **kw) -> dict:
    base = {
        "mode": mode,
        "category": cat,
        "prompt_index": idx,
        "sampling": "greedy",
        "concurrency": 1,
        "wave": idx,
        "tokens_per_s": tps,
        "token_ids": [1, 2, 3],
    }
    if not mode.startswith("hf-"):
        base.update(ttft_ms=100.0, itl_ms=[10.0, 20.0], mean_accepted_length=1.0, drafted=0, accepted=0)
    return {**base, **kw}


def test_speedup_is_the_median_of_per_prompt_ratios_against_plain_in_the_same_run():
    records = [
        rec("plain", "code", 0, 10.0),
        rec("plain", "code", 1, 20.0),
        rec("plain", "code", 2, 40.0),
        # per prompt: 3x, 1x, 2x → median 2x (a ratio of medians would say 30/20 = 1.5x)
        rec("ngram", "code", 0, 30.0, lossless=True),
        rec("ngram", "code", 1, 20.0, lossless=True),
        rec("ngram", "code", 2, 80.0, lossless=True),
    ]
    rows = {(r.category, r.mode): r for r in summarize(records)}
    assert rows[("code", "ngram")].speedup == pytest.approx(2.0)
    assert rows[("code", "ngram")].tokens_per_s == pytest.approx(30.0)
    assert rows[("code", "plain")].speedup == pytest.approx(1.0)


def test_overall_is_the_geometric_mean_over_categories_and_efficiency_divides_by_the_oracle():
    records = [
        rec("plain", "a", 0, 10.0),
        rec("ngram", "a", 0, 40.0),
        rec("oracle", "a", 0, 80.0),
        rec("plain", "b", 0, 10.0),
        rec("ngram", "b", 0, 10.0),
        rec("oracle", "b", 0, 20.0),
    ]
    rows = {(r.category, r.mode): r for r in summarize(records)}
    assert rows[(OVERALL, "ngram")].speedup == pytest.approx(math.sqrt(4.0 * 1.0))
    assert rows[("a", "ngram")].efficiency == pytest.approx(0.5)
    assert rows[("b", "ngram")].efficiency == pytest.approx(0.5)


def test_hf_prompt_lookup_counts_as_its_best_lookup_length_per_category():
    records = [
        rec("plain", "a", 0, 10.0),
        rec("hf-pld", "a", 0, 12.0, pld_k=3),
        rec("hf-pld", "a", 0, 25.0, pld_k=10),
        rec("ngram", "a", 0, 20.0),
    ]
    rows = {(r.category, r.mode): r for r in summarize(records)}
    assert rows[("a", "hf-pld")].pld_k == 10
    assert rows[("a", "hf-pld")].speedup == pytest.approx(2.5)
    assert rows[("a", "ngram")].vs_hf_pld == pytest.approx(0.8)


def test_waves_pair_by_wave_at_concurrency_above_one():
    def wave(mode: str, w: int, agg: float) -> list[dict]:
        return [rec(mode, "a", j, agg / 4, concurrency=4, wave=w, slot=j, wave_tokens_per_s=agg) for j in range(4)]

    records = wave("plain", 0, 40.0) + wave("ngram", 0, 60.0) + wave("plain", 1, 20.0) + wave("ngram", 1, 40.0)
    rows = {(r.category, r.mode): r for r in summarize(records)}
    assert rows[("a", "ngram")].speedup == pytest.approx((1.5 + 2.0) / 2)
    assert rows[("a", "ngram")].tokens_per_s == pytest.approx(50.0)


def test_pipeline_overhead_compares_service_with_in_process_ngram():
    records = [rec("ngram", "a", 0, 19.0), rec("ngram-local", "a", 0, 20.0)]
    assert pipeline_overhead(records)[("greedy", 1)] == pytest.approx(0.05)


def test_a_mismatching_mode_is_reported_as_a_losslessness_failure_not_a_speed():
    records = [rec("plain", "a", 0, 10.0), rec("ngram", "a", 0, 50.0, lossless=False, mismatch_at=7)]
    failures = losslessness_failures(records)
    assert failures == ["ngram on a[0] (concurrency 1, wave 0): first differing token at 7"]
    rows = summarize(records)
    text = markdown(rows, {"cpu": "x"}, {}, failures)
    assert "LOSSLESSNESS FAILURES" in text
    assert "| ngram | 5.00x |" in text and "**NO**" in text


def test_the_speed_up_after_the_first_token_pairs_requests_and_the_time_before_it_is_a_share():
    def timed(mode: str, idx: int, wall: float, ttft_ms: float) -> dict:
        return rec(mode, "code", idx, 64 / wall, wall_s=wall, ttft_ms=ttft_ms, completion_tokens=65)

    records = [  # the same 64 tokens after a first token that takes 1 s (prompt 0) and 0.5 s (prompt 1)
        timed("plain", 0, 3.0, 1000.0),  # 2 s after the first token
        timed("plain", 1, 1.5, 500.0),  # 1 s
        timed("ngram", 0, 2.0, 1000.0),  # 1 s: 2x after the first token, 1.5x end to end
        timed("ngram", 1, 1.0, 500.0),  # 0.5 s: 2x
    ]
    rows = {(r.category, r.mode): r for r in summarize(records)}
    assert rows[("code", "ngram")].after_first_speedup == pytest.approx(2.0)
    assert rows[("code", "ngram")].speedup == pytest.approx(1.5)
    assert rows[("code", "plain")].before_first_share == pytest.approx(1.5 / 4.5)
    assert rows[(OVERALL, "ngram")].after_first_speedup == pytest.approx(2.0)
    assert rows[(OVERALL, "ngram")].before_first_share == pytest.approx(0.5)
    table = markdown(summarize(records), {}, {}, [])
    assert "| ngram | 1.50x | 2.00x |" in table


def test_waves_have_no_speed_up_after_the_first_token():
    records = [
        rec("plain", "code", 0, 10.0, concurrency=8, wave_tokens_per_s=10.0, wall_s=2.0),
        rec("ngram", "code", 0, 20.0, concurrency=8, wave_tokens_per_s=20.0, wall_s=1.0),
    ]
    rows = {(r.category, r.mode): r for r in summarize(records)}
    assert rows[("code", "ngram")].after_first_speedup is None and rows[("code", "ngram")].before_first_share is None
