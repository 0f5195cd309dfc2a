"""`benchmarks/spec_replay.py` replays what the verifier's own speculation control decides: every
tree it verifies is one ``SpeculationControl.collect_trees`` returned, every proposer and k one
``SpeculationControl.start`` chose, step for step what a hand-driven control over the verifier's
in-process n-gram session and greedy acceptance gives."""

from __future__ import annotations

import asyncio
import doctest
import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

from proposer_svc.suffix.cache import SuffixCache
from proposer_svc.suffix.config import SuffixConfig
from specmesh_router.cost_model import LiveStepCost, StepCost
from specmesh_router.policy import PolicyStore
from specmesh_router.selection import Router
from specmesh_router.stats import InProcessStats, StatsConfig
from specmesh_server.tree import depths
from verifier_svc.acceptance import greedy_accept
from verifier_svc.local_proposer import LocalProposerSession
from verifier_svc.speculation import SpeculationConfig, SpeculationControl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
replay_batch = importlib.import_module("replay_batch")
replay_proposers = importlib.import_module("replay_proposers")
spec_replay = importlib.import_module("spec_replay")
Job, Variant, replay = replay_batch.Job, replay_batch.Variant, replay_batch.replay_batch
LIMITS, ModelClock = replay_proposers.LIMITS, replay_proposers.ModelClock
NgramReplay, SuffixReplay = replay_proposers.NgramReplay, replay_proposers.SuffixReplay

COST = StepCost.by_tokens((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.1, 1.4, 1.7, 3.0))  # the replay's default
PHRASE = [10, 11, 12, 13, 14, 15, 16, 17]
JOBS = [  # a request that repeats its prompt, one that half does, one that never does
    Job("copy", [*PHRASE, 3, *PHRASE, 4], [*PHRASE, 5, *PHRASE[:5], 6, 7, *PHRASE]),
    Job("half", [1, 2, *PHRASE, 9], [*PHRASE[:4], 40, 41, 42, *PHRASE[2:], 43, 44, 45]),
    Job("fresh", [50, 51, 52], list(range(60, 80))),
]


def argmax_along(tree, target: list[int]) -> list[int]:
    """The target's greedy token after the root and after each node (-1 where off the target's path
    or past its end): what the verifier's forward gives ``greedy_accept``."""
    on, out = [True], [target[0]]
    for tok, parent, depth in zip(tree.tokens, tree.parents, depths(tree.parents), strict=True):
        on.append(on[parent + 1] and depth <= len(target) and tok == target[depth - 1])
        out.append(target[depth] if on[-1] and depth < len(target) else -1)
    return out


def by_hand(jobs: list[Job]) -> dict[str, list[int]]:
    """``jobs`` decoded one after another by a SpeculationControl driven directly, with the
    verifier's in-process n-gram session and greedy acceptance: each step's width (1 + nodes
    verified), per job."""
    clock = ModelClock()
    seconds = replay_batch.in_seconds(COST)
    router = Router(InProcessStats(StatsConfig(), clock), "m", ("ngram",), PolicyStore(("ngram",)), seconds)
    control = SpeculationControl(SpeculationConfig(), router, LiveStepCost(seconds), clock=clock)
    control.open_session = lambda req, name: LocalProposerSession(name, req.prompt_ids, LIMITS, control.trees_arrived)
    widths: dict[str, list[int]] = {}
    for job in jobs:
        req = replay_batch.request_of(job, "ngram")
        seq = SimpleNamespace(req=req, speculation=asyncio.run(control.start(req, 1)), output=[], done=False)
        widths[job.row_id] = []
        while not seq.done:
            seq.context_length = len(job.prompt) + len(seq.output)
            seq.length = seq.context_length - 1
            target = job.output[len(seq.output) :]
            [whole] = control.collect_trees([seq], max_context=1 << 20)
            tree = replay_batch.judged(whole, len(target) - 1)  # what the record can judge
            path, bonus = greedy_accept(tree, argmax_along(tree, target))
            step_s = seconds(1, 1 + len(whole))
            clock.advance(step_s)
            [emitted] = control.after_step([seq], [tree], [(path, bonus)], step_s)
            seq.output += emitted
            widths[job.row_id].append(1 + len(whole))
            if len(seq.output) == len(job.output):
                control.finish(seq)
                seq.done = True
            control.emitted(seq, emitted, None)
    return widths


def test_the_replay_verifies_step_for_step_what_a_hand_driven_speculation_control_verifies():
    out, _ = replay(Variant("ngram", "ngram"), JOBS * 2, {"ngram": NgramReplay}, COST, slots=1)
    assert {row: o.widths for row, o in out.items()} == by_hand(JOBS * 2)
    assert all(o.tokens == len(job.output) for job, o in zip(JOBS, out.values(), strict=True))
    assert max(out["copy"].widths) > 1  # it speculated where the prompt repeats
    assert out["copy"].steps < len(JOBS[0].output)


class Spy(SpeculationControl):
    """The control as the replay runs it, remembering what it decided."""

    decided: ClassVar[list[tuple]] = []

    async def start(self, req, batch):
        state = await super().start(req, batch)
        Spy.decided.append(("start", req.request_id, state.counters.proposer, state.k_cap))
        return state

    def collect_trees(self, seqs, max_context, constrain=None):
        trees = super().collect_trees(seqs, max_context, constrain)
        Spy.decided += [("tree", s.job.row_id, 1 + len(t)) for s, t in zip(seqs, trees, strict=True)]
        return trees


@pytest.mark.parametrize("slots", [1, 2])
def test_every_proposer_k_and_tree_the_replay_uses_is_the_one_speculation_control_chose(monkeypatch, slots):
    monkeypatch.setattr(replay_batch, "SpeculationControl", Spy)
    Spy.decided = []
    cache = SuffixCache(SuffixConfig(), background=False)
    proposers = {"ngram": NgramReplay, "suffix": lambda ctx: SuffixReplay(ctx, cache, "s")}
    out, stats = replay(Variant("auto"), JOBS * 2, proposers, COST, slots)
    started = {row: (p, k) for kind, row, p, k in (d for d in Spy.decided if d[0] == "start")}
    assert {row: (o.proposer, o.k_cap) for row, o in out.items()} == started
    for job in JOBS:
        widths = [d[2] for d in Spy.decided if d[:2] == ("tree", job.row_id)]
        assert out[job.row_id].widths == widths[-len(out[job.row_id].widths) :]  # its second run's
    assert stats.now > 0 and stats.table  # the router's statistics moved on the modelled clock


def test_the_gate_and_the_k_cap_are_the_controls_own():
    dear = StepCost.by_tokens((1, 2, 4), (1.0, 2.0, 4.0))  # a node costs what a step does: never pays
    out, _ = replay(Variant("ngram", "ngram"), JOBS, {"ngram": NgramReplay}, dear, slots=1)
    assert all(w == 1 for o in out.values() for w in o.widths)
    assert out["copy"].steps == out["copy"].tokens == len(JOBS[0].output)
    capped, _ = replay(Variant("ngram", "ngram"), JOBS[:1], {"ngram": NgramReplay}, COST, slots=1)
    free = Variant("no k cap", "ngram", speculation=SpeculationConfig(k_cap=False))
    uncapped, _ = replay(free, JOBS[:1], {"ngram": NgramReplay}, COST, slots=1)
    assert capped["copy"].k_cap is not None and uncapped["copy"].k_cap is None


def test_every_ablation_variant_is_a_config_of_the_router_or_the_control():
    for v in spec_replay.variants():
        assert set(vars(v)) == {"name", "proposer", "selection", "speculation"}, v.name
    names = [v.name for v in spec_replay.variants()]
    assert len(set(names)) == len(names)


def test_records_keep_one_plain_decoding_per_row_the_single_stream_one_first(tmp_path):
    rows = [
        {"mode": "plain", "row_id": "a", "concurrency": 8, "token_ids": [1], "text": "x", "itl_ms": [10.0]},
        {
            "mode": "plain",
            "row_id": "a",
            "concurrency": 1,
            "token_ids": [2, 3],
            "text": "y",
            "itl_ms": [10.0, 30.0],
            "ttft_ms": 100.0,
        },
        {"mode": "ngram", "row_id": "b", "concurrency": 1, "token_ids": [4], "text": "z"},
    ]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = spec_replay.outputs_of(path)
    assert list(got) == ["a"]
    assert got["a"].token_ids == [2, 3] and got["a"].prefill_steps == 5.0  # 100 ms over the median 20 ms


@pytest.mark.parametrize("module", [replay_batch, replay_proposers])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0
