"""Offline replay of speculative decoding against recorded greedy outputs: the real n-gram and
suffix proposers, the verifier's own ``SpeculationControl`` and router, no model.

Under greedy decoding a drafted node is accepted exactly when it matches the target's own greedy
output, so a record of plain decoding (each prompt's output token ids) is all it takes to replay
what the proposers, the router and the width gate would do, step by step: the accepted tokens are
exact, and a step costs what the verifier's start-up table says a step of its rows and width costs
(relative to a 1-row plain step). A comparison that takes a 30-minute `specmesh bench`, within its
timing noise, takes a minute here, without noise, e.g. to tell a proposer, router or gate change
that pays from one that does not before the bench measures it. ``replay_batch`` drives the
control (continuous batching in ``--slots`` slots); ``replay_proposers`` holds the proposers.

Two uses:

- (default) each proposer alone, one stream, prefill charged as recorded: ``ngram``, ``suffix``
  and ``merged`` (each step the union of the suffix and n-gram trees, ``suffix.union``, n-gram
  nodes priced by the acceptance per depth measured on the n-gram trees replayed so far,
  ``DepthAcceptance``), and "per-request best": an oracle serving each request with whichever of
  n-gram and suffix replays it faster, the most any choice between the two could gain;
- ``--auto``: the router choosing per request, and its ablation (``variants``: each mechanism
  switched off through a real config field of the router or the control).

Left out: the proposer's latency (a tree is there when asked for), the engine's per-step work
outside the forward, and (``--auto``) prefill. Each proposer's statistics are the router's own
(in-process, decayed on the modelled clock), carried from one request to the next.

Inputs: plain-decoding records of the measured prompts (``records.jsonl`` of any `specmesh bench`
run with ``plain`` in --modes, e.g. docs/bench/issue16-fast) and of the warm-up prompts::

    specmesh bench --workload workloads/specbench_dev_warmup.jsonl --modes plain --turns 1 \\
        --concurrency 8 --mix --load continuous --limit 30 --out docs/bench/warmup-plain

Records are not committed: absent ones under docs/bench/ are read back from git
(``RECORDS_COMMIT``). The suffix cache learns the warm-up outputs first (as --warmup-workload
does), then every measured output as it finishes. ``--held-out``: the warm-up half alone, its even
rows cached and its odd rows measured (no prompt of the measured half involved).

.venv/bin/python benchmarks/spec_replay.py [--records R] [--warmup-records W] [--held-out] [--auto]

(by default the records of docs/bench/issue16-fast and docs/bench/warmup-plain).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from replay_batch import Job, Outcome, RouterStats, Variant, replay_batch
from replay_proposers import DepthAcceptance, MergedReplay, NgramReplay, Replayed, SuffixReplay

from proposer_svc.suffix.cache import SuffixCache
from proposer_svc.suffix.config import SuffixConfig
from specmesh_bench.report import geo_mean_of_medians
from specmesh_bench.workload import BenchPrompt, ChatEncoder, load_prompts, second_turns
from specmesh_router.cost_model import StepCost
from specmesh_router.selection import SelectionConfig
from verifier_svc.speculation import SpeculationConfig

WIDTHS = "1,2,4,8,16,32,64"
COST = "1.0,1.0,1.0,1.1,1.4,1.7,3.0"  # one row, relative to width 1: a 2-core Xeon's start-up table
SCOPE = "measured"  # the suffix cache's scope of every replayed request


def job_of(prompt: BenchPrompt, rec: Recorded, tag: bool = False, prefill: bool = False) -> Job:
    """The replay's request for a measured prompt and its plain decoding."""
    return Job(
        prompt.row_id,
        list(prompt.token_ids),
        rec.token_ids,
        prompt.category if tag else "",
        rec.prefill_steps if prefill else 0.0,
    )


def group_of(prompt: BenchPrompt) -> str:
    return prompt.category if prompt.turn == 1 else f"{prompt.category} turn {prompt.turn}"


def cached(warmed: list[tuple[BenchPrompt, list[int]]]) -> SuffixCache:
    """What the warm-up's requests leave in the suffix cache: their outputs."""
    cache = SuffixCache(SuffixConfig(), background=False)
    for w, ids in warmed:
        cache.learn(SCOPE, list(w.token_ids), ids)
    return cache


# --- each proposer alone ------------------------------------------------------------------------


def fixed_modes(
    measured: list[tuple[BenchPrompt, Recorded]],
    warmed: list[tuple[BenchPrompt, list[int]]],
    cost: StepCost,
    with_prefill: bool,
) -> dict[str, dict[str, Outcome]]:
    """n-gram, suffix and merged, each alone at one stream over every measured prompt in order."""
    suffix_cache, merged_cache, ngram_depths = cached(warmed), cached(warmed), DepthAcceptance()
    makers: dict[str, Callable[[list[int]], Replayed]] = {
        "ngram": NgramReplay,
        "suffix": lambda ctx: SuffixReplay(ctx, suffix_cache, SCOPE),
        "merged": lambda ctx: MergedReplay(ctx, merged_cache, SCOPE, ngram_depths),
    }
    jobs = [job_of(p, rec, prefill=with_prefill) for p, rec in measured]
    return {name: replay_batch(Variant(name, name), jobs, {name: make}, cost, 1)[0] for name, make in makers.items()}


def print_fixed(runs: dict[str, dict[str, Outcome]], groups: dict[str, str]) -> None:
    print("| mode | speed-up (modelled) | tokens/step | drafted | accepted |")
    print("|---|---|---|---|---|")
    for name, res in runs.items():
        by_group: dict[str, list[float]] = defaultdict(list)
        for row, o in res.items():
            by_group[groups[row]].append(o.speedup)
        steps, tokens = sum(o.steps for o in res.values()), sum(o.tokens for o in res.values())
        drafted, accepted = sum(o.drafted for o in res.values()), sum(o.accepted for o in res.values())
        speedup = geo_mean_of_medians(by_group.values())
        print(f"| {name} | {speedup:.3f}x | {tokens / steps:.2f} | {drafted} | {accepted} |")
    print()
    ngram, suffix, merged = runs["ngram"], runs["suffix"], runs["merged"]
    for name, ratio in (
        ("suffix vs ngram", lambda row: suffix[row].speedup / ngram[row].speedup),
        ("merged vs suffix", lambda row: merged[row].speedup / suffix[row].speedup),
        ("per-request best vs suffix", lambda row: max(ngram[row].speedup, suffix[row].speedup) / suffix[row].speedup),
    ):
        paired: dict[str, list[float]] = defaultdict(list)
        for row in suffix:
            paired[groups[row]].append(ratio(row))
        per = ", ".join(f"{g} {statistics.median(v):.3f}x" for g, v in sorted(paired.items()))
        print(f"{name} (paired): {geo_mean_of_medians(paired.values()):.3f}x overall; {per}")


# --- auto: the router choosing per request, and its ablation -----------------------------------


def variants() -> list[Variant]:
    """The router as it is, the fixed proposers, and each remaining mechanism switched off by its
    config field. (The mechanisms this ablation deleted, docs/bench/router-ablation, left with
    their variants.)"""
    no_k_cap = SpeculationConfig(k_cap=False)
    return [
        Variant("full router (auto)"),
        Variant("fixed suffix", proposer="suffix"),
        Variant("fixed ngram", proposer="ngram"),
        Variant("no optimism (ucb_c = 0)", selection=SelectionConfig(ucb_c=0.0)),
        Variant("no served ranking (α model ranks)", selection=SelectionConfig(min_served_steps=math.inf)),
        Variant("served pooled over batch sizes", selection=SelectionConfig(served_by_batch=False)),
        Variant("no k cap", speculation=no_k_cap),
        Variant("fixed ngram, no k cap", proposer="ngram", speculation=no_k_cap),
    ]


def interval(ratios: list[float], seed: int = 0, draws: int = 4000) -> tuple[float, float, float]:
    """Geometric mean of paired ratios and its 95 % bootstrap interval (requests resampled)."""
    logs = np.log(np.asarray(ratios))
    rng = np.random.default_rng(seed)
    boot = logs[rng.integers(0, len(logs), (draws, len(logs)))].mean(axis=1)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    return float(np.exp(logs.mean())), float(np.exp(lo)), float(np.exp(hi))


def ablate(
    jobs: list[Job],
    warmed: list[tuple[BenchPrompt, list[int]]],
    cost: StepCost,
    slots: int,
    prime: int,
    chosen: list[Variant],
) -> None:
    """Every variant over ``jobs`` at ``slots`` slots, each from the warm-up's suffix cache and
    (``prime`` > 0) from the statistics fixed n-gram and suffix blocks at ``prime`` slots leave."""

    def run(v: Variant, at: int, primed: RouterStats | None) -> tuple[dict[str, Outcome], RouterStats]:
        cache = cached(warmed)  # each run starts from the warm-up's cache, learning its own outputs
        proposers: dict[str, Callable[[list[int]], Replayed]] = {
            "ngram": NgramReplay,
            "suffix": lambda ctx: SuffixReplay(ctx, cache, SCOPE),
        }

        def learn(prompt: list[int], output: list[int], followed: Collection[str]) -> None:
            if "suffix" not in followed:  # the suffix tier learns every output (Learn)
                cache.learn(SCOPE, prompt, output)

        return replay_batch(v, jobs, proposers, cost, at, learn, primed)

    # As in a bench, the fixed blocks run before `auto`: the router starts from their statistics.
    primed = None
    if prime:
        for name in ("ngram", "suffix"):
            primed = run(Variant("prime", proposer=name), prime, primed)[1]
    results = {v.name: run(v, slots, primed)[0] for v in chosen}
    refs = [n for n in ("full router (auto)", "fixed suffix", "fixed ngram") if n in results]
    rows = [j.row_id for j in jobs]
    stats = f"primed by fixed blocks at {prime} slot(s)" if prime else "cold statistics"
    print(f"\n## auto at {slots} slot(s), {stats}: tokens per unit cost, paired per request (n={len(rows)}), 95 % CI")
    print(f"| variant | {' | '.join(f'vs {r}' for r in refs)} |")
    print(f"|---|{'---|' * len(refs)}")
    for name, res in results.items():
        cells = []
        for ref in refs:
            g, lo, hi = interval([res[r].speedup / results[ref][r].speedup for r in rows])
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
    numbered = "; ".join(f"{i} {v.name}" for i, v in enumerate(variants()))
    p.add_argument("--variants", default="", help=f"--auto: comma-separated numbers of those to run (all): {numbered}")
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
    head = f"{len(measured)} prompts, {len(warmed)} cached outputs; cost {a.widths} = {a.cost}"
    if a.auto:
        chosen = [variants()[int(i)] for i in a.variants.split(",")] if a.variants else variants()
        print(f"# spec_replay --auto: {head}")
        print("# decode only (no prefill); k rows cost like one row of k x the width (StepCost.by_tokens)")
        jobs = [job_of(q, rec, tag=a.tag) for q, rec in measured]
        for slots in map(int, a.slots.split(",")):
            ablate(jobs, warmed, cost, slots, (a.prime_slots or slots) if a.prime else 0, chosen)
        return
    print(f"# spec_replay: {head}")
    print(f"# {'prefill as recorded' if a.prefill else 'decode only'}")
    print_fixed(fixed_modes(measured, warmed, cost, a.prefill), {q.row_id: group_of(q) for q, _ in measured})


if __name__ == "__main__":
    main()
