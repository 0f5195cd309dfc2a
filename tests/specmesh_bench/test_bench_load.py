"""How ``specmesh bench`` loads the target at concurrency > 1, without a deployment: waves of c
requests sent together, or continuous load (c streams kept busy, a finished one taking the next
prompt at once)."""

from __future__ import annotations

import threading
import time

import pytest

from specmesh_bench.cli import parse_args
from specmesh_bench.runner import BenchRunner, RunConfig
from specmesh_bench.workload import BenchPrompt


class TimedTarget:
    """Answers after ``slow_s`` for prompts named in ``slow``, else ``fast_s``; logs (mode, row id,
    start, end) and the most requests it ever had in flight."""

    def __init__(self, slow: set[str], slow_s: float = 0.4, fast_s: float = 0.02) -> None:
        self.name, self.slow, self.slow_s, self.fast_s = "grpc", slow, slow_s, fast_s
        self.log: list[tuple[str, str, float, float]] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()

    def request(self, prompt, mode, sampling, corpus, tag=False, scope="") -> dict:
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        start = time.perf_counter()
        time.sleep(self.slow_s if prompt.row_id in self.slow else self.fast_s)
        end = time.perf_counter()
        with self._lock:
            self.in_flight -= 1
            self.log.append((mode, prompt.row_id, start, end))
        return {"transport": self.name, "token_ids": [1, 2, 3], "text": "x", "wall_s": end - start,
                "ttft_ms": 1.0, "itl_ms": [1.0], "mean_accepted_length": 1.0, "drafted": 0, "accepted": 0}  # fmt: skip


def prompts(n: int) -> list[BenchPrompt]:
    return [BenchPrompt("qa", i, f"qa-{i}", "src", f"q{i}", (i,), turns=(f"q{i}",)) for i in range(n)]


def run(load: str, target: TimedTarget, n: int = 6, c: int = 2) -> list[dict]:
    config = RunConfig(modes=("plain",), concurrency=(c,), mix=True, load=load)
    return list(BenchRunner(config, [target], None, None, log=lambda _: None).run(prompts(n)))


def test_continuous_load_keeps_c_streams_busy_so_fast_requests_do_not_wait_for_a_slow_one():
    target = TimedTarget(slow={"qa-0"})
    records = run("continuous", target)
    assert sorted(r["row_id"] for r in records) == [f"qa-{i}" for i in range(6)], "each prompt once, none repeated"
    assert target.most_in_flight == 2
    slow_end = next(end for _, row, _, end in target.log if row == "qa-0")
    assert all(end < slow_end for _, row, _, end in target.log if row != "qa-0"), (
        "the other stream served every other prompt while the slow one ran"
    )
    assert len({r["wave"] for r in records}) == 1 and len({r["wave_tokens_per_s"] for r in records}) == 1


def test_waves_send_c_requests_together_and_the_next_wave_waits_for_the_slowest():
    target = TimedTarget(slow={"qa-0"})
    records = run("waves", target)
    assert len({r["wave"] for r in records}) == 3
    slow_end = next(end for _, row, _, end in target.log if row == "qa-0")
    second_wave = [start for _, row, start, _ in target.log if row in ("qa-2", "qa-3")]
    assert min(second_wave) >= slow_end


def test_the_load_flag_defaults_to_waves_and_takes_continuous():
    assert parse_args([]).load == "waves"
    assert parse_args(["--load", "continuous", "--concurrency", "8"]).load == "continuous"


def test_under_continuous_load_a_mode_s_speed_up_pools_its_waves_by_time_not_a_median_of_waves():
    from specmesh_bench.report import OVERALL, summarize

    def wave(mode: str, w: int, tokens: int, wave_tps: float, n: int) -> list[dict]:
        return [
            {"mode": mode, "category": "qa", "group": "mix", "prompt_index": j, "sampling": "greedy",
             "concurrency": 8, "load": "continuous", "wave": w, "slot": j, "completion_tokens": tokens // n,
             "tokens_per_s": 1.0, "wave_tokens_per_s": wave_tps, "ttft_ms": 1.0, "itl_ms": [1.0],
             "mean_accepted_length": 1.0, "drafted": 0, "accepted": 0}
            for j in range(n)
        ]  # fmt: skip

    # 32 first turns: 10 s in both modes; 4 second turns: 2 s plain, 1 s ngram.
    records = [
        *wave("plain", 0, 320, 32.0, 32), *wave("plain", 1, 40, 20.0, 4),
        *wave("ngram", 0, 320, 32.0, 32), *wave("ngram", 1, 40, 40.0, 4),
    ]  # fmt: skip
    rows = {(r.category, r.mode): r for r in summarize(records)}
    assert rows[("mix", "ngram")].speedup == pytest.approx(12 / 11), "not (1.0 + 2.0) / 2"
    assert rows[("mix", "plain")].tokens_per_s == pytest.approx(360 / 12)
    assert rows[(OVERALL, "ngram")].speedup == pytest.approx(12 / 11)
