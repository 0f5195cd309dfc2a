"""``specmesh bench --tensor-parallel-size``: the flag → the local deployment, and the all-reduce
figures from the verifier's /metrics read before and after each run (hand-written expositions, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specmesh_bench.cli import local_deployment, parse_args, verifier_metrics_url
from specmesh_bench.report import markdown
from specmesh_bench.runner import BenchRunner, RunConfig
from specmesh_bench.verifier_metrics import DecodeTotals, VerifierMeter, decode_row, decode_totals
from specmesh_bench.workload import BenchPrompt


def exposition(decode: dict[str, tuple[int, float]], reduce: tuple[int, float] | None, prefill=(1, 9.0)) -> str:
    """/metrics text: decode steps (count, seconds) per batch label, the decode all-reduces, a prefill."""
    lines = ["# TYPE specmesh_step_seconds histogram"]
    rows = [("prefill", "1", *prefill)] + [("decode", b, n, s) for b, (n, s) in decode.items()]
    for phase, batch, n, s in rows:
        labels = f'phase="{phase}",batch="{batch}",model="m"'
        lines += [
            f'specmesh_step_seconds_bucket{{{labels},le="+Inf"}} {n}',
            f"specmesh_step_seconds_count{{{labels}}} {n}",
            f"specmesh_step_seconds_sum{{{labels}}} {s}",
        ]
    if reduce is not None:
        lines.append("# TYPE specmesh_tensor_parallel_all_reduce_seconds histogram")
        for phase, (n, s) in (("prefill", (1, 5.0)), ("decode", reduce)):
            labels = f'phase="{phase}",model="m"'
            lines += [
                f'specmesh_tensor_parallel_all_reduce_seconds_bucket{{{labels},le="+Inf"}} {n}',
                f"specmesh_tensor_parallel_all_reduce_seconds_count{{{labels}}} {n}",
                f"specmesh_tensor_parallel_all_reduce_seconds_sum{{{labels}}} {s}",
            ]
    lines.append("# TYPE specmesh_requests counter")
    lines.append('specmesh_requests_total{status="ok"} 3')
    return "\n".join(lines) + "\n"


def test_decode_totals_sum_every_batch_label_and_leave_prefill_out():
    t = decode_totals(exposition({"1": (10, 1.0), "2": (5, 1.5)}, reduce=(15, 0.5)))
    assert t == DecodeTotals(steps=15, step_seconds=2.5, all_reduce_seconds=0.5, all_reduce_steps=15)
    assert decode_totals(exposition({"1": (3, 0.3)}, reduce=None)).all_reduce_seconds == 0.0  # TP=1: none


def test_a_runs_figures_are_the_differences_before_and_after_it():
    before = decode_totals(exposition({"1": (10, 1.0)}, reduce=(10, 0.2)))
    after = decode_totals(exposition({"1": (30, 3.0), "2": (10, 2.0)}, reduce=(50, 1.7)))
    row = decode_row("greedy", 2, "ngram", after - before)
    assert row.decode_steps == 30
    assert row.decode_step_s == pytest.approx(4.0 / 30)  # (3 + 2 − 1) s over 30 steps
    assert row.all_reduce_s == pytest.approx(1.5 / 30)
    assert row.all_reduce_share == pytest.approx(1.5 / 4.0)
    e = decode_row("greedy", 1, "plain", DecodeTotals())
    assert (e.decode_steps, e.decode_step_s, e.all_reduce_s, e.all_reduce_share) == (0, None, None, None)


class FakeMeter(VerifierMeter):
    """Each read returns the next exposition, as the verifier's counters grow."""

    def __init__(self, texts: list[str]) -> None:
        super().__init__("http://unused/metrics")
        self.texts = iter(texts)

    def read(self) -> DecodeTotals:
        return decode_totals(next(self.texts))


class CountingTarget:
    name = "grpc"

    def request(self, prompt, mode, sampling, corpus, tag=False, scope=""):
        return {"token_ids": [1, 2], "text": "ab", "ttft_ms": 1.0, "itl_ms": [1.0], "mean_accepted_length": 1.0}


def test_the_runner_meters_each_mode_of_each_wave_and_sums_them_per_run():
    # 2 prompts at concurrency 1 → 2 waves of plain, then ngram, each mode read before and after: 8 readings
    totals = [(0, 0.0, 0.0), (4, 0.4, 0.1), (4, 0.4, 0.1), (6, 0.5, 0.15)]  # wave 0: 4 plain steps, 2 ngram
    totals += [(6, 0.5, 0.15), (10, 0.9, 0.25), (10, 0.9, 0.25), (11, 1.0, 0.27)]  # wave 1: 4 plain, 1 ngram
    texts = [exposition({"1": (n, s)}, reduce=(n, r)) for n, s, r in totals]
    meter = FakeMeter(texts)
    prompts = [BenchPrompt("qa", i, f"qa{i}", "", "", (1, 2, 3), 1) for i in range(2)]
    runner = BenchRunner(RunConfig(modes=("plain", "ngram")), [CountingTarget()], None, None, meter=meter.wave)
    list(runner.run(prompts))
    rows = {r.mode: r for r in meter.rows()}
    assert (rows["plain"].decode_steps, rows["ngram"].decode_steps) == (8, 3)
    assert rows["plain"].all_reduce_s == pytest.approx(0.2 / 8)
    assert rows["ngram"].decode_step_s == pytest.approx(0.2 / 3)
    assert rows["ngram"].all_reduce_share == pytest.approx(0.07 / 0.2)


def test_the_flag_shards_the_verifier_splits_the_threads_and_every_local_verifier_gets_a_metrics_port():
    a = parse_args(["--modes", "plain", "--tensor-parallel-size", "2", "--threads", "4"])
    cfg = local_deployment(a, ["plain"], "m", "127.0.0.1:1", Path("/tmp/run"))
    assert (cfg.tensor_parallel_size, cfg.verifier_threads) == (2, 2)
    assert verifier_metrics_url(cfg).startswith("http://127.0.0.1:")
    a = parse_args(["--modes", "plain", "--tensor-parallel-size", "4", "--threads", "2"])
    assert local_deployment(a, ["plain"], "m", "o", Path("/tmp/run")).verifier_threads == 1  # at least one
    one = local_deployment(parse_args(["--modes", "plain"]), ["plain"], "m", "o", Path("/tmp/run"))
    assert (one.tensor_parallel_size, one.verifier_threads) == (1, 2)
    assert verifier_metrics_url(one).startswith("http://127.0.0.1:"), "decode steps are read at TP=1 too"


def test_a_metrics_port_given_as_a_verifier_arg_is_the_one_read():
    a = parse_args(["--modes", "plain", "--tensor-parallel-size", "2", "--verifier-arg=--metrics-port=9123"])
    cfg = local_deployment(a, ["plain"], "m", "o", Path("/tmp/run"))
    assert verifier_metrics_url(cfg) == "http://127.0.0.1:9123/metrics"
    assert cfg.extra_verifier_args.count("--metrics-port") == 0


def test_the_flag_is_refused_with_a_target(capsys):
    for target in ("127.0.0.1:50051", "http://127.0.0.1:8000/v1"):
        with pytest.raises(SystemExit) as exc:
            parse_args(["--target", target, "--tensor-parallel-size", "2"])
        assert exc.value.code == 2
        assert "--tensor-parallel-size configures the local deployment" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--tensor-parallel-size", "0"])


def test_the_summary_states_the_layout_and_adds_the_decode_table_where_given_all_reduces_only_under_tp():
    meta = {"model": "m", "dtype": "float32", "device": "cpu", "threads": 2}
    steps = [
        decode_row("greedy", 1, "plain", DecodeTotals(10, 0.5, 0.1, 10)),
        decode_row("greedy", 1, "suffix", DecodeTotals(5, 0.4, 0.1, 5)),
    ]
    tp2 = markdown([], {**meta, "tensor_parallel_size": 2, "verifier_threads": 1}, {}, [], decode=steps)
    assert "TP=2, 1 torch thread per rank" in tp2
    assert "| greedy | 1 | plain | 10 | 50.0 | 1.00x | 10.00 | 20% |" in tp2
    assert "| greedy | 1 | suffix | 5 | 80.0 | 1.60x | 20.00 | 25% |" in tp2, "a speculative step against a plain one"
    tp1 = markdown([], {**meta, "tensor_parallel_size": 1, "verifier_threads": 2}, {}, [], decode=steps)
    assert "TP=1, 2 torch threads" in tp1 and "all-reduce" not in tp1
    assert "| greedy | 1 | suffix | 5 | 80.0 | 1.60x |" in tp1
    assert "Decode steps" not in markdown([], {**meta, "tensor_parallel_size": 1, "verifier_threads": 2}, {}, [])
