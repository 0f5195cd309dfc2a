"""KV memory under pressure (issue 43's capacity and long-prompt benchmarks), on a real verifier process.

    .venv/bin/python benchmarks/kv_pressure.py --out docs/bench/kv-pressure/dense-<commit>
    .venv/bin/python benchmarks/kv_pressure.py --scenarios long_beside_short --long-tokens 2000 --out /tmp/kv

Greedy requests with speculation off (``proposer none``): what is measured is the serving core — the KV
cache, admission and chunked prefill — not a proposer. The verifier is a ``specmesh.deploy``
deployment of its own (its own process, free loopback ports, a Prometheus port), one per scenario.

- **long_beside_short**: ``--short`` streams decode ``--short-tokens`` tokens each; once every one has
  streamed ``--settle`` tokens, one ``--long-tokens``-token prompt arrives. Reported: the long prompt's
  time to first token; the short streams' median gap between tokens before it arrived (a plain step) and
  their largest gap while it was in prefill, against the bound 2 × plain step + one prefill chunk (the
  chunk's time: the mean of the long prompt's prefill forwards, from ``specmesh_step_seconds``).
- **prefix_reuse**: with prefix caching on and off (a verifier each), one request at
  a time: a RAG set (one ``--rag-doc-tokens`` document, a different question each), an agent chain
  (each call the previous prompt and answer plus ~100 tokens) and two-turn conversations. Reported per
  set: time to first token of the requests whose beginning was seen before (median, on and off, and the
  paired off/on ratio with its range), end-to-end output tokens per second on and off, whether the
  outputs were equal, and the hit rate (admin stats).
- **capacity**: under ``--kv-cache-memory``, one ``--capacity-long``-token request and ``--capacity-short``
  short ones sent at once. Reported: the most requests running at once, overall and while the long one
  runs (the admin stats, polled every 50 ms), the short requests' time to first token, preemptions
  (``specmesh_preemptions_total``), the short requests' gaps between tokens (median, p99, largest) and
  how many finished.

Writes ``summary.json`` and ``summary.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common import cpu_name, workload_rows

from specmesh.client import Client
from specmesh.deploy import DeploymentConfig, LocalDeployment, free_port
from specmesh.params import SamplingParams, SpecDecodeParams
from specmesh_bench.cli import git_commit
from specmesh_bench.report import percentile

PLAIN = SpecDecodeParams(proposer="none")


@dataclass
class StreamRecord:
    """One request's token arrival times (perf_counter seconds, one per streamed chunk)."""

    name: str
    prompt_tokens: int
    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0
    output: list[int] = field(default_factory=list)
    error: str = ""

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Gaps between consecutive chunks whose later one arrived in [start, end].

        >>> r = StreamRecord("x", 1, arrivals=[1.0, 1.5, 3.0, 3.2])
        >>> r.gaps(), r.gaps(start=2.0)
        ([0.5, 1.5, 0.2], [1.5, 0.2])
        """
        a = self.arrivals
        return [round(a[i] - a[i - 1], 9) for i in range(1, len(a)) if start <= a[i] <= end]


def stream(client: Client, rec: StreamRecord, ids: list[int], max_tokens: int) -> None:
    rec.sent = time.perf_counter()
    try:
        for chunk in client.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), PLAIN):
            rec.arrivals.append(time.perf_counter())
            rec.tokens += len(chunk.token_ids)
            rec.output += chunk.token_ids
    except Exception as exc:  # recorded: a refused or failed request is a result here
        rec.error = f"{type(exc).__name__}: {str(exc)[:200]}"


class Prompts:
    """Token ids from the vendored workload: chat-templated short first turns, and raw concatenations
    of every row's text for long prompts of an exact length."""

    def __init__(self, model: str | None) -> None:
        from transformers import AutoTokenizer

        from specmesh_server.model_loading import resolve_model_path

        self.tok = AutoTokenizer.from_pretrained(resolve_model_path(model))
        rows = workload_rows()
        self.short = []
        for row in rows:
            text = self.tok.apply_chat_template(
                [{"role": "user", "content": row["turns"][0]}], add_generation_prompt=True, tokenize=False
            )
            ids = self.tok(text, add_special_tokens=False).input_ids
            if len(ids) <= 400:
                self.short.append(ids)
        self.corpus = [t for row in rows for t in self.tok(row["turns"][0], add_special_tokens=False).input_ids]

    def long(self, n: int, offset: int = 0) -> list[int]:
        reps = (n + offset) // len(self.corpus) + 1
        return (self.corpus * reps)[offset : offset + n]


def scrape(metrics_port: int, name: str, where: str = "") -> float:
    """The sum of a Prometheus sample ``name`` over its label sets that contain ``where``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    pattern = rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M) if where in m.group(1))


def preemptions(metrics_port: int) -> float:
    return scrape(metrics_port, "specmesh_preemptions_total")


def prefill_steps(metrics_port: int) -> tuple[float, float]:
    """(seconds, count) of the prefill forwards so far."""
    where = 'phase="prefill"'
    return scrape(metrics_port, "specmesh_step_seconds_sum", where), scrape(
        metrics_port, "specmesh_step_seconds_count", where
    )


def deployment(a: argparse.Namespace, extra: list[str], metrics_port: int) -> LocalDeployment:
    return LocalDeployment(
        DeploymentConfig(
            model=a.model,
            verifier_address=f"127.0.0.1:{free_port()}",
            verifier_threads=a.threads,
            ngram_address="",
            suffix_address="",
            max_running=a.max_running,
            extra_verifier_args=("--metrics-port", str(metrics_port), *a.verifier_args.split(), *extra),
        )
    )


def long_beside_short(a: argparse.Namespace, prompts: Prompts) -> dict:
    port = free_port()
    with deployment(a, [], port) as dep, Client(dep.verifier_address) as client:
        client.complete(prompts.short[0], SamplingParams(temperature=0, max_tokens=8), PLAIN)  # warm-up
        shorts = [StreamRecord(f"short{i}", len(p)) for i, p in enumerate(prompts.short[: a.short])]
        threads = [
            threading.Thread(target=stream, args=(client, r, prompts.short[i], a.short_tokens), daemon=True)
            for i, r in enumerate(shorts)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 600
        while any(r.tokens < a.settle and not r.error for r in shorts) and time.monotonic() < deadline:
            time.sleep(0.02)
        long_ids = prompts.long(a.long_tokens)
        longr = StreamRecord("long", len(long_ids))
        prefill_before = prefill_steps(port)
        sent = time.perf_counter()
        stream(client, longr, long_ids, 8)
        prefill_after = prefill_steps(port)
        first = longr.arrivals[0] if longr.arrivals else float("nan")
        for t in threads:
            t.join(timeout=900)
        before = [g for r in shorts for g in r.gaps(end=sent)]
        during = [g for r in shorts for g in r.gaps(start=sent, end=first)]
        plain_step = statistics.median(before) if before else float("nan")
        ttft = first - sent
        chunks = prefill_after[1] - prefill_before[1]  # the long prompt's chunks (nobody else prefills now)
        chunk_s = (prefill_after[0] - prefill_before[0]) / max(chunks, 1)
        bound = 2 * plain_step + chunk_s
        largest = max(during, default=float("nan"))
        return {
            "short_streams": a.short,
            "long_prompt_tokens": a.long_tokens,
            "long_ttft_s": ttft,
            "plain_step_s": plain_step,
            "prefill_chunks": int(chunks),
            "prefill_chunk_mean_s": chunk_s,
            "largest_gap_during_prefill_s": largest,
            "bound_s": bound,
            "within_bound": largest <= bound,
            "short_tokens_streamed_during_prefill": len(during),
            "preemptions": preemptions(port),
            "errors": [r.error for r in [*shorts, longr] if r.error],
        }


def capacity(a: argparse.Namespace, prompts: Prompts) -> dict:
    port = free_port()
    with deployment(a, ["--kv-cache-memory", a.kv_cache_memory], port) as dep, Client(dep.verifier_address) as c:
        c.complete(prompts.short[0], SamplingParams(temperature=0, max_tokens=8), PLAIN)  # warm-up
        long_ids = prompts.long(a.capacity_long, offset=17)
        recs = [StreamRecord("long", len(long_ids))] + [
            StreamRecord(f"short{i}", len(prompts.short[i % len(prompts.short)])) for i in range(a.capacity_short)
        ]
        inputs = [long_ids] + [prompts.short[i % len(prompts.short)] for i in range(a.capacity_short)]
        threads = [
            threading.Thread(target=stream, args=(c, r, ids, a.capacity_tokens), daemon=True)
            for r, ids in zip(recs, inputs, strict=True)
        ]
        samples: list[tuple[float, int]] = []  # (perf_counter, running requests)
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                samples.append((time.perf_counter(), c.stats().server.running_requests))
                time.sleep(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        t0 = time.perf_counter()
        poller.start()
        for t in threads:
            t.start()
            time.sleep(0.01)  # the long one first
        for t in threads:
            t.join(timeout=1800)
        stop.set()
        poller.join()
        wall = time.perf_counter() - t0
        gaps = [g for r in recs[1:] for g in r.gaps()]
        long_end = recs[0].arrivals[-1] if recs[0].arrivals else float("inf")
        beside = [n for t, n in samples if recs[0].sent <= t <= long_end]
        short_ttft = [r.arrivals[0] - r.sent for r in recs[1:] if r.arrivals]
        return {
            "kv_cache_memory": a.kv_cache_memory,
            "long_prompt_tokens": a.capacity_long,
            "short_requests": a.capacity_short,
            "max_tokens": a.capacity_tokens,
            "most_running": max((n for _, n in samples), default=0),
            "most_running_beside_long": max(beside, default=0),
            "short_ttft_median_s": statistics.median(short_ttft) if short_ttft else float("nan"),
            "short_ttft_max_s": max(short_ttft, default=float("nan")),
            "preemptions": preemptions(port),
            "short_gap_median_s": statistics.median(gaps) if gaps else float("nan"),
            "short_gap_p99_s": percentile(gaps, 99) if gaps else float("nan"),
            "short_gap_max_s": max(gaps, default=float("nan")),
            "finished": sum(1 for r in recs if not r.error and r.tokens == a.capacity_tokens),
            "requests": len(recs),
            "wall_s": wall,
            "errors": [r.error for r in recs if r.error],
        }


def prefix_sets(a: argparse.Namespace, prompts: Prompts) -> dict[str, list[list[list[int]]]]:
    """Chains of prompts, each chain run in order; a chain's later prompts repeat what came before.

    rag: one ``--rag-doc-tokens`` document, then a question, ``--rag-requests`` times (one chain each,
    the document computed by the first); agent: a growing context, each call the previous prompt, its
    answer (filled in as it runs) and ~100 new tokens; multiturn: a first turn, then the second turn
    holding the first and its answer."""
    doc = prompts.long(a.rag_doc_tokens, offset=101)
    questions = prompts.short[: a.rag_requests]
    return {
        "rag": [[doc + q] for q in questions],
        "agent": [[prompts.short[0]] + [prompts.long(100, offset=7 + 131 * k) for k in range(1, a.agent_calls)]],
        "multiturn": [[prompts.short[i], prompts.short[-1 - i]] for i in range(a.turn_pairs)],
    }


def prefix_reuse(a: argparse.Namespace, prompts: Prompts) -> dict:
    """Each set with prefix caching on, then off (one verifier each), one request at a time: time to
    first token per request (paired by request), end-to-end output tokens per second, hit rate."""
    sets = prefix_sets(a, prompts)
    runs: dict[str, dict[str, list[StreamRecord]]] = {}
    repeats: dict[str, list[bool]] = {}  # per request of a set: its beginning was computed before
    hit_rate: dict[str, float] = {}
    for caching, flag in (("on", "yes"), ("off", "no")):
        port = free_port()
        with deployment(a, ["--enable-prefix-caching", flag], port) as dep, Client(dep.verifier_address) as c:
            c.complete(prompts.short[1][:8], SamplingParams(temperature=0, max_tokens=2), PLAIN)  # warm-up
            before = (c.stats().server.prefix_cache_queries, c.stats().server.prefix_cache_hits)
            for name, chains in sets.items():
                recs = runs.setdefault(name, {}).setdefault(caching, [])
                for i, chain in enumerate(chains):
                    context: list[int] = []
                    for k, part in enumerate(chain):
                        # agent and multiturn: the previous prompt and its answer come first
                        ids = context + part if k else list(part)
                        rec = StreamRecord(f"{name}:{i}:{k}", len(ids))
                        stream(c, rec, ids, a.reuse_tokens)
                        recs.append(rec)
                        if caching == "on":
                            repeats.setdefault(name, []).append(k > 0 or (name == "rag" and i > 0))
                        context = ids + rec.output
            after = c.stats().server
            queries, hits = after.prefix_cache_queries - before[0], after.prefix_cache_hits - before[1]
            hit_rate[caching] = hits / queries if queries else 0.0
    out: dict = {"hit_rate_on": hit_rate["on"], "hit_rate_off": hit_rate["off"]}
    for name, by in runs.items():
        on, off = by["on"], by["off"]
        seen = [i for i, rep in enumerate(repeats[name]) if rep]  # the others compute what these reuse
        ttft = {k: [r.arrivals[0] - r.sent for r in v] for k, v in by.items()}
        ratios = sorted(ttft["off"][i] / ttft["on"][i] for i in seen)
        tokens = {k: sum(r.tokens for r in v) for k, v in by.items()}
        wall = {k: sum(r.arrivals[-1] - r.sent for r in v) for k, v in by.items()}
        out[name] = {
            "requests": len(on),
            "prompt_tokens_median": statistics.median(r.prompt_tokens for r in on),
            "ttft_on_s_median": statistics.median(ttft["on"][i] for i in seen),
            "ttft_off_s_median": statistics.median(ttft["off"][i] for i in seen),
            "ttft_off_over_on_median": statistics.median(ratios),
            "ttft_off_over_on_range": [ratios[0], ratios[-1]],
            "e2e_tokens_per_s_on": tokens["on"] / wall["on"],
            "e2e_tokens_per_s_off": tokens["off"] / wall["off"],
            "e2e_on_over_off": (tokens["on"] / wall["on"]) / (tokens["off"] / wall["off"]),
            "outputs_equal": all(x.output == y.output for x, y in zip(on, off, strict=True)),
        }
    return out


SCENARIOS = {"long_beside_short": long_beside_short, "capacity": capacity, "prefix_reuse": prefix_reuse}


def fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, list) and all(isinstance(x, float) for x in v):
        return "–".join(f"{x:.2f}" for x in v)
    return str(v)


def markdown(summary: dict) -> str:
    c = summary["config"]
    lines = [
        "# KV memory under pressure",
        "",
        f"- commit {summary['commit']}, {summary['machine']}, {c['threads']} torch threads",
        f"- verifier args: `{c['verifier_args'] or '(defaults)'}`; greedy, speculation off",
        "",
    ]
    for name, res in summary["scenarios"].items():
        lines += [f"## {name}", "", "| quantity | value |", "|---|---|"]
        for k, v in res.items():
            if isinstance(v, dict):
                lines += [f"| {k}: {kk} | {fmt(vv)} |" for kk, vv in v.items()]
            else:
                lines.append(f"| {k} | {fmt(v)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list of %(default)s")
    p.add_argument("--model", default=None, help="HF folder (default: the default model)")
    p.add_argument("--threads", type=int, default=2, help="the verifier's torch threads")
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--verifier-args", default="", help="more verifier flags, one string")
    p.add_argument("--short", type=int, default=7, help="long_beside_short: short streams")
    p.add_argument("--short-tokens", type=int, default=400, help="long_beside_short: tokens per short stream")
    p.add_argument("--settle", type=int, default=16, help="long_beside_short: tokens each streams before the long")
    p.add_argument("--long-tokens", type=int, default=8000, help="long_beside_short: the long prompt")
    p.add_argument("--kv-cache-memory", default="1GiB", help="capacity: the verifier's KV budget")
    p.add_argument("--capacity-long", type=int, default=6000, help="capacity: the long request's prompt")
    p.add_argument("--capacity-short", type=int, default=15, help="capacity: short requests")
    p.add_argument("--capacity-tokens", type=int, default=64, help="capacity: tokens per request")
    p.add_argument("--rag-doc-tokens", type=int, default=2000, help="prefix_reuse: the shared document")
    p.add_argument("--rag-requests", type=int, default=6, help="prefix_reuse: questions over it")
    p.add_argument("--agent-calls", type=int, default=6, help="prefix_reuse: calls in the agent chain")
    p.add_argument("--turn-pairs", type=int, default=4, help="prefix_reuse: two-turn conversations")
    p.add_argument("--reuse-tokens", type=int, default=32, help="prefix_reuse: tokens per request")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    names = a.scenarios.split(",")
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    prompts = Prompts(a.model)
    summary = {
        "commit": git_commit(),
        "machine": cpu_name(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "scenarios": {},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        t0 = time.monotonic()
        summary["scenarios"][name] = SCENARIOS[name](a, prompts)
        print(f"kv_pressure: {name} in {time.monotonic() - t0:.0f} s: {summary['scenarios'][name]}", flush=True)
        (a.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (a.out / "summary.md").write_text(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
