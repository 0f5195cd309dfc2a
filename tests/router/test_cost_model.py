"""The step-cost model: a measured (rows, width) table, corrected by live step timings."""

from __future__ import annotations

import itertools
import random
import threading
from dataclasses import replace

from specmesh_router.cost_model import ContextCost, LiveStepCost, StepCost, choose_width, choose_widths, hull_steps
from specmesh_router.estimate import expected_accepted

# Shaped like this CPU's start-up table (ms): one row's cost rises slowly with width, eight rows' fast.
TABLE = StepCost(
    (1, 2, 4, 8),
    (1, 2, 4, 8, 16, 32, 64),
    (
        (31.3, 32.0, 43.4, 52.7, 57.4, 70.0, 104.5),
        (34.6, 43.8, 52.2, 55.7, 68.5, 102.7, 155.1),
        (47.7, 55.2, 58.4, 70.2, 105.2, 149.1),
        (56.9, 56.9, 69.6, 102.5, 152.9),
    ),
)


def test_table_is_exact_at_measured_points_and_never_falls_with_more_rows_or_tokens():
    assert TABLE(8, 4) == 69.6 and TABLE(1, 64) == 104.5
    for rows in range(1, 17):
        costs = [TABLE(rows, w) for w in range(1, 65)]
        assert costs == sorted(costs), rows
    for w in range(1, 65):
        costs = [TABLE(r, w) for r in range(1, 17)]
        assert costs == sorted(costs), w
    assert TABLE(8, 32) > TABLE(8, 16)  # past the measured widths: extrapolated, still rising


def test_live_cost_learns_a_slower_cell_and_leaves_a_measured_fast_one_alone():
    live = LiveStepCost(TABLE, smoothing=0.2, min_samples=4)
    assert live(8, 4) == TABLE(8, 4)  # nothing observed: the start-up table
    for _ in range(50):
        live.observe(8, 1, 2.0 * TABLE(8, 1))  # a long context makes 8-row plain steps twice as dear
        live.observe(1, 8, TABLE(1, 8))  # one-row wide steps as measured
    assert abs(live.ratio(8, 1) - 2.0) < 0.01
    assert abs(live.ratio(1, 8) - 1.0) < 0.01
    assert 1.0 < live.ratio(8, 4) < 2.0  # unobserved cell: the overall ratio


def test_speculation_at_eight_rows_stops_once_live_steps_show_wide_ones_are_dear():
    expected = [[0.0, 0.5, 0.8, 1.0]] * 8  # 8 rows, each expecting ~1 accepted token at width 4
    live = LiveStepCost(TABLE, smoothing=0.3, min_samples=3)
    assert choose_width(expected, live) > 1  # the table alone says speculation pays
    for _ in range(20):
        live.observe(8, 1, TABLE(8, 1))
        for w in (2, 3, 4):
            live.observe(8, w, 2.5 * TABLE(8, w))  # but wide steps really take 2.5x
    assert choose_width(expected, live) == 1


def test_concurrent_observers_and_readers_never_see_a_broken_value():
    live = LiveStepCost(TABLE, smoothing=0.1, min_samples=1)
    errors: list[float] = []

    def write() -> None:
        for i in range(2000):
            live.observe(1 + i % 8, 1 + i % 16, 1.5 * TABLE(1 + i % 8, 1 + i % 16))

    def read() -> None:
        for i in range(2000):
            ratio = live(1 + i % 8, 1 + i % 16) / TABLE(1 + i % 8, 1 + i % 16)
            if not 0.99 <= ratio <= 1.51:
                errors.append(ratio)

    threads = [threading.Thread(target=f) for f in (write, write, read, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert abs(live.ratio(4, 4) - 1.5) < 1e-6


def _curve(rng: random.Random, nodes: int) -> list[float]:
    """E(w) for w = 1..nodes + 1: a chain's Σ Π α, with flat steps where a sibling adds nothing at once."""
    out, reach = [0.0], 1.0
    for _ in range(nodes):
        if rng.random() < 0.3:
            out.append(out[-1])  # a sibling: pays only with the node below it
        else:
            reach *= rng.uniform(0.2, 0.95)
            out.append(out[-1] + reach)
    return out


def _packed_goodput(curves: list[list[float]], widths: tuple[int, ...] | list[int]) -> float:
    rows = len(curves)
    return sum(1 + e[w - 1] for e, w in zip(curves, widths, strict=True)) / TABLE(rows, sum(widths) / rows)


def test_packed_widths_come_within_3_percent_of_the_best_batch_and_never_lose_to_one_shared_width():
    rng = random.Random(3)
    for _ in range(60):
        rows = rng.choice([2, 4])
        curves = [_curve(rng, rng.randint(0, 6)) for _ in range(rows)]
        best = max(
            _packed_goodput(curves, ws) for ws in itertools.product(*[range(1, len(e) + 1) for e in curves])
        )  # brute force over every row's every cut
        got = _packed_goodput(curves, choose_widths(curves, TABLE, packed=True))
        shared = choose_widths(curves, TABLE, packed=False)
        padded_cost_choice = [min(w, len(e)) for w, e in zip(shared, curves, strict=True)]
        assert got >= 0.97 * best
        assert got >= 0.98 * _packed_goodput(curves, padded_cost_choice)


def test_at_eight_rows_packed_steps_verify_the_one_good_tree_that_padded_steps_must_cut():
    good = [0.0, 0.9, 1.7, 2.4, 3.0, 3.5, 3.9, 4.2]  # a request copying its prompt
    curves = [good] + [[0.0, 0.1, 0.15]] * 7  # seven rows whose trees rarely pay
    assert choose_width(curves, TABLE) <= 2  # padded: all eight rows would pay for the widest
    widths = choose_widths(curves, TABLE, packed=True)
    assert widths[0] > 4 and widths[1:] == [1] * 7
    assert [w for w, _ in hull_steps(good)] == [2, 3, 4, 5, 6, 7, 8]  # concave already: node by node


# As measured on the 2-core EPYC (ms per cached key past the table's 128): every row reads the
# batch's longest context, every query of the padded layout (rows × widest) attends to all of it.
LONG = replace(TABLE, context=ContextCost(128, 3.4e-3, 0.6e-3))


def test_a_long_context_prices_every_row_at_the_widest_rows_width():
    assert LONG(8, 4) == TABLE(8, 4) and LONG(8, 4, context=128) == TABLE(8, 4)  # the table's own context
    plain, wide = LONG(8, 1, context=2728), LONG(8, 2, widest=9, context=2728)  # one row of 9, seven of 1
    assert plain == TABLE(8, 1) + 2600 * 8 * 4.0e-3
    assert wide - TABLE(8, 2) == 2600 * 8 * (3.4e-3 + 9 * 0.6e-3)  # attention as if all rows were 9 wide


def test_the_gate_keeps_one_row_from_widening_the_whole_batchs_attention_at_a_long_context():
    strong = expected_accepted([0.8] * 15)  # one row's chain that pays for its nodes on its own
    rows = [strong] + [[0.0, 0.5, 0.8]] * 7
    live = LiveStepCost(LONG)
    short, long = choose_widths(rows, live.at(100), packed=True), choose_widths(rows, live.at(2700), packed=True)
    assert short[0] > max(short[1:]) and min(short[1:]) >= 2  # after 100 tokens: the good row grows past the rest
    assert max(long) == 3 and min(long) == 3  # after 2,700 its width would cost all eight rows' attention


def test_live_steps_at_a_long_context_are_predicted_not_learnt_as_a_slower_machine():
    live = LiveStepCost(LONG, smoothing=0.3, min_samples=1)
    for _ in range(10):
        live.observe(8, 2, LONG(8, 2, widest=9, context=2728), widest=9, context=2728)
    assert live.ratio(8, 2) == 1.0 and live(8, 1) == TABLE(8, 1)  # short contexts keep their price
