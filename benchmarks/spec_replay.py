"""Offline replay of speculation at one stream against recorded greedy outputs: the real n-gram and
suffix proposers and the verifier's width gate, without the model.

Under greedy decoding a drafted node is accepted exactly when it matches the target's own greedy
output, so a record of plain decoding (each prompt's output token ids) is all it takes to replay
what a proposer and the gate would do, step by step: the accepted tokens are exact, and a step
costs what the verifier's start-up table says a step of its width costs (relative to a plain
step). A comparison that takes a 30-minute `specmesh bench`, within its timing noise, takes
seconds here, without noise, e.g. to tell a proposer change or a gate change that pays from one
that does not before the bench measures it.

Besides the two proposers it models what routing and merging could add on top of them: ``merged``
is the union of each step's suffix and n-gram trees (``suffix.union``, each node at the larger of
its two probabilities; n-gram nodes priced by the acceptance per depth measured on the n-gram
trees replayed so far, ``DepthAcceptance``), and "per-request best" is an oracle router that
serves each request with whichever proposer replays it faster: the most any choice between the
two could gain over the better fixed one.

Left out: the proposer's latency, the engine's per-step work outside the forward, and the router
(each mode is one proposer, its trees not capped by a router's k; the verifier caps only trees
without path probabilities, i.e. n-gram's here). The gate runs as the
verifier's does (``RequestSpeculation.expected``, ``choose_widths``, the request's ``RequestEstimate`` and
``Trust`` with its shadow-scored skipped trees), its prior the proposer's statistics pooled over the requests
replayed before (not decayed).

Inputs: plain-decoding records of the measured prompts (``records.jsonl`` of any `specmesh bench`
run with ``plain`` in --modes, e.g. docs/bench/issue16-fast) and of the warm-up prompts::

    specmesh bench --workload workloads/specbench_dev_warmup.jsonl --modes plain --turns 1 \\
        --concurrency 8 --mix --load continuous --limit 30 --out docs/bench/warmup-plain

The suffix cache learns the warm-up outputs first (as --warmup-workload does), then every measured
output as it finishes. ``--held-out``: the warm-up half alone, its even rows cached and its odd
rows measured (no prompt of the measured half involved).

.venv/bin/python benchmarks/spec_replay.py [--records R] [--warmup-records W] [--held-out]

(by default the records of docs/bench/issue16-fast and docs/bench/warmup-plain).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from proposer_svc.suffix.cache import SuffixCache
from proposer_svc.suffix.calibration import learn_outcomes
from proposer_svc.suffix.config import SuffixConfig
from proposer_svc.suffix.request import SuffixRequest
from proposer_svc.suffix.trees import Proposal, union
from specmesh_bench.report import geo_mean_of_medians
from specmesh_bench.workload import BenchPrompt, ChatEncoder, load_prompts, second_turns
from specmesh_router.cost_model import StepCost, choose_widths
from specmesh_router.estimate import RequestEstimate, posterior
from specmesh_router.policy import PolicyStore
from specmesh_router.selection import Router, SelectionConfig
from specmesh_router.stats import AcceptanceStats, InProcessStats, StatsConfig
from specmesh_server.ngram import NgramConfig, NgramIndex
from specmesh_server.tree import TokenTree, depths, follow, truncate
from verifier_svc.proposer_client import ProposerLimits
from verifier_svc.request_speculation import RequestSpeculation, Shadow, ended_by_proposer

NODES, DEPTH = 32, 24  # the verifier's default tree budget
WIDTHS = "1,2,4,8,16,32,64"
COST = "1.0,1.0,1.0,1.1,1.4,1.7,3.0"  # one row, relative to width 1: a 2-core Xeon's start-up table


class Replayed(Protocol):
    """One request's proposer as the replay drives it."""

    def propose(self) -> TokenTree: ...

    def extend(self, tokens: list[int]) -> None: ...

    def close(self) -> None: ...


class NgramReplay:
    def __init__(self, context: list[int]) -> None:
        self.index = NgramIndex(NgramConfig(max_nodes=NODES, max_depth=DEPTH))
        self.index.extend(context)

    def propose(self) -> TokenTree:
        return TokenTree(*self.index.propose())

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def close(self) -> None:
        pass


class SuffixReplay:
    def __init__(self, context: list[int], cache: SuffixCache, scope: str) -> None:
        self.request = SuffixRequest(cache, scope)
        self.request.extend(context)

    def propose(self) -> TokenTree:
        p = self.request.propose(NODES, DEPTH)
        return TokenTree(p.tokens, p.parents, probs=p.probs)

    def extend(self, tokens: list[int]) -> None:
        self.request.extend(tokens)

    def close(self) -> None:
        self.request.close()


class DepthAcceptance:
    """Acceptance of n-gram nodes per depth given their parent's path was emitted, measured on every
    n-gram tree replayed so far; a node's path probability is the product along its path of
    (hits + prior · 0.5) / (trials + prior) at each depth.

    >>> acc = DepthAcceptance()
    >>> acc.learn(TokenTree([7, 8], [-1, 0]), [7, 5])  # depth 1 right, depth 2 wrong
    >>> [round(p, 3) for p in acc.probs([-1, 0])]  # (1 + 1) / (1 + 2), then (0 + 1) / (1 + 2) below it
    [0.667, 0.222]
    """

    def __init__(self, prior: float = 2.0) -> None:
        self.prior = prior
        self.hits, self.trials = np.zeros(DEPTH + 1), np.zeros(DEPTH + 1)  # [depth]

    def probs(self, parents: list[int]) -> list[float]:
        out: list[float] = []
        for p, d in zip(parents, depths(parents), strict=True):
            cond = float((self.hits[d] + self.prior * 0.5) / (self.trials[d] + self.prior))
            out.append(cond if p < 0 else cond * out[p])
        return out

    def learn(self, tree: TokenTree, emitted: list[int]) -> None:
        bins = np.asarray(depths(tree.parents), np.int64)
        tokens, parents = np.asarray(tree.tokens, np.int64), np.asarray(tree.parents, np.int64)
        learn_outcomes(tokens, parents, bins, np.asarray(emitted, np.int64), self.hits, self.trials)


class MergedReplay:
    """Each step the union of the suffix tree and the n-gram tree, within the same node budget."""

    def __init__(self, context: list[int], cache: SuffixCache, scope: str, ngram_depths: DepthAcceptance) -> None:
        self.suffix, self.ngram = SuffixReplay(context, cache, scope), NgramReplay(context)
        self.ngram_depths = ngram_depths
        self.last = TokenTree([], [])  # the n-gram tree of the step in flight

    def propose(self) -> TokenTree:
        own = self.suffix.request.propose(NODES, DEPTH)
        self.last = self.ngram.propose()
        priced = self.ngram_depths.probs(self.last.parents)
        lookup = Proposal(self.last.tokens, self.last.parents, priced, "ngram", 0, sum(priced))
        u = union(own, lookup, NODES)
        return TokenTree(u.tokens, u.parents, probs=u.probs)

    def extend(self, tokens: list[int]) -> None:
        if len(self.last):
            self.ngram_depths.learn(self.last, tokens)
        self.suffix.extend(tokens)
        self.ngram.extend(tokens)

    def close(self) -> None:
        self.suffix.close()


@dataclass
class Pooled:
    """A proposer's statistics over the requests replayed so far: each next request's prior."""

    stats: AcceptanceStats = field(default_factory=AcceptanceStats)


@dataclass
class Replay:
    """One request's replayed decode: steps, the relative time they cost, draft tokens."""

    steps: int = 0
    seconds: float = 0.0  # in units of one plain step
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def speedup(self) -> float:
        return self.tokens / self.seconds  # plain decoding: one token per plain step


def replay(prop: Replayed, output: list[int], pooled: Pooled, name: str, cost: StepCost, prefill: float) -> Replay:
    """Decode ``output`` again with ``prop``'s trees cut by the width gate (as the verifier's
    ``SpeculationControl`` does at one stream), after a prefill of ``prefill`` plain steps;
    ``pooled`` gains every step's sample."""
    limits = ProposerLimits(vocab_size=1 << 20, max_nodes=NODES, max_depth=DEPTH)
    prior = posterior(name, pooled.stats, None, 0.5, 2.0, DEPTH, count_ends=False)
    state = RequestSpeculation(estimate=RequestEstimate.from_posterior(prior))
    out, pos = Replay(seconds=prefill, tokens=len(output)), 0
    while pos < len(output):
        offered = prop.propose()
        complete = ended_by_proposer(offered, limits)
        tree = offered
        if len(offered):
            tree = truncate(offered, choose_widths([state.expected(offered)], cost, packed=True)[0] - 1)
            if not len(tree) and state.shadow is None:
                state.shadow = Shadow(offered, complete)
        levels, rejected = 0, False
        if len(tree):
            node, levels, outcome = follow(tree, 0, output[pos:])
            rejected = bool(outcome)
            ended = not rejected and complete and len(tree) == len(offered) and node - 1 not in tree.parents
            state.observe(levels, rejected, ended, tree)
            state.shadow = None
            pooled.stats += AcceptanceStats.of_step(len(tree), levels, rejected, ended=ended)
        elif not len(offered) or offered.probs:  # nothing, or nothing worth verifying (the gate's call)
            state.estimate.observe_no_tree()
            pooled.stats += AcceptanceStats.no_tree()
        emitted = output[pos : pos + levels + 1]
        if state.shadow is not None and not len(tree):
            shadow = state.follow_shadow(emitted)
            if shadow is not None:
                pooled.stats += shadow
        prop.extend(emitted)
        pos += len(emitted)
        out.steps += 1
        out.seconds += cost(1, 1 + len(tree))
        out.drafted += len(tree)
        out.accepted += levels
    prop.close()
    return out


def run_mode(
    name: str,
    make: Callable[[list[int], str], Replayed],
    measured: list[tuple[BenchPrompt, Recorded]],
    cost: StepCost,
    with_prefill: bool,
) -> dict[str, tuple[str, Replay]]:
    """Every measured prompt in order, the proposer's pooled statistics carried from one to the next."""
    pooled, out = Pooled(), {}
    for prompt, rec in measured:
        prefill = rec.prefill_steps if with_prefill else 0.0
        r = replay(make(list(prompt.token_ids), "measured"), rec.token_ids, pooled, name, cost, prefill)
        group = prompt.category if prompt.turn == 1 else f"{prompt.category} turn {prompt.turn}"
        out[prompt.row_id] = (group, r)
    return out


# --- auto: the router choosing per request, and its ablation -----------------------------------

PLAIN_S = 0.04  # seconds of a 1-row plain step (the EPYC's ITL): the statistics' clock and decay


@dataclass(frozen=True)
class Variant:
    """One way of running the router: ``proposer`` fixed (or ``auto``), its config, and what is off."""

    name: str
    proposer: str = "auto"
    config: SelectionConfig = field(default_factory=SelectionConfig)
    k_cap: bool = True  # the router's k caps trees without path probabilities
    patches: tuple[tuple[object, str, object], ...] = ()  # (owner, attribute, value) while it runs


@dataclass
class Row:
    """One request in flight in the batched replay."""

    prompt: BenchPrompt
    output: list[int]
    proposer: str = "none"
    prop: Replayed | None = None
    state: RequestSpeculation = field(default_factory=RequestSpeculation)
    pos: int = 0
    steps: int = 0
    cost: float = 0.0  # its share of the steps it ran in (cost / rows), in 1-row plain steps
    tokens: int = 0
    had: set[str] = field(default_factory=set)  # proposers it had streams with


def auto_replay(
    variant: Variant,
    measured: list[tuple[BenchPrompt, Recorded]],
    make: Callable[[str, list[int]], Replayed],
    learn: Callable[[list[int], list[int]], None],
    cost: StepCost,
    slots: int,
    tag: bool,
    primed: tuple[dict, float] = ({}, 0.0),
) -> tuple[dict[str, float], tuple[dict, float]]:
    """Every measured prompt through ``slots`` continuous batch slots (a finished request's slot
    takes the next at the next step), the verifier's speculation control in miniature: the router's
    first decision (batch = running + 1), its k as a cap on trees without path probabilities, the
    packed width gate over the batch, shadow walks, the statistics recorded per step as the
    engine records them (in-process backend, decayed on a clock of modelled seconds); a request keeps
    its first proposer and k. ``primed``: the statistics' table and clock to start from.
    Returns (row id → tokens per unit of cost (1-row plain steps), the table and clock at the end)."""
    clock = [primed[1]]
    stats = InProcessStats(StatsConfig(), clock=lambda: clock[0])
    stats._table.rows = dict(primed[0])
    names = ("ngram", "suffix")
    step_time = lambda rows, width, widest=None: cost(rows, width, widest) * PLAIN_S  # noqa: E731
    router = Router(stats, "m", names, PolicyStore(names), step_time, variant.config)
    limits = ProposerLimits(vocab_size=1 << 20, max_nodes=NODES, max_depth=DEPTH)
    queue, running, out = list(measured), [], {}

    def open_(row: Row, name: str, tag_: str) -> None:
        if row.prop is not None:
            row.prop.close()
        row.had.add(name)
        row.proposer, row.prop = name, make(name, [*row.prompt.token_ids, *row.output[: row.pos]])
        row.state = RequestSpeculation.start(None, row.state.k_cap, router.estimate(name, tag_))

    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in variant.patches]
    for owner, attr, value in variant.patches:
        setattr(owner, attr, value)
    try:
        while queue or running:
            while queue and len(running) < slots:
                prompt, rec = queue.pop(0)
                row = Row(prompt, rec.token_ids)
                t = prompt.category if tag else ""
                d = router.decide(variant.proposer, t, 0, len(running) + 1)
                row.state.k_cap = d.k if d.k > 0 and variant.k_cap else None
                open_(row, d.proposer, t)
                running.append(row)
            trees, offered = [], []
            for row in running:
                st = row.state
                st.gated_out = False
                o = row.prop.propose()
                st.offered = o if ended_by_proposer(o, limits) else None
                st.had_tree = len(o) > 0
                offered.append(o)
                trees.append(truncate(o, st.k_cap) if st.k_cap is not None and st.k_cap < len(o) and not o.probs else o)
            rows = len(running)
            widths = choose_widths(
                [r.state.expected(t) for r, t in zip(running, trees, strict=True)], cost, packed=True
            )
            for i, (row, w) in enumerate(zip(running, widths, strict=True)):
                if len(trees[i]) > w - 1:
                    if w == 1:
                        row.state.gated_out = bool(trees[i].probs)
                        if row.state.shadow is None:
                            row.state.shadow = Shadow(trees[i], row.state.complete(trees[i]))
                    trees[i] = truncate(trees[i], w - 1)
            total = sum(1 + len(t) for t in trees)
            seconds = cost(rows, total / rows, max(1 + len(t) for t in trees))
            clock[0] += seconds * PLAIN_S
            samples: dict[tuple[str, str], AcceptanceStats] = {}

            def add(key: tuple[str, str], sample: AcceptanceStats, into: dict = samples) -> None:
                into[key] = into[key] + sample if key in into else sample

            for row, tree in zip(running, trees, strict=True):
                st, t = row.state, row.prompt.category if tag else ""
                key, levels = (row.proposer, t), 0
                if len(tree):
                    _, levels, outcome = follow(tree, 0, row.output[row.pos :])
                    rejected = bool(outcome)
                    ended = not rejected and st.complete(tree)
                    st.observe(levels, rejected, ended, tree)
                    st.shadow = None
                    add(key, AcceptanceStats.of_step(len(tree), levels, rejected, 0.0, ended))
                elif (st.offered is not None and not len(st.offered)) or st.gated_out:
                    st.estimate.observe_no_tree()
                    add(key, AcceptanceStats.no_tree())
                emitted = row.output[row.pos : row.pos + levels + 1]
                add(key, AcceptanceStats.served(len(emitted), len(tree), seconds * PLAIN_S, rows, tree=st.had_tree))
                if st.shadow is not None and not len(tree):
                    shadow = st.follow_shadow(emitted)
                    if shadow is not None:
                        add(key, shadow)
                row.prop.extend(emitted)
                row.pos += len(emitted)
                row.steps += 1
                row.cost += seconds / rows
                row.tokens += len(emitted)
            for (name, t), sample in samples.items():
                router.record(name, t, sample)
            for row in list(running):
                if row.pos >= len(row.output):
                    running.remove(row)
                    row.prop.close()
                    if "suffix" not in row.had:  # the suffix tier learns every output (Learn)
                        learn(list(row.prompt.token_ids), row.output)
                    out[row.prompt.row_id] = row.tokens / row.cost
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)
    return out, (dict(stats._table.rows), clock[0])


def interval(ratios: list[float], seed: int = 0, draws: int = 4000) -> tuple[float, float, float]:
    """Geometric mean of paired ratios and its 95 % bootstrap interval (requests resampled)."""
    logs = np.log(np.asarray(ratios))
    rng = np.random.default_rng(seed)
    boot = logs[rng.integers(0, len(logs), (draws, len(logs)))].mean(axis=1)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return float(np.exp(logs.mean())), float(np.exp(lo)), float(np.exp(hi))


_served_in = AcceptanceStats.served_in


def variants() -> list[Variant]:
    """The router as it is, the fixed proposers, and each remaining mechanism switched off. (The
    mechanisms this ablation deleted, docs/bench/router-ablation, left with their variants.)"""
    from specmesh_router import selection as sel

    base = SelectionConfig()
    return [
        Variant("full router (auto)"),
        Variant("fixed suffix", proposer="suffix"),
        Variant("fixed ngram", proposer="ngram"),
        Variant("no optimism (ucb_c = 0)", config=replace(base, ucb_c=0.0)),
        Variant("no served ranking (α model ranks)", config=replace(base, min_served_steps=math.inf)),
        Variant(
            "served pooled over batch sizes",
            patches=(
                (AcceptanceStats, "served_in", lambda self, bucket=None: _served_in(self, None)),
                (sel, "ranking_rows", lambda evidence, min_steps, rows: rows),
            ),
        ),
        Variant("no k cap", k_cap=False),
        Variant("fixed ngram, no k cap", proposer="ngram", k_cap=False),
    ]


def ablate(
    measured: list[tuple[BenchPrompt, Recorded]],
    warmed: list[tuple[BenchPrompt, list[int]]],
    cost: StepCost,
    slots: int,
    tag: bool,
    prime: int,
) -> None:
    def cached() -> SuffixCache:
        cache = SuffixCache(SuffixConfig(), background=False)
        for w, ids in warmed:
            cache.learn("measured", list(w.token_ids), ids)
        return cache

    def run(v: Variant, primed: tuple[dict, float]) -> tuple[dict[str, float], tuple[dict, float]]:
        cache = cached()  # each run starts from the warm-up's cache, learning its own outputs

        def make(name: str, ctx: list[int]) -> Replayed:
            return SuffixReplay(ctx, cache, "measured") if name == "suffix" else NgramReplay(ctx)

        def learn(prompt: list[int], output: list[int]) -> None:
            cache.learn("measured", prompt, output)

        return auto_replay(v, measured, make, learn, cost, slots if v.name != "prime" else prime, tag, primed)

    # As in a bench, the fixed blocks run before `auto`: the router starts from their statistics.
    primed: tuple[dict, float] = ({}, 0.0)
    if prime:
        for name in ("ngram", "suffix"):
            primed = run(Variant("prime", proposer=name), primed)[1]
    results = {v.name: run(v, primed)[0] for v in variants()}
    full, suffix, ngram = (results[n] for n in ("full router (auto)", "fixed suffix", "fixed ngram"))
    rows = list(full)
    stats = f"primed by fixed blocks at {prime} slot(s)" if prime else "cold statistics"
    print(f"\n## auto at {slots} slot(s), {stats}: tokens per unit cost, paired per request (n={len(rows)}), 95 % CI")
    print("| variant | vs full router | vs fixed suffix | vs fixed ngram |")
    print("|---|---|---|---|")
    for name, res in results.items():
        cells = []
        for ref in (full, suffix, ngram):
            g, lo, hi = interval([res[r] / ref[r] for r in rows])
            cells.append(f"{g:.3f} ({lo:.3f}–{hi:.3f})")
        print(f"| {name} | {' | '.join(cells)} |")


@dataclass(frozen=True)
class Recorded:
    """One prompt's plain decoding as a bench recorded it."""

    concurrency: int
    token_ids: list[int]
    text: str
    prefill_steps: float  # time to first token over the median inter-token latency


# Bench records are not committed (docs/bench/HISTORY.md); the replay's inputs are read back from the
# last commit that held them when absent.
RECORDS_COMMIT = "48e01bea5e"


def restore_records(path: Path) -> None:
    """``path`` (a ``docs/bench/*/records.jsonl``) from git history, where this checkout lacks it."""
    import subprocess

    rel = path.resolve().relative_to(Path(__file__).resolve().parents[1])
    done = subprocess.run(["git", "show", f"{RECORDS_COMMIT}:{rel}"], capture_output=True, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"{path} is absent and git could not restore it from {RECORDS_COMMIT} "
            f"({done.stderr.decode().strip()}): rerun the command in its folder's summary.md"
        )
    path.write_bytes(done.stdout)


def outputs_of(path: Path) -> dict[str, Recorded]:
    """row id → plain decoding in a bench's records (1 stream preferred)."""
    if not path.is_file() and "docs/bench/" in path.as_posix():
        restore_records(path)
    found: dict[str, Recorded] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["mode"] != "plain":
            continue
        old = found.get(r["row_id"])
        if old is None or (r["concurrency"] == 1 and old.concurrency != 1):
            itl = statistics.median(r["itl_ms"]) if r.get("itl_ms") else 0.0
            prefill = r["ttft_ms"] / itl if itl and r.get("ttft_ms") else 0.0
            found[r["row_id"]] = Recorded(r["concurrency"], r["token_ids"], r["text"], prefill)
    return found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--records",
        type=Path,
        default=Path("docs/bench/issue16-fast/records.jsonl"),
        help="plain-decoding records of the measured prompts",
    )
    p.add_argument(
        "--warmup-records",
        type=Path,
        default=Path("docs/bench/warmup-plain/records.jsonl"),
        help="plain-decoding records of the warm-up prompts",
    )
    p.add_argument("--workload", type=Path, default=Path("workloads/specbench_dev_measured.jsonl"))
    p.add_argument("--warmup-workload", type=Path, default=Path("workloads/specbench_dev_warmup.jsonl"))
    p.add_argument("--limit", type=int, default=2, help="measured prompts per category (as the bench's)")
    p.add_argument("--held-out", action="store_true", help="cache the warm-up half's even rows, measure its odd rows")
    p.add_argument("--widths", default=WIDTHS, help="step widths of the cost table")
    p.add_argument("--cost", default=COST, help="their cost relative to width 1 (the verifier logs its table)")
    p.add_argument(
        "--prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="charge each request its recorded time to first token (as the bench's tokens/s does)",
    )
    p.add_argument("--auto", action="store_true", help="replay `auto` (the router) and its ablation instead")
    p.add_argument("--slots", default="1,8", help="--auto: batch slots to replay at (continuous batching)")
    p.add_argument(
        "--prime",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--auto: the router's statistics start from fixed ngram and suffix blocks (as in a bench)",
    )
    p.add_argument("--prime-slots", type=int, default=0, help="--auto: slots of the priming blocks (0: as measured)")
    p.add_argument("--tag", action="store_true", help="--auto: each request's category as its workload tag")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    encoder = ChatEncoder(AutoTokenizer.from_pretrained(resolve_model_path()))

    cost = StepCost.by_tokens(tuple(map(int, a.widths.split(","))), tuple(map(float, a.cost.split(","))))
    warm_out = outputs_of(a.warmup_records)
    warm = [w for w in load_prompts(a.warmup_workload, None, None, encoder.user) if w.row_id in warm_out]
    if a.held_out:
        warmed = [(w, warm_out[w.row_id].token_ids) for w in warm[::2]]
        measured = [(w, warm_out[w.row_id]) for w in warm[1::2]]
    else:
        out = outputs_of(a.records)
        first = load_prompts(a.workload, None, a.limit, encoder.user)
        answers = {q.row_id: out[q.row_id].text for q in first if q.row_id in out}
        prompts = first + second_turns(first, answers, encoder.chat)
        measured = [(q, out[q.row_id]) for q in prompts if q.row_id in out]
        warmed = [(w, warm_out[w.row_id].token_ids) for w in warm]

    def cached() -> SuffixCache:  # what the warm-up's requests leave in the cache: their outputs
        cache = SuffixCache(SuffixConfig(), background=False)
        for w, ids in warmed:
            cache.learn("measured", list(w.token_ids), ids)
        return cache

    if a.auto:
        print(
            f"# spec_replay --auto: {len(measured)} prompts, {len(warmed)} cached outputs; cost {a.widths} = {a.cost}"
        )
        print("# decode only (no prefill); k rows cost like one row of k x the width (StepCost.by_tokens)")
        for slots in map(int, a.slots.split(",")):
            ablate(measured, warmed, cost, slots, a.tag, (a.prime_slots or slots) if a.prime else 0)
        return
    suffix_cache, merged_cache, ngram_depths = cached(), cached(), DepthAcceptance()
    runs = {
        "ngram": run_mode("ngram", lambda ctx, scope: NgramReplay(ctx), measured, cost, a.prefill),
        "suffix": run_mode(
            "suffix", lambda ctx, scope: SuffixReplay(ctx, suffix_cache, scope), measured, cost, a.prefill
        ),
        "merged": run_mode(
            "merged",
            lambda ctx, scope: MergedReplay(ctx, merged_cache, scope, ngram_depths),
            measured,
            cost,
            a.prefill,
        ),
    }
    prefill = "prefill as recorded" if a.prefill else "decode only"
    print(f"# spec_replay: {len(measured)} prompts, {len(warmed)} cached outputs; cost {a.widths} = {a.cost}")
    print(f"# {prefill}")
    print("| mode | speed-up (modelled) | tokens/step | drafted | accepted |")
    print("|---|---|---|---|---|")
    for name, res in runs.items():
        groups: dict[str, list[float]] = defaultdict(list)
        for group, r in res.values():
            groups[group].append(r.speedup)
        steps = sum(r.steps for _, r in res.values())
        tokens = sum(r.tokens for _, r in res.values())
        drafted = sum(r.drafted for _, r in res.values())
        accepted = sum(r.accepted for _, r in res.values())
        speedup = geo_mean_of_medians(groups.values())
        print(f"| {name} | {speedup:.3f}x | {tokens / steps:.2f} | {drafted} | {accepted} |")
    print()
    best = {row: max(runs["ngram"][row][1].speedup, r.speedup) for row, (_, r) in runs["suffix"].items()}
    for name, ratio in (
        ("suffix vs ngram", lambda row, r: r.speedup / runs["ngram"][row][1].speedup),
        ("merged vs suffix", lambda row, r: runs["merged"][row][1].speedup / r.speedup),
        ("per-request best vs suffix", lambda row, r: best[row] / r.speedup),
    ):
        paired: dict[str, list[float]] = defaultdict(list)
        for row, (group, r) in runs["suffix"].items():
            paired[group].append(ratio(row, r))
        per = ", ".join(f"{g} {statistics.median(v):.3f}x" for g, v in sorted(paired.items()))
        print(f"{name} (paired): {geo_mean_of_medians(paired.values()):.3f}x overall; {per}")


if __name__ == "__main__":
    main()
