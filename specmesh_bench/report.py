"""From per-request records to the summary: medians, paired speed-ups, tables and plots.

Speed-ups are paired: a mode's tokens/s on a prompt (or a wave, at concurrency > 1) divided by
``plain``'s on the same prompt (wave) of the same run, then the median over the category's
prompts; the overall figure is the geometric mean over categories. ``hf-pld`` counts as its best
lookup length per category. Efficiency = a mode's speed-up ÷ the oracle's. ``mode_ratios`` pairs
two modes directly the same way (suffix vs n-gram, auto vs each fixed proposer), and
``mode_intervals`` says how far the overall figure could move by noise alone (a bootstrap over
the paired prompts or waves).

A run against an HTTP target with ``--also-grpc`` holds records of both transports: the tables
describe the target (``primary``), and ``gateway_vs_grpc`` sets each mode's two transports side by
side.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specmesh_bench.verifier_metrics import DecodeRow

OVERALL = "overall"


@dataclass
class Row:
    sampling: str
    concurrency: int
    category: str
    mode: str
    requests: int
    tokens_per_s: float
    speedup: float | None = None  # vs plain, same run
    vs_hf_pld: float | None = None
    efficiency: float | None = None  # speedup / oracle speedup
    ttft_ms: float | None = None
    # Concurrency 1: the speed-up vs plain after each request's first token (what a proposer can
    # shorten; paired, median), and the share of the requests' time before it (prefill: no proposer's)
    after_first_speedup: float | None = None
    before_first_share: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    mean_accepted_length: float | None = None  # tokens emitted per verification step
    acceptance_rate: float | None = None  # accepted / drafted
    drafted: int = 0
    accepted: int = 0
    proposer_share: float | None = None  # proposer wait / (wait + verify)
    lossless: bool | None = None
    pld_k: int | None = None
    fallbacks: int = 0
    notes: list[str] = field(default_factory=list)
    # --structured: outputs validated against their schema, the valid ones, the invalid ones cut by
    # max tokens, and the drafted nodes the grammar discarded (None: no record reports them)
    schema_checked: int = 0
    schema_valid: int = 0
    schema_invalid_at_length: int = 0
    grammar_pruned: int | None = None


@dataclass
class TransportRow:
    """One mode at one concurrency through the HTTP gateway and through gRPC, in the same run."""

    sampling: str
    concurrency: int
    mode: str
    requests: int  # per transport
    grpc_tokens_per_s: float
    http_tokens_per_s: float
    ratio: float | None  # http / grpc, paired by prompt (wave), median
    grpc_itl_p50_ms: float | None
    http_itl_p50_ms: float | None
    itl_diff_ms: float | None  # http - grpc
    grpc_ttft_ms: float | None
    http_ttft_ms: float | None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile.

    >>> percentile([1.0, 2.0, 3.0, 4.0], 50), percentile([1.0, 2.0, 3.0, 4.0], 99)
    (2.0, 4.0)
    """
    s = sorted(values)
    return s[max(math.ceil(q / 100 * len(s)) - 1, 0)]


def geomean(values: list[float]) -> float:
    """Geometric mean (NaN for none).

    >>> round(geomean([1.0, 4.0]), 6)
    2.0
    """
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def geo_mean_of_medians(groups: Iterable[list[float]]) -> float:
    """The bench's overall figure: the median per group, then their geometric mean.

    >>> round(geo_mean_of_medians([[1.0, 2.0, 3.0], [8.0]]), 3)
    4.0
    """
    return geomean([statistics.median(g) for g in groups])


def best_pld(records: list[dict]) -> list[dict]:
    """Keep, per category, only the hf-pld runs of the lookup length with the best median tokens/s."""
    by: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    out = [r for r in records if r["mode"] != "hf-pld"]
    for r in records:
        if r["mode"] == "hf-pld":
            by[(r["sampling"], r["concurrency"], r["category"])][r["pld_k"]].append(r)
    for runs in by.values():
        best = max(runs.values(), key=lambda rs: statistics.median(x["tokens_per_s"] for x in rs))
        out.extend(best)
    return out


def _unit(r: dict) -> tuple:
    """What pairs records across modes: the prompt at concurrency 1, the wave beyond."""
    return (r["prompt_index"],) if r["concurrency"] == 1 else (r["wave"],)


def _throughput(rs: list[dict]) -> dict[tuple, float]:
    """tokens/s per pairing unit: per request at concurrency 1, the wave's aggregate beyond; under
    continuous load one unit, all waves pooled (Σ tokens / Σ wave seconds), since its waves are a
    turn's whole prompts, not alike (32 first turns, then 4 second turns, say) and a median of two
    would weigh them alike.

    >>> def r(wave, tokens, wave_tps):
    ...     return {"concurrency": 8, "load": "continuous", "wave": wave, "prompt_index": 0,
    ...             "completion_tokens": tokens, "wave_tokens_per_s": wave_tps}
    >>> _throughput([r(0, 300, 40.0), r(0, 100, 40.0), r(1, 100, 100.0)])  # 500 tokens in 10 s + 1 s
    {('all',): 45.45454545454545}
    """
    out: dict[tuple, float] = {}
    pooled: dict[int, list[dict]] = defaultdict(list)
    for r in rs:
        if r["concurrency"] == 1:
            out[_unit(r)] = r["tokens_per_s"]
        elif r.get("load") == "continuous":
            pooled[r["wave"]].append(r)
        else:
            out[_unit(r)] = r["wave_tokens_per_s"]
    if pooled:
        waves = [(sum(r["completion_tokens"] for r in w), w[0]["wave_tokens_per_s"]) for w in pooled.values()]
        seconds = sum(n / tps for n, tps in waves)
        out[("all",)] = sum(n for n, _ in waves) / seconds if seconds else 0.0
    return out


def _after_first(rs: list[dict]) -> dict[tuple, float]:
    """Tokens/s after the first token, per request at concurrency 1 (none beyond: a wave's requests
    overlap); requests of one token are left out.

    >>> _after_first([{"concurrency": 1, "prompt_index": 0, "completion_tokens": 11, "wall_s": 1.5, "ttft_ms": 500.0}])
    {(0,): 10.0}
    """
    out: dict[tuple, float] = {}
    for r in rs:
        if r["concurrency"] != 1 or "wall_s" not in r or "ttft_ms" not in r:
            continue
        after, tokens = r["wall_s"] - r["ttft_ms"] / 1e3, r.get("completion_tokens", len(r.get("token_ids", [])))
        if tokens > 1 and after > 0:
            out[_unit(r)] = (tokens - 1) / after
    return out


def _before_first_share(rs: list[dict]) -> float | None:
    """The requests' time before their first token, over their whole time (concurrency 1 only).

    >>> _before_first_share([{"concurrency": 1, "wall_s": 2.0, "ttft_ms": 500.0},
    ...                      {"concurrency": 1, "wall_s": 2.0, "ttft_ms": 1500.0}])
    0.5
    """
    rs = [r for r in rs if r["concurrency"] == 1 and "ttft_ms" in r and r.get("wall_s")]
    return sum(r["ttft_ms"] / 1e3 for r in rs) / sum(r["wall_s"] for r in rs) if rs else None


def primary(records: list[dict]) -> list[dict]:
    """The records of the run's target: with an HTTP target, gRPC records (``--also-grpc``) are
    only the other side of the gateway comparison.

    >>> [r["transport"] for r in primary([{"transport": "http"}, {"transport": "grpc"}])]
    ['http']
    >>> len(primary([{"transport": "grpc"}, {"mode": "hf-greedy"}]))
    2
    """
    if any(r.get("transport") == "http" for r in records):
        return [r for r in records if r.get("transport") != "grpc"]
    return records


def gateway_vs_grpc(records: list[dict]) -> list[TransportRow]:
    """Per (sampling, concurrency, mode) run over both transports: tokens/s (median per request at
    concurrency 1, of wave aggregates beyond) and their paired ratio, TTFT and ITL p50 over all
    categories. The gRPC ITL is ``itl_spread_ms`` where recorded: estimated from chunk times and
    the total as it must be over HTTP (``runner.spread_counts``), so both sides are measured alike."""
    by: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.get("transport") in ("grpc", "http"):
            by[(r["sampling"], r["concurrency"], r["mode"])][r["transport"]].append(r)
    out = []
    for (sampling, c, mode), sides in sorted(by.items(), key=lambda kv: (*kv[0][:2], _MODE_RANK.get(kv[0][2], 99))):
        if len(sides) < 2:
            continue
        g, h = sides["grpc"], sides["http"]
        tg, th = _pooled_throughput(g), _pooled_throughput(h)
        ig = [x for r in g for x in r.get("itl_spread_ms", r.get("itl_ms", []))]
        ih = [x for r in h for x in r.get("itl_ms", [])]
        pg, ph = (percentile(ig, 50) if ig else None), (percentile(ih, 50) if ih else None)
        out.append(
            TransportRow(
                sampling=sampling,
                concurrency=c,
                mode=mode,
                requests=len(h),
                grpc_tokens_per_s=statistics.median(tg.values()),
                http_tokens_per_s=statistics.median(th.values()),
                ratio=_paired_ratio(th, tg),
                grpc_itl_p50_ms=pg,
                http_itl_p50_ms=ph,
                itl_diff_ms=ph - pg if pg is not None and ph is not None else None,
                grpc_ttft_ms=statistics.median(r["ttft_ms"] for r in g),
                http_ttft_ms=statistics.median(r["ttft_ms"] for r in h),
            )
        )
    return out


def _pooled_throughput(rs: list[dict]) -> dict[tuple, float]:
    """``_throughput`` over every category: units keyed by their group too."""
    return {(g, *k): v for g, grs in _by_group(rs).items() for k, v in _throughput(grs).items()}


def _by_group(rs: list[dict]) -> dict[str, list[dict]]:
    """Records per group (the category, or "mix" for waves that mix categories), in first-seen order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rs:
        groups[r.get("group", r["category"])].append(r)
    return groups


def _paired_ratios(a: dict[tuple, float], b: dict[tuple, float]) -> list[float]:
    return [a[k] / b[k] for k in a if k in b and b[k] > 0]


def _paired_ratio(a: dict[tuple, float], b: dict[tuple, float]) -> float | None:
    ratios = _paired_ratios(a, b)
    return statistics.median(ratios) if ratios else None


def summarize(records: list[dict]) -> list[Row]:
    records = best_pld(records)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:  # "group": the category, or "mix" for waves that mix categories
        groups[(r["sampling"], r["concurrency"], r.get("group", r["category"]), r["mode"])].append(r)
    rows: dict[tuple, Row] = {}
    for (sampling, c, cat, mode), rs in groups.items():
        tput = _throughput(rs)
        gaps = [g for r in rs for g in r.get("itl_ms", [])]
        drafted, accepted = sum(r.get("drafted", 0) for r in rs), sum(r.get("accepted", 0) for r in rs)
        wait, verify = sum(r.get("proposer_wait_ms", 0.0) for r in rs), sum(r.get("verify_ms", 0.0) for r in rs)
        checked = [r["lossless"] for r in rs if "lossless" in r]
        service = "ttft_ms" in rs[0]
        rows[(sampling, c, cat, mode)] = Row(
            sampling=sampling,
            concurrency=c,
            category=cat,
            mode=mode,
            requests=len(rs),
            tokens_per_s=statistics.median(tput.values()),
            ttft_ms=statistics.median(r["ttft_ms"] for r in rs) if service else None,
            before_first_share=_before_first_share(rs),
            itl_p50_ms=percentile(gaps, 50) if gaps else None,
            itl_p99_ms=percentile(gaps, 99) if gaps else None,
            mean_accepted_length=statistics.fmean(r["mean_accepted_length"] for r in rs) if service else None,
            acceptance_rate=accepted / drafted if drafted else None,
            drafted=drafted,
            accepted=accepted,
            proposer_share=wait / (wait + verify) if service and wait + verify > 0 else None,
            lossless=all(checked) if checked else None,
            pld_k=rs[0].get("pld_k") if mode == "hf-pld" else None,
            fallbacks=sum(1 for r in rs if r.get("fallback_reason")),
            **_structured_counts(rs),
        )
    for (sampling, c, cat, mode), row in rows.items():
        plain = groups.get((sampling, c, cat, "plain"))
        if plain:
            row.speedup = _paired_ratio(_throughput(groups[(sampling, c, cat, mode)]), _throughput(plain))
            row.after_first_speedup = _paired_ratio(_after_first(groups[(sampling, c, cat, mode)]), _after_first(plain))
        pld = groups.get((sampling, c, cat, "hf-pld"))
        if pld and mode != "hf-pld":
            row.vs_hf_pld = _paired_ratio(_throughput(groups[(sampling, c, cat, mode)]), _throughput(pld))
    for (sampling, c, cat, _), row in rows.items():
        oracle = rows.get((sampling, c, cat, "oracle"))
        if oracle and oracle.speedup and row.speedup is not None:
            row.efficiency = row.speedup / oracle.speedup
    return sorted(rows.values(), key=lambda r: (r.sampling, r.concurrency, r.category, r.mode)) + _overall(rows)


def _structured_counts(rs: list[dict]) -> dict:
    """The ``--structured`` fields of a Row over records (each with ``schema_valid`` where checked).

    >>> _structured_counts([{"schema_valid": True, "grammar_pruned": 3},
    ...                     {"schema_valid": False, "finish_reason": "length"}, {}])
    {'schema_checked': 2, 'schema_valid': 1, 'schema_invalid_at_length': 1, 'grammar_pruned': 3}
    """
    checked = [r for r in rs if "schema_valid" in r]
    pruned = [r["grammar_pruned"] for r in rs if "grammar_pruned" in r]
    return {
        "schema_checked": len(checked),
        "schema_valid": sum(1 for r in checked if r["schema_valid"]),
        "schema_invalid_at_length": sum(
            1 for r in checked if not r["schema_valid"] and r.get("finish_reason") == "length"
        ),
        "grammar_pruned": sum(pruned) if pruned else None,
    }


def _overall(rows: dict[tuple, Row]) -> list[Row]:
    """Per (sampling, concurrency, mode): geometric means over categories."""
    by: dict[tuple, list[Row]] = defaultdict(list)
    for (sampling, c, _, mode), row in rows.items():
        by[(sampling, c, mode)].append(row)
    out = []
    for (sampling, c, mode), rs in sorted(by.items()):
        pruned = [r.grammar_pruned for r in rs if r.grammar_pruned is not None]

        def gm(attr: str, rs: list[Row] = rs) -> float | None:
            vals = [getattr(r, attr) for r in rs]
            return geomean(vals) if vals and all(v for v in vals) else None

        checked = [r.lossless for r in rs if r.lossless is not None]
        shares = [r.before_first_share for r in rs if r.before_first_share is not None]
        out.append(
            Row(
                sampling=sampling,
                concurrency=c,
                category=OVERALL,
                mode=mode,
                requests=sum(r.requests for r in rs),
                tokens_per_s=geomean([r.tokens_per_s for r in rs]),
                speedup=gm("speedup"),
                after_first_speedup=gm("after_first_speedup"),
                before_first_share=statistics.fmean(shares) if shares else None,
                vs_hf_pld=gm("vs_hf_pld"),
                efficiency=gm("efficiency"),
                mean_accepted_length=gm("mean_accepted_length"),
                drafted=sum(r.drafted for r in rs),
                accepted=sum(r.accepted for r in rs),
                acceptance_rate=(sum(r.accepted for r in rs) / d) if (d := sum(r.drafted for r in rs)) else None,
                lossless=all(checked) if checked else None,
                fallbacks=sum(r.fallbacks for r in rs),
                schema_checked=sum(r.schema_checked for r in rs),
                schema_valid=sum(r.schema_valid for r in rs),
                schema_invalid_at_length=sum(r.schema_invalid_at_length for r in rs),
                grammar_pruned=sum(pruned) if pruned else None,
            )
        )
    return out


def pipeline_overhead(records: list[dict]) -> dict[tuple[str, int], float]:
    """1 − (n-gram through its service ÷ the same algorithm in-process), paired, per run kind."""
    out = {}
    for sampling, c in sorted({(r["sampling"], r["concurrency"]) for r in records}):

        def tput(mode: str, sampling: str = sampling, c: int = c) -> dict[tuple, float]:
            rs = [r for r in records if r["mode"] == mode and r["sampling"] == sampling and r["concurrency"] == c]
            return _pooled_throughput(rs)

        ratio = _paired_ratio(tput("ngram"), tput("ngram-local"))
        if ratio is not None:
            out[(sampling, c)] = 1.0 - ratio
    return out


def mode_ratios(records: list[dict], a: str, b: str) -> dict[tuple[str, int], dict[str, float]]:
    """Mode ``a``'s tokens/s over mode ``b``'s, paired as speed-ups are, per (sampling,
    concurrency) run where both ran: per category (the median of per-prompt ratios at 1 stream,
    of per-wave aggregates beyond), ``OVERALL`` (the geometric mean over categories, or the "mix"
    waves' own ratio when waves mix categories) and, for categories with second turns, "<cat>
    turn 2" (those prompts only). In mixed waves a category's ratio pairs its requests one by one
    (same wave and slot) by their own tokens/s.

    >>> def r(mode, cat, i, tps, turn=1):
    ...     return {"mode": mode, "category": cat, "prompt_index": i, "sampling": "greedy", "concurrency": 1,
    ...             "wave": i, "tokens_per_s": tps, "turn": turn}
    >>> rs = [r("ngram", "qa", 0, 10.0), r("suffix", "qa", 0, 25.0), r("ngram", "mt", 0, 10.0),
    ...       r("suffix", "mt", 0, 10.0), r("ngram", "mt", 1, 10.0, 2), r("suffix", "mt", 1, 40.0, 2)]
    >>> {k: round(v, 3) for k, v in mode_ratios(rs, "suffix", "ngram")[("greedy", 1)].items()}
    {'overall': 2.5, 'qa': 2.5, 'mt': 2.5, 'mt turn 2': 4.0}
    """
    out = {}
    for run, ra, rb in _runs_of(records, a, b):

        def ratio(keep, ra: list[dict] = ra, rb: list[dict] = rb) -> float | None:
            return _paired_ratio(_requests([r for r in ra if keep(r)]), _requests([r for r in rb if keep(r)]))

        group = {g: statistics.median(v) if v else None for g, v in _group_ratios(ra, rb).items()}
        cats = {}
        for cat in dict.fromkeys(r["category"] for r in ra):
            cats[cat] = group[cat] if cat in group else ratio(lambda r, cat=cat: r["category"] == cat)
            if any(r.get("turn", 1) > 1 and r["category"] == cat for r in ra):
                cats[f"{cat} turn 2"] = ratio(lambda r, cat=cat: r["category"] == cat and r.get("turn", 1) > 1)
        overall = [v for v in group.values() if v is not None]
        ratios = {OVERALL: geomean(overall) if overall else None, **cats}
        out[run] = {k: v for k, v in ratios.items() if v is not None}
    return out


def mode_intervals(
    records: list[dict], a: str, b: str, level: float = 0.95, draws: int = 2000
) -> dict[tuple[str, int], Interval]:
    """A bootstrap interval around ``mode_ratios``' ``OVERALL`` figure per run: how far the machine's
    noise alone moves it (``bootstrap_interval`` over the same pairing units). None for a run with
    a group of one unit (continuous load pools a run into one): resampling one says nothing."""
    out = {}
    for run, ra, rb in _runs_of(records, a, b):
        groups = [v for v in _group_ratios(ra, rb).values() if v]
        if groups and min(map(len, groups)) > 1:
            out[run] = bootstrap_interval(groups, level, draws)
    return out


@dataclass(frozen=True)
class Interval:
    low: float
    high: float
    level: float
    units: int  # paired prompts (waves) resampled


def bootstrap_interval(groups: list[list[float]], level: float = 0.95, draws: int = 2000, seed: int = 0) -> Interval:
    """Percentile bootstrap of the geometric mean over groups of each group's median paired ratio:
    every draw resamples each group's ratios with replacement (stratified, so every category stays
    in), and the interval holds the middle ``level`` of the draws' figures. Seeded: a report
    reads the same every time it is made.

    Worked example: one category where every prompt ran 2x and one where they ran 1x or 4x; the
    overall figure (√(2 · 2.5) ≈ 2.24x) could as well have come out anywhere from √2 to √8:

    >>> iv = bootstrap_interval([[2.0, 2.0, 2.0], [1.0, 4.0]])
    >>> round(iv.low, 2), round(iv.high, 2), iv.units
    (1.41, 2.83, 5)
    """
    rng = random.Random(seed)
    figures = sorted(geo_mean_of_medians([rng.choices(g, k=len(g)) for g in groups]) for _ in range(draws))
    tail = (1.0 - level) / 2
    low = figures[int(tail * draws)]
    high = figures[min(draws - 1, math.ceil((1.0 - tail) * draws) - 1)]
    return Interval(low, high, level, sum(len(g) for g in groups))


def _runs_of(records: list[dict], a: str, b: str) -> list[tuple[tuple[str, int], list[dict], list[dict]]]:
    """Per (sampling, concurrency) run where modes ``a`` and ``b`` both ran: their records."""
    out = []
    for sampling, c in sorted({(r["sampling"], r["concurrency"]) for r in records}):
        run = [r for r in records if r["sampling"] == sampling and r["concurrency"] == c]
        ra, rb = [r for r in run if r["mode"] == a], [r for r in run if r["mode"] == b]
        if ra and rb:
            out.append(((sampling, c), ra, rb))
    return out


def _group_ratios(ra: list[dict], rb: list[dict]) -> dict[str, list[float]]:
    """Per group (category, or "mix"): the paired ratios of its units (prompts, or waves)."""
    xb = _by_group(rb)
    return {g: _paired_ratios(_throughput(xa), _throughput(xb.get(g, []))) for g, xa in _by_group(ra).items()}


def _requests(rs: list[dict]) -> dict[tuple, float]:
    """Each request's own tokens/s, keyed by its prompt, wave and slot."""
    return {(r["prompt_index"], r["wave"], r.get("slot", 0)): r["tokens_per_s"] for r in rs}


def ratio_line(name: str, ratios: dict[str, float], interval: Interval | None = None) -> str:
    """One line of ``mode_ratios``' figures for a run (and ``mode_intervals``' interval, if given).

    >>> ratio_line("suffix vs ngram", {"overall": 1.234, "code": 1.5, "mt_bench turn 2": 2.0})
    'suffix vs ngram (tokens/s, paired): **1.23x** overall; code 1.50x, mt_bench turn 2 2.00x'
    >>> ratio_line("auto vs suffix", {"overall": 0.99}, Interval(0.962, 1.013, 0.95, 18))
    'auto vs suffix (tokens/s, paired): **0.99x** overall (95% bootstrap interval 0.96–1.01 over 18 paired units)'
    """
    rest = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items() if k != OVERALL)
    head = f"**{ratios[OVERALL]:.2f}x** overall" if OVERALL in ratios else "overall –"
    if interval is not None and OVERALL in ratios:
        head += (
            f" ({interval.level:.0%} bootstrap interval {interval.low:.2f}–{interval.high:.2f} "
            f"over {interval.units} paired units)"
        )
    return f"{name} (tokens/s, paired): {head}" + (f"; {rest}" if rest else "")


def losslessness_failures(records: list[dict]) -> list[str]:
    """One line per greedy output that differs from plain's (from gRPC's plain, for the gateway's plain)."""
    return [
        f"{r['mode']}{f' ({t})' if (t := r.get('transport')) == 'http' else ''} on "
        f"{r['category']}[{r['prompt_index']}] (concurrency {r['concurrency']}, wave {r['wave']}): "
        f"first differing {'character' if r.get('mismatch_in') == 'text' else 'token'} at {r['mismatch_at']}"
        for r in records
        if r.get("lossless") is False
    ]


def _fmt(v: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if v is None else f"{v:{spec}}{suffix}"


# (a, b): "a vs b" ratio lines in the summary wherever both modes ran: the suffix proposer against
# prompt lookup, and the router's choice against each fixed proposer it chooses from
COMPARED = (("suffix", "ngram"), ("auto", "suffix"), ("auto", "ngram"))


def markdown(
    rows: list[Row],
    meta: dict,
    overhead: dict,
    failures: list[str],
    transports: list[TransportRow] | None = None,
    ratios: dict[tuple[str, str], dict[tuple[str, int], dict[str, float]]] | None = None,
    intervals: dict[tuple[str, str], dict[tuple[str, int], Interval]] | None = None,
    decode: list[DecodeRow] | None = None,
) -> str:
    """``ratios``: (a, b) → ``mode_ratios(records, a, b)``, one line per run after its tables, with
    ``intervals``' (a, b) → ``mode_intervals(records, a, b)`` where given; ``decode``: the
    runs' decode-step rows (``VerifierMeter.rows``), a section of their own where given."""
    if meta.get("target", "").startswith(("http://", "https://")):  # the bench runs here, the server elsewhere
        served = f"server: {meta.get('model')} at {meta['target']} (owned_by {meta.get('http_server') or '?'})"
        served += f", verifier {meta['dtype']} on {meta['device']}" if meta.get("device") else ""
    else:
        served = f"verifier: {meta.get('model')} {meta.get('dtype')} on {meta.get('device')}, " + _verifier_layout(meta)
    lines = [
        f"# specmesh bench — {meta.get('started', '')}",
        "",
        f"Machine: {meta.get('cpu')}{' + ' + meta['gpu'] if meta.get('gpu') else ''}; {served}; "
        f"git {meta.get('git_commit', '?')[:10]}; {meta.get('max_tokens')} new tokens, "
        f"{meta.get('limit')} prompts per category.",
        "tokens/s: end to end per request (prefill included), median; at concurrency > 1 the aggregate of a wave"
        + (
            " (continuous load: every prompt of a turn through c streams kept busy). "
            if meta.get("load") == "continuous"
            else ". "
        )
        + "Speed-up: paired with plain on the same prompt in the same run, median; overall = geometric mean "
        "over categories.",
        *_setup_lines(meta),
        "",
    ]
    if failures:
        lines += ["## LOSSLESSNESS FAILURES", "", *[f"- {f}" for f in failures], ""]
    kinds = sorted({(r.sampling, r.concurrency) for r in rows})
    for sampling, c in kinds:
        rs = [r for r in rows if r.sampling == sampling and r.concurrency == c]
        modes = list(dict.fromkeys(r.mode for r in sorted(rs, key=lambda r: _MODE_RANK.get(r.mode, 99))))
        cats = [*dict.fromkeys(r.category for r in rs if r.category != OVERALL), OVERALL]
        cell = {(r.category, r.mode): r for r in rs}
        lines += [f"## {sampling}, {c} stream{'s' if c > 1 else ''}: tokens/s (speed-up vs plain)", ""]
        lines += ["| category | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
        for cat in cats:
            vals = []
            for m in modes:
                r = cell.get((cat, m))
                if r is None:
                    vals.append("–")
                    continue
                k = f" K={r.pld_k}" if r.pld_k else ""
                vals.append(f"{r.tokens_per_s:.1f} ({_fmt(r.speedup, '.2f', 'x')}){k}")
            lines.append(f"| {'**overall (geo-mean)**' if cat == OVERALL else cat} | " + " | ".join(vals) + " |")
        lines += ["", f"Per mode, overall ({sampling}, {c} stream{'s' if c > 1 else ''}):", ""]
        lines += [
            "| mode | speed-up | after the first token | vs HF PLD | efficiency vs oracle | tokens/step | acceptance "
            "| drafted | accepted | TTFT ms | time before the first token | ITL p50/p99 ms | proposer wait | fallbacks "
            "| lossless |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in modes:
            r = cell[(OVERALL, m)]
            detail = [x for x in rs if x.mode == m and x.category != OVERALL]
            ttft = statistics.median(x.ttft_ms for x in detail) if detail and detail[0].ttft_ms is not None else None
            p50 = [x.itl_p50_ms for x in detail if x.itl_p50_ms is not None]
            p99 = [x.itl_p99_ms for x in detail if x.itl_p99_ms is not None]
            share = [x.proposer_share for x in detail if x.proposer_share is not None]
            itl = f"{statistics.median(p50):.0f}/{statistics.median(p99):.0f}" if p50 else "–"
            lossless = {True: "yes", False: "**NO**", None: "–"}[r.lossless]
            lines.append(
                f"| {m} | {_fmt(r.speedup, '.2f', 'x')} | {_fmt(r.after_first_speedup, '.2f', 'x')} "
                f"| {_fmt(r.vs_hf_pld, '.2f', 'x')} | {_fmt(r.efficiency)} "
                f"| {_fmt(r.mean_accepted_length)} | {_fmt(r.acceptance_rate, '.0%')} | {r.drafted} | {r.accepted} "
                f"| {_fmt(ttft, '.0f')} | {_fmt(r.before_first_share, '.0%')} | {itl} "
                f"| {_fmt(statistics.median(share) if share else None, '.0%')} "
                f"| {r.fallbacks} | {lossless} |"
            )
        if (sampling, c) in overhead:
            lines += [
                "",
                f"Pipeline overhead (n-gram through its gRPC service vs the same algorithm in the verifier, "
                f"paired): {overhead[(sampling, c)]:+.1%}",
            ]
        lines += structured_markdown([cell[(OVERALL, m)] for m in modes], meta.get("structured", ""))
        for (a, b), by_run in (ratios or {}).items():
            if (sampling, c) in by_run:
                interval = (intervals or {}).get((a, b), {}).get((sampling, c))
                lines += ["", ratio_line(f"{a} vs {b}", by_run[(sampling, c)], interval)]
        lines.append("")
    if transports:
        lines += transport_markdown(transports)
    if decode:
        lines += decode_markdown(decode, meta.get("tensor_parallel_size"))
    return "\n".join(lines)


def _verifier_layout(meta: dict) -> str:
    """The local verifier's ranks and threads (a ``--target`` verifier's are not known here).

    >>> _verifier_layout({"threads": 2, "tensor_parallel_size": 1, "verifier_threads": 2})
    'TP=1, 2 torch threads'
    >>> _verifier_layout({"threads": 2, "tensor_parallel_size": 2, "verifier_threads": 1})
    'TP=2, 1 torch thread per rank'
    >>> _verifier_layout({"threads": 4})
    '4 torch threads'
    """
    tp = meta.get("tensor_parallel_size")
    if tp is None:
        return f"{meta.get('threads') or 'default'} torch threads"
    n = meta.get("verifier_threads")
    threads = f"{n or 'default'} torch thread{'' if n == 1 else 's'}"
    return f"TP={tp}, {threads}" + (" per rank" if tp > 1 else "")


def decode_markdown(rows: list[DecodeRow], size: int | None) -> list[str]:
    """The "Decode steps" section: per run, its decode forwards, their mean time and that time over plain's
    at the same concurrency (what a speculative step costs against a plain one: set it beside the run's
    tokens a step); with tensor parallelism also the all-reduce time in a step.

    >>> from specmesh_bench.verifier_metrics import DecodeTotals, decode_row
    >>> rows = [decode_row("greedy", 1, "plain", DecodeTotals(4, 0.2, 0.05, 4)),
    ...         decode_row("greedy", 1, "ngram", DecodeTotals(2, 0.15, 0.04, 2))]
    >>> for line in decode_markdown(rows, 2)[-3:-1]:
    ...     print(line)
    | greedy | 1 | plain | 4 | 50.0 | 1.00x | 12.50 | 25% |
    | greedy | 1 | ngram | 2 | 75.0 | 1.50x | 20.00 | 27% |
    >>> decode_markdown(rows, 1)[-2]
    '| greedy | 1 | ngram | 2 | 75.0 | 1.50x |'
    """
    tp = (size or 1) > 1
    plain = {(r.sampling, r.concurrency): r.decode_step_s for r in rows if r.mode == "plain"}
    lines = [
        f"## Decode steps{f' (TP={size}): forward and all-reduce' if tp else ''}",
        "",
        "Read from the verifier's /metrics before and after each mode's requests in every wave, summed per run: "
        "decode forwards, their mean time (specmesh_step_seconds) and that over plain's"
        + (
            ", and the mean time rank 0 spent in all-reduces within one "
            "(specmesh_tensor_parallel_all_reduce_seconds), with its share of the forward."
            if tp
            else "."
        ),
        "",
        "| sampling | streams | mode | decode steps | step ms | vs plain |"
        + (" all-reduce ms | all-reduce share |" if tp else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if tp else ""),
    ]
    for r in sorted(rows, key=lambda r: (r.sampling, r.concurrency, _MODE_RANK.get(r.mode, 99))):
        step = r.decode_step_s * 1e3 if r.decode_step_s is not None else None
        base = plain.get((r.sampling, r.concurrency))
        ratio = r.decode_step_s / base if r.decode_step_s is not None and base else None
        line = f"| {r.sampling} | {r.concurrency} | {r.mode} | {r.decode_steps} | {_fmt(step, '.1f')} "
        line += f"| {_fmt(ratio, '.2f', 'x')} |"
        if tp:
            reduce = r.all_reduce_s * 1e3 if r.all_reduce_s is not None else None
            line += f" {_fmt(reduce, '.2f')} | {_fmt(r.all_reduce_share, '.0%')} |"
        lines.append(line)
    return [*lines, ""]


def structured_markdown(overall: list[Row], kind: str) -> list[str]:
    """The structured-output table of a run (its modes' overall rows); none when no output was checked.

    >>> row = Row("greedy", 1, OVERALL, "ngram", 4, 10.0, speedup=1.4, acceptance_rate=0.5, schema_checked=4,
    ...           schema_valid=3, schema_invalid_at_length=1, grammar_pruned=6)
    >>> structured_markdown([row], "json")[-1]
    '| ngram | 4 | 75% (3) | 1 | 6 | 1.5 | 1.40x | 50% |'
    """
    rows = [r for r in overall if r.schema_checked]
    if not rows:
        return []
    lines = [
        "",
        f"Structured output ({kind or '?'}): each output parsed and validated against its schema (jsonschema); "
        "grammar-pruned: drafted nodes the verifier's grammar discarded before verifying (– where not reported).",
        "",
        "| mode | outputs | schema valid | invalid, cut by max tokens | grammar-pruned nodes | pruned per request "
        "| speed-up | acceptance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per = r.grammar_pruned / r.requests if r.grammar_pruned is not None and r.requests else None
        lines.append(
            f"| {r.mode} | {r.schema_checked} | {r.schema_valid / r.schema_checked:.0%} ({r.schema_valid}) "
            f"| {r.schema_invalid_at_length} | {_fmt(r.grammar_pruned, 'd')} | {_fmt(per, '.1f')} "
            f"| {_fmt(r.speedup, '.2f', 'x')} | {_fmt(r.acceptance_rate, '.0%')} |"
        )
    return lines


def _setup_lines(meta: dict) -> list[str]:
    """The warm-up and the turns, where the run had them.

    >>> warm, turns = _setup_lines({"warmup_workload": "w.jsonl", "warmup_limit": 2, "warmup_prompts": 16,
    ...                             "warmup_scopes": ["bench-1-suffix-greedy-c1"], "turns": 2})
    >>> warm[:47], "`bench-1-suffix-greedy-c1`" in warm, turns[:28]
    ('Warm-up: 16 prompts of w.jsonl (2 per category)', True, 'Multi-turn rows (mt_bench) g')
    """
    lines = []
    if meta.get("warmup_workload"):
        limit = meta.get("warmup_limit")
        scopes = meta.get("warmup_scopes") or []
        lines.append(
            f"Warm-up: {meta.get('warmup_prompts')} prompts of {meta['warmup_workload']} "
            f"({'all' if limit is None else limit} per category), sent untimed (greedy, first turns) before the "
            f"measured requests of each learning mode's run, once per cache scope: "
            + (", ".join(f"`{s}`" for s in scopes) if scopes else "none (no mode learns from outputs)")
            + ". Each such run has its own scope, so no run learns from another's outputs of the measured prompts."
        )
    if meta.get("structured"):
        lines.append(
            f"Structured-output workload `{meta['structured']}` (specmesh_bench/structured.py): every prompt's "
            "instruction appended to its first turn, the request carrying its schema; see the table after each run."
        )
    if meta.get("turns", 1) > 1:
        lines.append(
            "Multi-turn rows (mt_bench) give a second prompt too, run after every first turn: the chat [turn 1, the "
            "model's own greedy answer to it, turn 2]."
        )
    return lines


def transport_markdown(rows: list[TransportRow]) -> list[str]:
    """The "Gateway vs gRPC" section."""
    lines = [
        "## Gateway vs gRPC",
        "",
        "Every service mode ran through the HTTP gateway (openai client, SSE) and through the gRPC SDK, "
        "interleaved, on the same prompts, seeds and waves. tokens/s: median per request at 1 stream, of the "
        "wave aggregates beyond; HTTP/gRPC: paired per prompt (wave), median. SSE events carry no token count: "
        "an event's gap is spread over the tokens of usage.completion_tokens, and the gRPC ITL here is "
        "estimated alike from its chunk times (exact for plain; for speculative modes the mean is kept).",
        "",
        "| sampling | streams | mode | gRPC tok/s | HTTP tok/s | HTTP/gRPC | gRPC ITL p50 ms | HTTP ITL p50 ms "
        "| Δ ITL ms | gRPC TTFT ms | HTTP TTFT ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.sampling} | {r.concurrency} | {r.mode} | {r.grpc_tokens_per_s:.1f} | {r.http_tokens_per_s:.1f} "
            f"| {_fmt(r.ratio, '.3f')} | {_fmt(r.grpc_itl_p50_ms, '.1f')} | {_fmt(r.http_itl_p50_ms, '.1f')} "
            f"| {_fmt(r.itl_diff_ms, '+.1f')} | {_fmt(r.grpc_ttft_ms, '.0f')} | {_fmt(r.http_ttft_ms, '.0f')} |"
        )
    return [*lines, ""]


_MODE_RANK = {m: i for i, m in enumerate(("plain", "ngram", "ngram-local", "suffix", "draft", "rag", "head", "auto",
                                          "oracle", "hf-greedy", "hf-pld"))}  # fmt: skip


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(rows: list[Row], records: list[dict], out_dir: Path) -> list[Path]:
    """tokens/s per category per mode; accepted-length histogram per proposer; speed-up vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    single = [r for r in rows if r.sampling == "greedy" and r.concurrency == 1 and r.category != OVERALL]
    if single:
        cats = list(dict.fromkeys(r.category for r in single))
        modes = sorted({r.mode for r in single}, key=lambda m: _MODE_RANK.get(m, 99))
        fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(cats)), 4.5))
        width = 0.8 / len(modes)
        cell = {(r.category, r.mode): r.tokens_per_s for r in single}
        for i, m in enumerate(modes):
            xs = [j + i * width for j in range(len(cats))]
            ax.bar(xs, [cell.get((c, m), 0.0) for c in cats], width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=20)
        ax.set_ylabel("tokens/s (median, 1 stream, greedy)")
        ax.legend(fontsize=8, ncol=3)
        ax.set_title("tokens/s per category per mode")
        paths.append(_save(fig, out_dir / "tokens_per_s.png"))
    hist: dict[str, list[int]] = defaultdict(list)
    for r in records:
        counts = r.get("accepted_length_counts") or []
        if r["mode"] not in ("plain",) and counts:
            h = hist[r["mode"]]
            h.extend([0] * (len(counts) - len(h)))
            for k, n in enumerate(counts):
                h[k] += n
    if hist:
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(hist)
        for i, (m, h) in enumerate(sorted(hist.items())):
            total = sum(h) or 1
            ax.bar([k + i * width for k in range(len(h))], [n / total for n in h], width, label=m)
        ax.set_xlabel("draft tokens accepted in a verification step")
        ax.set_ylabel("share of steps with a tree")
        ax.set_title("accepted length per proposer")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_dir / "accepted_length.png"))
    overall = [r for r in rows if r.category == OVERALL and r.speedup is not None and r.mode != "plain"]
    if len({r.concurrency for r in overall}) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        for sampling in sorted({r.sampling for r in overall}):
            for m in sorted({r.mode for r in overall}, key=lambda m: _MODE_RANK.get(m, 99)):
                pts = sorted((r.concurrency, r.speedup) for r in overall if r.mode == m and r.sampling == sampling)
                if len(pts) > 1:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=f"{m} ({sampling})")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("speed-up vs plain (geo-mean over categories)")
        ax.legend(fontsize=8)
        paths.append(_save(fig, out_dir / "speedup_vs_concurrency.png"))
    return paths
