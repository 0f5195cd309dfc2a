"""What a verification step costs on this hardware, and how wide a step should be.

The verifier measures the time of one forward over t new tokens (t = batch rows × step
width, padding included) at start-up and hands the table to ``StepCost``; the router knows
no model. On a CPU a step of 8 tokens costs about 2x a step of 1, so speculation pays only
where enough tokens are accepted; on a GPU it is nearly free until the batch is large.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """Piecewise-linear cost (seconds) of a forward over ``tokens`` new tokens."""

    tokens: tuple[int, ...]  # ascending, starting at 1
    seconds: tuple[float, ...]

    def __call__(self, tokens: int) -> float:
        """Interpolated cost; linear extrapolation past the last measurement.

        >>> StepCost((1, 8), (0.06, 0.13))(4)
        0.09
        """
        xs, ys = self.tokens, self.seconds
        if tokens <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, tokens), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return round(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), 12)


def choose_width(expected_accepted: list[list[float]], cost: StepCost) -> int:
    """Step width (1 + tree nodes per row) with the highest expected goodput for the batch.

    expected_accepted[i][w - 1]: tokens row i is expected to get accepted at width w (its tree
    cut to its first w - 1 nodes; entry 0 is 0.0, plain decoding). Every row pays for the
    widest one (padding), so goodput(w) = Σ_i (1 + E_i(w)) / cost(rows · w). Width 1 means no
    speculation this step.

    >>> cheap = StepCost((1, 2, 8), (1.0, 1.1, 1.2))    # a GPU-like curve
    >>> choose_width([[0.0, 0.9, 2.0]], cheap)
    3
    >>> dear = StepCost((1, 2, 8), (1.0, 1.8, 2.1))     # this CPU
    >>> choose_width([[0.0, 0.3, 0.6]], dear)
    1
    """
    rows = len(expected_accepted)
    best_w, best = 1, rows / cost(rows)
    for w in range(2, max(map(len, expected_accepted)) + 1):
        gain = sum(1 + e[min(w, len(e)) - 1] for e in expected_accepted)
        goodput = gain / cost(rows * w)
        if goodput > best * 1.02:  # a clear win only: measurement noise must not flip it
            best_w, best = w, goodput
    return best_w
