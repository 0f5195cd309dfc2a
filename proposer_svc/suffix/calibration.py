"""Calibration: what the count ratios are worth, measured.

The counts are not what the verifier should bet on: on the dev workload, global first tokens with
count ratio 1.0 were right 35% of the time, those after an 8-token match in the request's own
context 94%. ``Calibration`` turns each node's count ratio into the acceptance this proposer has
measured for nodes like it (same source, match length, depth 1 or deeper, count ratio, parent
count), learned from the tokens every stream's ``Advance`` brings (under greedy decoding a node is
right exactly when its token is the one emitted at its depth), so the path probabilities sent are
calibrated and the verifier's gate can take them at their word.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
from numba import njit

from proposer_svc.suffix.trees import Proposal

SOURCES = ("request", "global")
_LENGTHS, _QBINS, _PARENT_COUNTS = 6, 11, 4
CALIBRATION_BINS = len(SOURCES) * _LENGTHS * 2 * _QBINS * _PARENT_COUNTS
_WINDOW = 1024.0  # a bin past this many trials halves its counts: it follows the recent traffic


@njit(cache=True, nogil=True)
def calibrate(parents, probs, rows, source, ell, hits, trials, prior, out_bins, out_path):  # pragma: no cover
    """Each node's bin and calibrated path probability (see ``Calibration``). The bin is (source,
    match length ℓ ≤ 6, depth 1 or deeper, q = count(node) / count(parent) in tenths, count(parent)
    ≤ 4); the conditional (hits + prior · q) / (trials + prior); the path probability its product
    with the parent's (parents precede children)."""
    for i in range(len(parents)):
        par = parents[i]
        above = 1.0 if par < 0 else probs[par]
        q = min(1.0, probs[i] / above) if above > 0 else 0.0
        parent_count = max(1, int(above * rows + 0.5))
        b = source * _LENGTHS + min(max(ell, 1), _LENGTHS) - 1
        b = b * 2 + (1 if par < 0 else 0)
        b = b * _QBINS + min(int(q * 10.0), 10)
        b = b * _PARENT_COUNTS + min(parent_count, _PARENT_COUNTS) - 1
        out_bins[i] = b
        cond = (hits[b] + prior * q) / (trials[b] + prior)
        out_path[i] = cond if par < 0 else cond * out_path[par]


@njit(cache=True, nogil=True)
def learn_outcomes(tokens, parents, bins, emitted, hits, trials):  # pragma: no cover - compiled
    """Scores every node whose parent's path was emitted: right iff its token was emitted at its
    depth (the target's own token there, whatever the verifier cut). Returns how many were scored."""
    n = len(tokens)
    right = np.zeros(n, np.bool_)
    depth = np.empty(n, np.int64)
    scored = 0
    for i in range(n):
        par = parents[i]
        depth[i] = 1 if par < 0 else depth[par] + 1
        if (par < 0 or right[par]) and depth[i] <= len(emitted):
            right[i] = tokens[i] == emitted[depth[i] - 1]
            b = bins[i]
            trials[b] += 1.0
            hits[b] += 1.0 if right[i] else 0.0
            if trials[b] > _WINDOW:
                trials[b] *= 0.5
                hits[b] *= 0.5
            scored += 1
    return scored


@dataclass
class Scored:
    """A tree sent, kept until the tokens after its context arrive: each node's calibration bin."""

    tokens: np.ndarray  # [nodes] int64
    parents: np.ndarray  # [nodes] int64
    bins: np.ndarray  # [nodes] int64


class Calibration:
    """Measured acceptance per node kind, shared by every stream of the process.

    A node's calibrated conditional is (hits + prior · q) / (trials + prior) of its bin (q: its
    count ratio, the prior's mean), its path probability the product along its path; the tree is
    then re-ordered most probable first (a child never above its parent: each factor ≤ 1).

    Worked example: nodes like the root child 7 below (global, 1-token match, q = 1, one
    occurrence) were right once in 4 trials; a prior of 2 pulls that toward q = 1:
    (1 + 2 · 1) / (4 + 2) = 0.5; its child 8 was right the one time its parent was (3 / 3 = 1.0):

    >>> cal = Calibration(prior=2.0)
    >>> tree = Proposal([7, 8], [-1, 0], [1.0, 1.0], "global", 1, 2.0, rows=1)
    >>> for emitted in ([7, 8], [5], [5], [5]):
    ...     _ = cal.learn(cal.apply(tree)[1], emitted)
    >>> cal.apply(tree)[0].probs
    [0.5, 0.5]
    """

    def __init__(self, prior: float = 2.0) -> None:
        self.prior = prior
        self.hits = np.zeros(CALIBRATION_BINS, np.float64)
        self.trials = np.zeros(CALIBRATION_BINS, np.float64)
        self.lock = threading.Lock()

    def apply(self, tree: Proposal) -> tuple[Proposal, Scored | None]:
        if not tree.tokens:
            return tree, None
        n = len(tree.tokens)
        bins, path = np.empty(n, np.int64), np.empty(n, np.float64)
        src = SOURCES.index(tree.source)
        parents, counts = np.asarray(tree.parents, np.int64), np.asarray(tree.probs, np.float64)
        with self.lock:
            ell, prior = tree.match_length, self.prior
            calibrate(parents, counts, tree.rows, src, ell, self.hits, self.trials, prior, bins, path)
        probs = path.tolist()
        out = Proposal(tree.tokens, tree.parents, probs, tree.source, tree.match_length, float(path.sum()), tree.rows)
        return out, Scored(np.asarray(tree.tokens, np.int64), parents, bins)

    def learn(self, scored: Scored | None, emitted) -> int:
        """The tokens that followed the context ``scored`` was proposed for; returns the nodes scored."""
        if scored is None or not len(emitted):
            return 0
        emitted = np.asarray(emitted, np.int64)
        with self.lock:
            return learn_outcomes(scored.tokens, scored.parents, scored.bins, emitted, self.hits, self.trials)
