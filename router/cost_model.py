"""What a verification step costs on this hardware, and how wide a step should be.

The verifier measures, at start-up, the time of one forward over ``rows`` requests each bringing
``width`` new tokens (its pending token plus a tree of ``width - 1`` nodes) for several batch
sizes and widths 1…64 after a short context (``StepCost``), what each cached key beyond it adds
(``ContextCost``: attention runs over the batch's longest context, for every row, at the widest
row's width), and then keeps correcting that from the timings of the steps it really runs
(``LiveStepCost``: other processes on the machine). The router and the per-step gate know no
model, only ``cost(rows, width, widest, context)``.

On a CPU a step of 8 tokens costs about 2x a step of 1, so speculation pays only where enough
tokens are accepted, and less as the batch grows; on a GPU it is nearly free until the batch is large.
"""

from __future__ import annotations

import bisect
import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

CostFn = Callable[..., float]  # (rows, width[, widest[, context]]) → seconds of one verification forward


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear in x; flat below the first point, linear extrapolation past the last."""
    if x <= xs[0]:
        return ys[0]
    if len(xs) == 1:  # one measurement: proportional past it
        return ys[0] * x / xs[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class ContextCost:
    """What attention over a longer context adds to a forward, past the ``prefix`` its table was
    measured after: every row reads the batch's longest context (its keys padded to it), and
    every query of the padded layout (rows × the widest row's width) attends to all of it:

        extra(rows, widest, context) = (context - prefix) · rows · (per_row_key + per_query_key · widest)

    On the 2-core EPYC (8 rows, SmolLM2-135M, fp32): per_row_key ≈ 2.6 µs, per_query_key ≈ 0.8 µs,
    so a 2,700-token context makes a plain step 1.5x and a width-8 step 1.7x what they cost after
    128 tokens: a tree is dearer there than the short-context table says.

    >>> ctx = ContextCost(prefix=128, per_row_key=2.6e-6, per_query_key=0.8e-6)
    >>> round(ctx(8, 1, 2728), 4), round(ctx(8, 8, 2728), 4), ctx(8, 8, 100)
    (0.0707, 0.1872, 0.0)
    """

    prefix: int
    per_row_key: float
    per_query_key: float

    def __call__(self, rows: int, widest: int, context: int) -> float:
        return max(context - self.prefix, 0) * rows * (self.per_row_key + self.per_query_key * widest)


@dataclass(frozen=True)
class StepCost:
    """Measured seconds of one forward: ``seconds[i][j]`` over ``rows[i]`` requests × ``widths[j]``
    tokens each (padding included). A row count may stop short of the widest width (big forwards
    are not measured); past its last width, and past the last row count, cost grows linearly with
    the tokens of the forward.

    >>> cost = StepCost((1, 4), (1, 8), ((0.06, 0.13), (0.08, 0.30)))
    >>> cost(1, 4), cost(4, 8), round(cost(2, 1), 4)     # interpolated, measured, between row counts
    (0.09, 0.3, 0.0667)
    >>> round(cost(8, 8), 4)     # 8 rows × 8 cost like 4 rows × 16: linear past the measured widths
    0.5514
    >>> StepCost.by_tokens((1, 8), (0.06, 0.13))(2, 4)   # a 1-row table: cost by total tokens
    0.13
    """

    rows: tuple[int, ...]  # ascending, starting at 1
    widths: tuple[int, ...]  # ascending, starting at 1
    seconds: tuple[tuple[float, ...], ...]  # [rows][widths measured at that row count]
    context: ContextCost | None = None  # None: the context's length is not priced

    @classmethod
    def by_tokens(cls, tokens: tuple[int, ...], seconds: tuple[float, ...]) -> StepCost:
        """A table from one row at several widths: rows × width tokens cost like one row that wide."""
        return cls((1,), tokens, (seconds,))

    def _at_rows(self, i: int, width: float) -> float:
        ys = self.seconds[i]
        return _interp(self.widths[: len(ys)], ys, width)

    def __call__(self, rows: int, width: float, widest: float | None = None, context: int | None = None) -> float:
        """Seconds of a forward over ``rows`` rows of ``width`` tokens each (on average, where steps
        are packed; ``widest``: the widest row's, default ``width``) after ``context`` cached
        positions (default: the table's own)."""
        extra = 0.0
        if self.context is not None and context is not None:
            extra = self.context(max(rows, 1), max(widest or width, 1), context)
        return self._table(rows, width) + extra

    def _table(self, rows: int, width: float) -> float:
        rows, width = max(rows, 1), max(width, 1)
        rs = self.rows
        if rows >= rs[-1]:  # extra rows cost like a wider step at the largest measured batch
            return round(self._at_rows(len(rs) - 1, width * rows / rs[-1]), 12)
        i = bisect.bisect_left(rs, rows)
        if rs[i] == rows:
            return round(self._at_rows(i, width), 12)
        lo, hi = self._at_rows(i - 1, width), self._at_rows(i, width)
        return round(lo + (hi - lo) * (rows - rs[i - 1]) / (rs[i] - rs[i - 1]), 12)


class LiveStepCost:
    """``StepCost`` corrected by the steps the verifier really runs.

    Each observed step updates an EWMA of observed ÷ predicted time for its (rows, width) cell
    (rows and width rounded to powers of two) and for all steps together. A prediction is the
    table's value times the cell's ratio once the cell has ``min_samples`` observations, else times
    the overall ratio. Written by the engine thread, read by the router: each update replaces one
    float, so readers never see a torn value.

    >>> live = LiveStepCost(StepCost.by_tokens((1, 8), (0.06, 0.13)), smoothing=0.5, min_samples=2)
    >>> for _ in range(2):
    ...     live.observe(1, 1, 0.09)               # plain steps run 1.5x the start-up figure
    >>> round(live(1, 1), 4), round(live(1, 8), 4)   # the observed cell; others by the overall ratio
    (0.09, 0.1788)
    """

    def __init__(self, table: StepCost, smoothing: float = 0.05, min_samples: int = 8) -> None:
        self.table, self.smoothing, self.min_samples = table, smoothing, min_samples
        self._overall = 1.0
        self._cells: dict[tuple[int, int], tuple[float, int]] = {}  # cell → (ratio EWMA, samples)
        self._lock = threading.Lock()  # writers only

    @staticmethod
    def _cell(rows: int, width: float) -> tuple[int, int]:
        return (round(math.log2(max(rows, 1))), round(math.log2(max(width, 1))))

    def at(self, context: int) -> AtContext:
        """This cost after ``context`` cached positions: ``cost(rows, width, widest=None)``."""
        return AtContext(self, context)

    def observe(
        self, rows: int, width: float, seconds: float, widest: int | None = None, context: int | None = None
    ) -> None:
        predicted = self.table(rows, width, widest, context)
        if predicted <= 0 or seconds <= 0:
            return
        ratio = seconds / predicted
        a = self.smoothing
        with self._lock:
            self._overall += a * (ratio - self._overall)
            cell = self._cell(rows, width)
            old, n = self._cells.get(cell, (self._overall, 0))
            self._cells[cell] = (old + max(a, 1.0 / (n + 1)) * (ratio - old), n + 1)

    def ratio(self, rows: int, width: float) -> float:
        """Observed ÷ start-up time for a step of this shape (1.0 before any observation)."""
        ewma, n = self._cells.get(self._cell(rows, width), (self._overall, 0))
        return ewma if n >= self.min_samples else self._overall

    def __call__(self, rows: int, width: float, widest: float | None = None, context: int | None = None) -> float:
        return self.table(rows, width, widest, context) * self.ratio(rows, width)


@dataclass(frozen=True)
class AtContext:
    """A ``LiveStepCost`` after ``context`` cached positions: ``cost(rows, width, widest=None)``.

    >>> table = StepCost((1, 4), (1, 8), ((0.06, 0.13), (0.08, 0.30)), ContextCost(128, 2.6e-6, 0.8e-6))
    >>> at = LiveStepCost(table).at(600)
    >>> step = at.batch(4)    # a packed step of 4 rows by its tokens and its widest row: the same floats
    >>> step(10, 4) == at(4, 10 / 4, 4), round(step(10, 4), 4)
    (True, 0.1381)
    """

    live: LiveStepCost
    context: int

    def __call__(self, rows: int, width: float, widest: float | None = None) -> float:
        return self.live(rows, width, widest, self.context)

    def batch(self, rows: int) -> Callable[[int, int], float]:
        """``step(tokens, widest)``: ``self(rows, tokens / rows, widest)`` for a packed step of ``rows``
        rows, the table and its live correction priced once per token count and the context once per
        widest row (the same operations in the same order, so the same floats: ``choose_widths`` asks
        for hundreds of (tokens, widest) pairs a step)."""
        live, table, context = self.live, self.live.table, self.context

        @functools.cache
        def by_tokens(tokens: int) -> tuple[float, float]:  # (table seconds, observed ÷ table)
            return table._table(rows, tokens / rows), live.ratio(rows, tokens / rows)

        @functools.cache
        def by_widest(widest: int) -> float:  # the context's seconds (StepCost.__call__'s extra)
            if table.context is None or context is None:
                return 0.0
            return table.context(max(rows, 1), max(widest, 1), context)

        def step(tokens: int, widest: int) -> float:
            seconds, ratio = by_tokens(tokens)
            return (seconds + by_widest(widest)) * ratio

        return step


def choose_width(expected_accepted: list[list[float]], cost: CostFn) -> int:
    """Step width (1 + tree nodes per row) with the highest expected goodput for the batch.

    expected_accepted[i][w - 1]: tokens row i is expected to get accepted at width w (its tree
    cut to its first w - 1 nodes; entry 0 is 0.0, plain decoding). Every row pays for the
    widest one (padding), so goodput(w) = Σ_i (1 + E_i(w)) / cost(rows, w). Width 1 means no
    speculation this step.

    >>> cheap = StepCost.by_tokens((1, 2, 8), (1.0, 1.1, 1.2))    # a GPU-like curve
    >>> choose_width([[0.0, 0.9, 2.0]], cheap)
    3
    >>> dear = StepCost.by_tokens((1, 2, 8), (1.0, 1.8, 2.1))     # this CPU
    >>> choose_width([[0.0, 0.3, 0.6]], dear)
    1
    """
    rows = len(expected_accepted)
    best_w, best = 1, rows / cost(rows, 1)
    for w in range(2, max(map(len, expected_accepted)) + 1):
        gain = sum(1 + e[min(w, len(e)) - 1] for e in expected_accepted)
        goodput = gain / cost(rows, w)
        if goodput > best * 1.02:  # a clear win only: measurement noise must not flip it
            best_w, best = w, goodput
    return best_w


def hull_steps(expected: Sequence[float]) -> list[tuple[int, float]]:
    """The upper concave hull of one row's expected-accepted curve, as steps (width reached, gain
    per node), gains per node decreasing. ``expected[w - 1]``: tokens accepted at width w.

    A row is grown along its hull: a sibling worth nothing until the node below it is in costs
    its node only as part of the step that reaches that node.

    >>> [(w, round(g, 2)) for w, g in hull_steps([0.0, 0.9, 1.5, 1.5, 2.3])]  # 4 alone adds nothing
    [(2, 0.9), (3, 0.6), (5, 0.4)]
    >>> hull_steps([0.0, 0.0])                  # nothing to gain: no step
    []
    """
    steps: list[tuple[int, float]] = []  # (width reached, slope from the previous hull point)
    for w in range(2, len(expected) + 1):
        start = steps[-1][0] if steps else 1
        slope = (expected[w - 1] - expected[start - 1]) / (w - start)
        while steps and slope >= steps[-1][1]:  # the last hull point lies below the new chord: drop it
            steps.pop()
            start = steps[-1][0] if steps else 1
            slope = (expected[w - 1] - expected[start - 1]) / (w - start)
        steps.append((w, slope))
    while steps and steps[-1][1] <= 0:
        steps.pop()
    return steps


def choose_widths(expected_accepted: list[list[float]], cost: CostFn, packed: bool) -> list[int]:
    """Each row's step width (1 + its tree nodes) with the highest expected goodput for the batch.

    Padded steps (``packed`` False): every row pays for the widest, so all take one width
    (:func:`choose_width`). Packed steps hold only real tokens in the linear layers, so a step of
    T tokens over r rows costs about what r rows of T / r tokens each do, and rows differ:
    goodput = Σ_i (1 + E_i(w_i)) / cost(r, Σ_i w_i / r, max_i w_i) (attention still runs padded
    to the widest). Rows grow along their hulls (:func:`hull_steps`), the step with the most
    expected tokens per node first; the best batch seen is kept (a larger one only when it wins
    by 2 %, as in :func:`choose_width`).

    >>> dear = StepCost.by_tokens((1, 2, 8, 16), (1.0, 1.8, 2.1, 2.4))    # this CPU
    >>> rows = [[0.0, 0.9, 1.8, 2.7, 3.6, 4.5, 5.4, 6.3], [0.0, 0.1]] + [[0.0]] * 6
    >>> choose_widths(rows, dear, packed=True)    # one good tree: it alone grows
    [8, 1, 1, 1, 1, 1, 1, 1]
    >>> choose_widths(rows, dear, packed=False)   # padded: all eight rows would pay for 8 tokens
    [1, 1, 1, 1, 1, 1, 1, 1]
    """
    rows = len(expected_accepted)
    if not packed:
        return [choose_width(expected_accepted, cost)] * rows
    hulls = [hull_steps(e) for e in expected_accepted]
    if isinstance(cost, AtContext):
        step = cost.batch(rows)
    else:

        @functools.cache
        def step(tokens: int, widest: int) -> float:  # the growths under each cap price the same steps
            return cost(rows, tokens / rows, widest)

    best, best_widths = rows / step(rows, 1), [1] * rows
    # Every row's attention pays for the widest row (where the context makes that cost), a cost the
    # greedy order (most tokens per node first) does not see: grow once under each cap on the widest.
    caps = sorted({w for h in hulls for w, _ in h})
    if rows == 1 or not caps or step(rows, caps[-1]) <= step(rows, 1):
        caps = caps[-1:]
    # The greedy order, once: every row's hull steps, most tokens per node first (ties: row, then step).
    # A row's gains per node fall along its hull, so this is the order a merge of the rows would take,
    # and under a cap the same order without the steps wider than the cap (each row's hull cut short).
    order = [(w, i) for _, i, _, w in sorted((-g, i, j, w) for i, h in enumerate(hulls) for j, (w, g) in enumerate(h))]
    for cap in caps:
        goodput, widths = _grow(expected_accepted, order, cap, step, best)
        if goodput > best:
            best, best_widths = goodput, widths
    return best_widths


def _grow(
    expected: list[list[float]],
    order: list[tuple[int, int]],
    cap: int,
    step: Callable[[int, int], float],
    floor: float,
) -> tuple[float, list[int]]:
    """Rows grown by the hull steps of ``order`` ((width reached, row), most expected tokens per node
    first) no wider than ``cap``: the best batch seen that beats ``floor`` and each best before it by
    2 % (noise must not flip a choice), else (``floor``, every row at width 1). ``step(tokens,
    widest)``: seconds of the batch's step."""
    rows = len(expected)
    widths = [1] * rows
    gain, tokens, widest = float(rows), rows, 1
    best, best_widths = floor, [1] * rows
    for w, i in order:
        if w > cap:  # and every later step of this row: its hull widens
            continue
        e = expected[i]
        gain += e[w - 1] - e[widths[i] - 1]
        tokens += w - widths[i]
        widths[i] = w
        widest = max(widest, w)  # widths only grow
        goodput = gain / step(tokens, widest)
        if goodput > best * 1.02:
            best, best_widths = goodput, list(widths)
    return best, best_widths
