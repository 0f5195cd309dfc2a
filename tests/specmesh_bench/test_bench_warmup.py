"""The warm-cache protocol and multi-turn rows of ``specmesh bench``, without a deployment: the dev
workload's split, the refusal of a warm-up that overlaps the measured prompts, cache scopes and the
order of warm-ups, first answers and second turns in the runner, and the suffix-vs-ngram report line."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from specmesh_bench.cli import parse_args
from specmesh_bench.report import OVERALL, markdown, mode_intervals, mode_ratios, summarize
from specmesh_bench.runner import BenchRunner, RunConfig, cache_scope, mixed
from specmesh_bench.workload import (
    DEFAULT_WORKLOAD,
    DEV_MEASURED,
    DEV_WARMUP,
    BenchPrompt,
    load_prompts,
    read_rows,
    second_turns,
    split_rows,
    warmup_conflicts,
    write_dev_split,
)

ROOT = Path(__file__).resolve().parents[2]  # the repository


def fake_encode(text: str) -> list[int]:
    return [len(text)]


def fake_template(msgs: list[dict[str, str]]) -> list[int]:
    """A stand-in chat template: one token per message, its role and length."""
    return [hash((m["role"], m["content"])) % 1000 for m in msgs]


# --- the dev workload's split


def test_the_checked_in_split_is_what_the_generator_makes_of_the_dev_workload(tmp_path):
    write_dev_split(DEFAULT_WORKLOAD, tmp_path / "w.jsonl", tmp_path / "m.jsonl")
    assert (tmp_path / "w.jsonl").read_bytes() == DEV_WARMUP.read_bytes(), (
        "regenerate: python -m specmesh_bench.workload"
    )
    assert (tmp_path / "m.jsonl").read_bytes() == DEV_MEASURED.read_bytes()
    warm, measured = read_rows(DEV_WARMUP), read_rows(DEV_MEASURED)
    assert (warm, measured) == split_rows(read_rows(DEFAULT_WORKLOAD))


def test_the_halves_share_no_row_id_and_no_turn_and_split_every_category_evenly():
    dev, warm, measured = read_rows(DEFAULT_WORKLOAD), read_rows(DEV_WARMUP), read_rows(DEV_MEASURED)
    assert not {r["id"] for r in warm} & {r["id"] for r in measured}
    assert not {t for r in warm for t in r["turns"]} & {t for r in measured for t in r["turns"]}
    assert sorted(r["id"] for r in warm + measured) == sorted(r["id"] for r in dev)
    for cat in {r["category"] for r in dev}:
        n = sum(r["category"] == cat for r in dev)
        assert sum(r["category"] == cat for r in measured) == sum(r["category"] == cat for r in warm) == n // 2
    assert all(r["source"] for r in warm + measured), "attribution is kept"
    assert all(len(r["turns"]) == 2 for r in measured if r["category"] == "mt_bench")


# --- the warm-up may not see the measured prompts


def test_a_warm_up_that_shares_measured_prompts_is_refused():
    measured = load_prompts(DEV_MEASURED, None, 2, fake_encode)
    assert warmup_conflicts(load_prompts(DEV_WARMUP, None, None, fake_encode), measured) is None
    same_file = load_prompts(DEV_MEASURED, ["qa"], 3, fake_encode)
    assert "row id" in warmup_conflicts(same_file, measured)
    dev = load_prompts(DEFAULT_WORKLOAD, None, 1, fake_encode)  # the dev file's first rows are measured ones
    assert "shares" in warmup_conflicts(dev, measured)


def test_a_copied_prompt_under_another_id_is_refused_too(tmp_path):
    rows = read_rows(DEV_MEASURED)[:1]
    copy = tmp_path / "copy.jsonl"
    copy.write_text(json.dumps({**rows[0], "id": "renamed"}) + "\n")
    why = warmup_conflicts(
        load_prompts(copy, None, None, fake_encode), load_prompts(DEV_MEASURED, None, 1, fake_encode)
    )
    assert why is not None and "prompt text" in why


@pytest.mark.slow  # loads the tokenizer (transformers), ~5-15 s
def test_the_bench_refuses_an_overlapping_warm_up_before_starting_anything(tmp_path):
    cmd = [
        sys.executable, "-m", "specmesh", "bench", "--workload", str(DEV_MEASURED), "--warmup-workload",
        str(DEFAULT_WORKLOAD), "--limit", "1", "--warmup-limit", "1", "--modes", "plain,suffix", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--warmup-workload" in proc.stderr and "shares" in proc.stderr
    assert "starting the local deployment" not in proc.stderr


def test_warm_up_flags():
    a = parse_args(["--warmup-workload", str(DEV_WARMUP), "--warmup-limit", "3"])
    assert (a.warmup_workload, a.warmup_limit, a.turns) == (DEV_WARMUP, 3, 2)
    assert parse_args(["--turns", "1"]).turns == 1
    assert "suffix" in parse_args([]).modes.split(",")
    for bad in (["--warmup-limit", "3"], ["--warmup-workload", "w", "--warmup-limit", "0"], ["--turns", "3"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# --- the runner: scopes, warm-ups, first answers, second turns


class FakeTarget:
    """Logs every request (mode, row id, scope, greedy?, max_tokens) in order."""

    def __init__(self, name: str = "grpc") -> None:
        self.name, self.log, self._lock = name, [], threading.Lock()

    def request(self, prompt, mode, sampling, corpus, tag=False, scope="") -> dict:
        with self._lock:
            self.log.append((mode, prompt.row_id, scope, sampling.temperature == 0.0, sampling.max_tokens))
        ids = [1, 2, 3]
        return {"transport": self.name, "token_ids": ids, "text": f"answer to {prompt.row_id}", "wall_s": 1.0,
                "ttft_ms": 1.0, "itl_ms": [1.0], "mean_accepted_length": 1.0, "drafted": 0, "accepted": 0}  # fmt: skip


def prompt(cat: str, i: int, turns: tuple[str, ...] = ("x",)) -> BenchPrompt:
    text = f"{cat}{i}: {turns[0]}"
    return BenchPrompt(cat, i, f"{cat}-{i}", "src", text, (i,), turns=(text, *turns[1:]))


WARMUP = [prompt("w", i) for i in range(3)]
MODES = ("plain", "ngram", "suffix", "auto")


def test_scopes_are_per_run_of_a_mode_and_random_per_invocation():
    assert cache_scope("t", "suffix", "greedy", 1) != cache_scope("t", "suffix", "greedy", 8)
    assert cache_scope("t", "auto", "greedy", 1) != cache_scope("t", "suffix", "greedy", 1)
    assert cache_scope("t", "plain", "greedy", 1) != cache_scope("t", "ngram", "greedy", 1)
    assert cache_scope("t", "plain", "greedy", 1) != cache_scope("u", "plain", "greedy", 1)
    config = RunConfig(modes=MODES, concurrency=(1, 8), samplings=("greedy", "sampled"))
    a, b = BenchRunner(config, [FakeTarget()], None, None), BenchRunner(config, [FakeTarget()], None, None)
    assert a.run_token != b.run_token
    assert len(set(a.scopes())) == len(a.scopes()) == 2 * 2 * 2  # warmed: suffix, auto x concurrency x sampling
    assert not set(a.scopes()) & set(b.scopes())
    two = BenchRunner(config, [FakeTarget("http"), FakeTarget("grpc")], None, None, run_token="t")
    assert len(set(two.scopes())) == 16 and "bench-t-suffix-greedy-c1-http" in two.scopes()


@pytest.mark.parametrize("mix", [False, True])
def test_each_scope_is_warmed_once_before_its_first_measured_request(mix):
    target = FakeTarget()
    prompts = [prompt("code", 0), prompt("code", 1), prompt("qa", 0)]
    config = RunConfig(modes=MODES, concurrency=(1, 2), max_tokens=7, samplings=("greedy", "sampled"), mix=mix)
    runner = BenchRunner(config, [target], None, None, warmup=WARMUP, run_token="tok", log=lambda _: None)
    records = list(runner.run(prompts))
    assert len(records) == runner.planned_requests(prompts), "warm-ups are not records"
    warm_ids = {p.row_id for p in WARMUP}
    assert not any(r["row_id"] in warm_ids for r in records)
    assert runner.warmed == runner.scopes()
    log = target.log
    for scope in runner.scopes():
        warm = [i for i, (_, row, s, *_) in enumerate(log) if s == scope and row in warm_ids]
        measured = [i for i, (_, row, s, *_) in enumerate(log) if s.startswith(scope) and row not in warm_ids]
        assert len(warm) == len(WARMUP), scope
        assert measured and max(warm) < min(measured), f"{scope} measured before its warm-up ended"
        mode = scope.split("-")[2]
        assert {(m, g, n) for m, row, s, g, n in log if s == scope and row in warm_ids} == {(mode, True, 7)}
    learn_nothing = [row for m, row, *_ in log if m in ("plain", "ngram")]
    assert not set(learn_nothing) & warm_ids, "modes that learn nothing: no warm-up"
    assert all(s for m, row, s, *_ in log)
    for r in records:
        assert r["cache_scope"].startswith(cache_scope("tok", r["mode"], r["sampling"], r["concurrency"]))


def test_a_prompt_repeated_to_fill_a_wave_gets_a_cold_scope_of_its_own_in_every_mode():
    """Plain would otherwise read the repeat's prompt KV from the prefix cache while suffix prefills it
    cold: a wave's speed-up must compare decoding alone."""
    target = FakeTarget()
    config = RunConfig(modes=("plain", "suffix"), concurrency=(3,))
    runner = BenchRunner(config, [target], None, None, run_token="tok")
    records = list(runner.run([prompt("qa", 0), prompt("qa", 1)]))  # a wave of 3: qa-0, qa-1, qa-0 again
    for mode in ("plain", "suffix"):
        scopes = sorted(r["cache_scope"] for r in records if r["mode"] == mode)
        base = f"bench-tok-{mode}-greedy-c3"
        assert scopes == [base, base, f"{base}-repeat1"]


def test_second_turns_continue_the_models_own_first_answer_after_every_first_turn():
    target = FakeTarget()
    config = RunConfig(modes=("plain", "suffix"), concurrency=(1, 2), max_tokens=9, mix=True)
    runner = BenchRunner(config, [target], None, None, run_token="tok", log=lambda _: None)
    firsts = [prompt("mt_bench", 0, ("a", "b")), prompt("qa", 0), prompt("mt_bench", 1, ("c", "d"))]
    answers = runner.first_answers(firsts)
    assert answers == {"mt_bench-0": "answer to mt_bench-0", "mt_bench-1": "answer to mt_bench-1"}
    assert {(m, s, g, n) for m, _, s, g, n in target.log} == {("plain", "bench-tok-answers", True, 9)}
    seconds = second_turns(firsts, answers, fake_template)
    assert [(p.row_id, p.index, p.turn, p.text) for p in seconds] == [
        ("mt_bench-0#2", 2, 2, "b"),
        ("mt_bench-1#2", 3, 2, "d"),
    ]
    chat = [("user", firsts[0].text), ("assistant", "answer to mt_bench-0"), ("user", "b")]
    assert seconds[0].token_ids == tuple(fake_template([{"role": r, "content": c} for r, c in chat]))
    prompts = firsts + seconds
    assert [p.row_id for p in mixed(prompts)][-2:] == ["mt_bench-0#2", "mt_bench-1#2"]
    target.log.clear()
    records = list(runner.run(prompts))
    for c in (1, 2):
        order = [r["row_id"] for r in records if r["concurrency"] == c and r["mode"] == "plain"]
        last_first = max(i for i, row in enumerate(order) if "#" not in row)
        assert min(i for i, row in enumerate(order) if "#" in row) > last_first, "every turn 2 after every turn 1"
    assert {(r["row_id"], r["turn"]) for r in records if r["category"] == "mt_bench"} == {
        ("mt_bench-0", 1), ("mt_bench-1", 1), ("mt_bench-0#2", 2), ("mt_bench-1#2", 2)
    }  # fmt: skip


# --- the report


def rec(mode: str, cat: str, idx: int, tps: float, turn: int = 1) -> dict:
    return {"mode": mode, "category": cat, "prompt_index": idx, "sampling": "greedy", "concurrency": 1, "wave": idx,
            "tokens_per_s": tps, "turn": turn, "ttft_ms": 1.0, "itl_ms": [1.0], "mean_accepted_length": 1.0,
            "drafted": 0, "accepted": 0}  # fmt: skip


def test_the_summary_sets_suffix_against_ngram_overall_and_per_category():
    records = [
        *[rec("plain", c, i, 10.0, t) for c, i, t in (("qa", 0, 1), ("mt_bench", 0, 1), ("mt_bench", 1, 2))],
        *[rec("ngram", c, i, 20.0, t) for c, i, t in (("qa", 0, 1), ("mt_bench", 0, 1), ("mt_bench", 1, 2))],
        rec("suffix", "qa", 0, 20.0),
        rec("suffix", "mt_bench", 0, 40.0),
        rec("suffix", "mt_bench", 1, 80.0, turn=2),
    ]
    ratios = mode_ratios(records, "suffix", "ngram")[("greedy", 1)]
    assert ratios[OVERALL] == pytest.approx((1.0 * 3.0) ** 0.5)  # qa 1x; mt_bench median(2x, 4x) = 3x
    assert (ratios["qa"], ratios["mt_bench"], ratios["mt_bench turn 2"]) == pytest.approx((1.0, 3.0, 4.0))
    assert mode_ratios(records, "suffix", "draft") == {}
    meta = {"warmup_workload": "workloads/specbench_dev_warmup.jsonl", "warmup_limit": None, "warmup_prompts": 160,
            "warmup_scopes": ["bench-t-suffix-greedy-c1"], "turns": 2}  # fmt: skip
    text = markdown(
        summarize(records), meta, {}, [], None, {("suffix", "ngram"): mode_ratios(records, "suffix", "ngram")}
    )
    assert (
        "suffix vs ngram (tokens/s, paired): **1.73x** overall; qa 1.00x, mt_bench 3.00x, mt_bench turn 2 4.00x" in text
    )
    assert "Warm-up: 160 prompts of workloads/specbench_dev_warmup.jsonl (all per category)" in text
    assert "`bench-t-suffix-greedy-c1`" in text
    assert "| category | plain | ngram | suffix |" in text


def test_auto_against_a_fixed_proposer_gets_an_interval_that_holds_the_figure_and_widens_with_noise():
    calm = [rec("suffix", c, i, 10.0) for c in ("qa", "code") for i in range(4)]
    calm += [rec("auto", c, i, tps) for c in ("qa", "code") for i, tps in enumerate((9.9, 10.0, 10.1, 10.0))]
    noisy = [r | {"tokens_per_s": r["tokens_per_s"] * (0.8 if r["prompt_index"] % 2 else 1.25)} for r in calm]
    noisy = [r if r["mode"] == "auto" else dict(r, tokens_per_s=10.0) for r in noisy]
    figure = mode_ratios(calm, "auto", "suffix")[("greedy", 1)][OVERALL]
    tight, wide = (
        mode_intervals(calm, "auto", "suffix")[("greedy", 1)],
        mode_intervals(noisy, "auto", "suffix")[("greedy", 1)],
    )
    assert tight.low <= figure <= tight.high and tight.units == 8
    assert mode_intervals([r for r in calm if r["prompt_index"] == 0], "auto", "suffix") == {}  # one unit each
    assert wide.high - wide.low > 5 * (tight.high - tight.low)
    text = markdown(
        summarize(calm), {}, {}, [], None, {("auto", "suffix"): mode_ratios(calm, "auto", "suffix")},
        {("auto", "suffix"): mode_intervals(calm, "auto", "suffix")},
    )  # fmt: skip
    assert f"auto vs suffix (tokens/s, paired): **1.00x** overall (95% bootstrap interval {tight.low:.2f}–" in text
