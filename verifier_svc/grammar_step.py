"""A decode step's structured output: the constrained requests' trees cut to their grammars (after
the text each grammar forces is grafted on), the step's logits masks, and what that cost.

The engine builds one :class:`GrammarStep` per decode step whose batch holds a constrained request,
hands :meth:`GrammarStep.constrain` to ``SpeculationControl.collect_trees`` (it cuts the trees before
the cost gate prices them) and takes :meth:`GrammarStep.masks` for the gated trees, which reports
the step's grammar time and pruned nodes to the engine's observer (``/metrics``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from specmesh_server.tree import TokenTree
from verifier_svc.grammar import RequestGrammar, StepMasks, constrain_trees, step_masks

if TYPE_CHECKING:
    from verifier_svc.engine_observer import EngineObserver


class GrammarStep:
    """One decode step's grammars: request i's (None where unconstrained), and ``rooms[i]``, the tree
    nodes its forced text may fill (0: the request does not speculate; ``grammar.constrain_trees``);
    ``observer`` is told the step's grammar time and pruned nodes."""

    def __init__(self, grammars: list[RequestGrammar | None], rooms: list[int], observer: EngineObserver) -> None:
        self.grammars, self.rooms, self.observer = grammars, rooms, observer
        self.seconds = 0.0  # spent constraining trees and building masks
        self.pruned = 0  # tree nodes the grammars cut this step

    @classmethod
    def of(
        cls, grammars: list[RequestGrammar | None], rooms: list[int], observer: EngineObserver
    ) -> GrammarStep | None:
        """The step's grammars, or None where no request in it is constrained."""
        return cls(grammars, rooms, observer) if any(g is not None for g in grammars) else None

    def constrain(self, trees: list[TokenTree]) -> list[TokenTree]:
        """The trees without the nodes the grammars forbid (and with the text they force)."""
        t0, before = time.perf_counter(), self._pruned_so_far()
        out = constrain_trees(self.grammars, trees, self.rooms)
        self.seconds += time.perf_counter() - t0
        self.pruned += self._pruned_so_far() - before
        return out

    def masks(self, trees: list[TokenTree]) -> StepMasks | None:
        """The step's masks for its (constrained, then gated) ``trees``; the step's grammar work is done."""
        t0 = time.perf_counter()
        out = step_masks(self.grammars, trees)
        self.seconds += time.perf_counter() - t0
        self.observer.grammar_step(self.seconds, self.pruned)
        return out

    def _pruned_so_far(self) -> int:
        return sum(g.pruned for g in self.grammars if g is not None)
