"""Where the context's suffix occurs in one source, as the trees need it (``Matches``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class Matches:
    """Occurrences of the context's suffix in one source: the longest match, and per match length
    ℓ the (buffer, continuation starts) of the occurrences matching ≥ ℓ tokens."""

    longest: int
    at_least: Callable[[int], list[tuple[np.ndarray, np.ndarray]]]


NO_MATCH = Matches(0, lambda ell: [])


def merged(parts: list[Matches]) -> Matches:
    """One ``Matches`` over several sources."""
    parts = [m for m in parts if m.longest]
    if not parts:
        return NO_MATCH
    return Matches(max(m.longest for m in parts), lambda ell: [g for m in parts for g in m.at_least(ell)])
