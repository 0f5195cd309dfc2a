"""A decode step's grammars (``grammar_step``): none where no request is constrained; otherwise the
trees are cut by ``constrain_trees`` with each request's room, the masks built for the gated trees,
and the step's time and pruned nodes reported once, after the masks."""

from types import SimpleNamespace

from specmesh_server.tree import TokenTree
from verifier_svc import grammar_step
from verifier_svc.engine_observer import EngineObserver
from verifier_svc.grammar_step import GrammarStep


class Observer(EngineObserver):
    def __init__(self) -> None:
        self.reports = []

    def grammar_step(self, seconds: float, pruned: int) -> None:
        self.reports.append((seconds, pruned))


def test_a_step_without_constrained_requests_has_no_grammar_step():
    assert GrammarStep.of([None, None], [0, 4], Observer()) is None


def test_trees_are_constrained_with_their_rooms_and_the_step_reports_its_time_and_pruned_nodes(monkeypatch):
    g = SimpleNamespace(pruned=5)  # a request's grammar, 5 nodes pruned in earlier steps
    calls = []

    def constrain_trees(grammars, trees, rooms):
        calls.append(("constrain", rooms))
        g.pruned += 2
        return [TokenTree([], []), trees[1]]

    def step_masks(grammars, trees):
        calls.append(("masks", [len(t) for t in trees]))
        return "masks"

    monkeypatch.setattr(grammar_step, "constrain_trees", constrain_trees)
    monkeypatch.setattr(grammar_step, "step_masks", step_masks)
    observer = Observer()
    step = GrammarStep.of([g, None], [3, 0], observer)
    trees = [TokenTree([1, 2], [-1, 0]), TokenTree([5], [-1])]
    cut = step.constrain(trees)
    assert cut[0] == TokenTree([], []) and cut[1] is trees[1]
    assert observer.reports == []  # the step's grammar work is not over yet
    assert step.masks(cut) == "masks"
    assert calls == [("constrain", [3, 0]), ("masks", [0, 1])]
    [(seconds, pruned)] = observer.reports
    assert pruned == 2 and seconds == step.seconds > 0
