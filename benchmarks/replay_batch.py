"""Continuous batching replayed against recorded greedy outputs, every speculation decision made by
the verifier's own ``SpeculationControl`` and ``Router``.

Under greedy decoding a drafted node is accepted exactly when it matches the target's greedy
output, so a record of plain decoding is all the target it takes: :func:`greedy_result` answers
what the verifier's acceptance would, over the part of each tree the record can judge
(:func:`judged`). The rest is the engine's loop in miniature, with no model: each request starts
through ``SpeculationControl.start`` (the router's decision at batch = running + 1, its k, the
request's estimate, its ``ReplaySession``), every step asks ``collect_trees`` (the k cap, the
packed width gate, shadow walks), prices the step by the cost table, tells ``after_step`` what
was accepted (the router's statistics, on a clock of modelled seconds) and ``emitted`` / ``finish``
what the request got. Nothing of the control is copied here: a change to it changes the replay.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

from replay_proposers import LIMITS, ModelClock, Replayed, ReplaySession

from specmesh_router.cost_model import LiveStepCost, StepCost
from specmesh_router.policy import PolicyStore
from specmesh_router.selection import Router, SelectionConfig
from specmesh_router.stats import AcceptanceStats, InProcessStats, StatsConfig, StatsKey
from specmesh_server.tree import TokenTree, depths, follow
from verifier_svc.request_speculation import ProposerSession, RequestSpeculation
from verifier_svc.requests import GenerationRequest, SpecParams
from verifier_svc.speculation import SpeculationConfig, SpeculationControl

PLAIN_S = 0.04  # seconds of a 1-row plain step (the EPYC's ITL): the statistics' clock and decay
MODEL = "replay"
MAX_CONTEXT = 1 << 30  # no request is cut by the context here


@dataclass(frozen=True)
class Variant:
    """One way of running the verifier: ``proposer`` named by every request (or ``auto``) and the
    router's and the speculation control's configs (an ablation switches a mechanism off there)."""

    name: str
    proposer: str = "auto"
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)


@dataclass(frozen=True)
class Job:
    """One request to replay: its prompt, its recorded greedy output, its workload tag."""

    row_id: str
    prompt: list[int]
    output: list[int]
    tag: str = ""
    prefill: float = 0.0  # 1-row plain steps charged before its first decode step


@dataclass
class Outcome:
    """One request's replayed decode."""

    proposer: str  # the router's choice
    k_cap: int | None  # the router's k as the control applies it
    cost: float = 0.0  # 1-row plain steps: its prefill, then its share (1 / rows) of every step it ran in
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    widths: list[int] = field(default_factory=list)  # per step: 1 + the nodes it verified

    @property
    def steps(self) -> int:
        return len(self.widths)

    @property
    def speedup(self) -> float:
        """Tokens per unit of cost: plain decoding gives one per 1-row plain step."""
        return self.tokens / self.cost


@dataclass
class InFlight:
    """A request in the replayed batch, as ``SpeculationControl`` reads a ``verifier_svc.sequence.Sequence``."""

    job: Job
    req: GenerationRequest
    speculation: RequestSpeculation
    outcome: Outcome
    output: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def context_length(self) -> int:
        return len(self.req.prompt_ids) + len(self.output)

    @property
    def length(self) -> int:  # tokens whose KV is cached: all but the pending one
        return self.context_length - 1


@dataclass(frozen=True)
class RouterStats:
    """The router's statistics where a run left them: decayed sums and the modelled time they are at."""

    table: dict[StatsKey, AcceptanceStats] = field(default_factory=dict)
    now: float = 0.0


def judged(tree: TokenTree, depth: int) -> TokenTree:
    """``tree`` without its nodes deeper than ``depth``: the part a record can judge where
    ``depth`` + 1 tokens of the output are left (the last comes as the bonus). Past the record the
    target's tokens are unknown, so a path accepted to the cut is censored, as one cut by the
    verifier's budget is, not a miss.

    >>> judged(TokenTree([5, 6, 7, 8], [-1, 0, 1, -1], probs=[0.9, 0.8, 0.7, 0.1]), 1)
    TokenTree(tokens=[5, 8], parents=[-1, -1], dists=None, probs=[0.9, 0.1])
    """
    keep = [i for i, d in enumerate(depths(tree.parents)) if d <= depth]
    if len(keep) == len(tree):
        return tree
    index = {old: new for new, old in enumerate(keep)}

    def pick(xs: list | None) -> list | None:
        return None if xs is None else [xs[i] for i in keep]

    parents = [index[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in keep]
    return TokenTree(pick(tree.tokens), parents, pick(tree.dists), pick(tree.probs))


def greedy_result(tree: TokenTree, target: list[int]) -> tuple[list[int], int]:
    """Greedy verification of ``tree`` (no deeper than ``len(target) - 1``, ``judged``) where the
    target's greedy continuation is ``target``: the accepted nodes, root to leaf, and the bonus
    token, as the verifier's acceptance returns them.

    >>> t = TokenTree([5, 6, 7, 8], [-1, 0, 1, -1])    # 5→6→7, 8
    >>> greedy_result(t, [5, 6, 9, 4]), greedy_result(t, [8, 1]), greedy_result(t, [3])
    (([0, 1], 9), ([3], 1), ([], 3))
    """
    node, levels, _ = follow(tree, 0, target)
    path = []
    while node > 0:
        path.append(node - 1)
        node = tree.parents[node - 1] + 1
    return path[::-1], target[levels]


def in_seconds(cost: StepCost) -> StepCost:
    """``cost`` (relative to a 1-row plain step) in seconds of ``PLAIN_S`` each.

    >>> in_seconds(StepCost.by_tokens((1, 8), (1.0, 2.0)))(1, 8)
    0.08
    """
    return replace(cost, seconds=tuple(tuple(s * PLAIN_S for s in row) for row in cost.seconds))


def request_of(job: Job, proposer: str) -> GenerationRequest:
    """A greedy request for ``job`` naming ``proposer``, the router deciding k."""
    params = SpecParams(proposer=proposer, num_speculative_tokens=0, max_tree_nodes=0, workload_tag=job.tag, corpus="")
    return GenerationRequest(
        request_id=job.row_id,
        prompt_ids=list(job.prompt),
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=0,
        max_tokens=len(job.output),
        stop=(),
        ignore_eos=False,
        spec_params=params,
    )


# (request's prompt, the proposers it had streams with), once per finished request
Learn = Callable[[list[int], list[int], Collection[str]], None]


def replay_batch(
    variant: Variant,
    jobs: list[Job],
    proposers: dict[str, Callable[[list[int]], Replayed]],
    cost: StepCost,
    slots: int,
    learn: Learn | None = None,
    primed: RouterStats | None = None,
) -> tuple[dict[str, Outcome], RouterStats]:
    """Every job through ``slots`` continuous-batching slots, in order (a finished request's slot
    takes the next job at the next step), with the router choosing among ``proposers`` (name →
    a proposer for a prompt). ``cost``: a step's cost relative to a 1-row plain step (rows ×
    width, as the verifier's start-up table). ``learn(prompt, output, followed)``: told every
    finished request, as the verifier's output learning is. ``primed``: the statistics to start
    from. Returns each job's outcome by row id and the statistics at the end."""
    primed = primed or RouterStats()
    clock = ModelClock(primed.now)
    stats = InProcessStats(StatsConfig(), clock=clock)
    for key, sample in primed.table.items():
        stats.record(key, sample)
    seconds = in_seconds(cost)
    names = tuple(proposers)
    router = Router(stats, MODEL, names, PolicyStore(names), seconds, variant.selection)

    def open_session(req: GenerationRequest, name: str) -> ProposerSession | None:
        if name not in proposers:
            return None
        return ReplaySession(name, proposers[name](list(req.prompt_ids)), len(req.prompt_ids), LIMITS, clock)

    def finished(req: GenerationRequest, output: list[int], followed: Collection[str]) -> None:
        if learn is not None:
            learn(req.prompt_ids, output, followed)

    control = SpeculationControl(
        variant.speculation, router, LiveStepCost(seconds), open_session=open_session, learn=finished, clock=clock
    )
    queue, running, out = list(jobs), [], {}
    loop = asyncio.new_event_loop()
    try:
        while queue or running:
            while queue and len(running) < slots:
                job = queue.pop(0)
                req = request_of(job, variant.proposer)
                state = loop.run_until_complete(control.start(req, len(running) + 1))
                outcome = Outcome(state.counters.proposer, state.k_cap, cost=job.prefill)
                running.append(InFlight(job, req, state, outcome))
            trees = control.collect_trees(running, MAX_CONTEXT)
            widths = [1 + len(t) for t in trees]  # the step verifies them whole
            targets = [r.job.output[len(r.output) :] for r in running]
            trees = [judged(t, len(target) - 1) for t, target in zip(trees, targets, strict=True)]
            results = [greedy_result(t, target) for t, target in zip(trees, targets, strict=True)]
            step_s = seconds(len(running), sum(widths) / len(running), max(widths))
            clock.advance(step_s)
            emitted = control.after_step(running, trees, results, step_s)
            for row, width, (path, _), tokens in zip(running, widths, results, emitted, strict=True):
                o = row.outcome
                o.widths.append(width)
                o.cost += step_s / PLAIN_S / len(running)
                o.tokens, o.drafted, o.accepted = o.tokens + len(tokens), o.drafted + width - 1, o.accepted + len(path)
                row.output += tokens  # never past the output's end (``judged``)
                if len(row.output) == len(row.job.output):  # as the engine: finish (End, learn), then done
                    control.finish(row)
                    row.done = True
                control.emitted(row, tokens, None)
            for row in [r for r in running if r.done]:
                running.remove(row)
                out[row.job.row_id] = row.outcome
    finally:
        loop.close()
    return out, RouterStats(stats.snapshot(), clock.now)
