"""Soak run (issue 14, hardening): a real stack under mixed traffic for many minutes, with the
n-gram proposer killed and restarted on the same port, greedy outputs checked against plain
decoding, every request's outcome accounted for and the verifier's memory watched.

    .venv/bin/python benchmarks/soak.py --minutes 18 --out docs/bench/soak
    .venv/bin/python benchmarks/soak.py --minutes 2 --streams 16 --kill-every 1 --down-s 10 --out /tmp/soak_smoke
    .venv/bin/python benchmarks/soak.py --verifier-args='--kv-cache-memory 2GiB' …

The stack (``specmesh.deploy.LocalDeployment``): one n-gram proposer service and one verifier
configured with it (``--proposer ngram=…``, a Prometheus port), each its own process on free
loopback ports. Before the traffic: a warm-up, then the reference outputs of a fixed set of greedy
prompts with speculation off (``proposer none``), one at a time. Then ``--streams`` client threads
(one shared gRPC channel, the blocking SDK) send requests back to back: greedy ones (always one of
the reference prompts, speculation ngram or auto; their tokens must equal the reference) and
sampled ones (temperature 0.8, top_p 0.95; short or ~1500-3000-token prompts; proposer ngram, auto
or none); some are cancelled after a few chunks, a few carry a short deadline. Every
``--kill-every`` minutes the proposer gets SIGKILL and is restarted on its port ``--down-s`` later.

Outcomes: completed (the finish summary arrived, its token count matching the chunks), cancelled
(by us), refused with a clear status (RESOURCE_EXHAUSTED, UNAVAILABLE, INVALID_ARGUMENT, or
DEADLINE_EXCEEDED of a short-deadline request) and LOST: anything else (UNKNOWN/INTERNAL, a stream
without a summary, a request past ``--request-timeout``). Writes ``summary.json``, ``summary.md``,
``records.jsonl`` (one line per request) and ``rss.csv`` to ``--out``; exits 1 when a request was
lost, a greedy output differed or the verifier died.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from common import WORKLOAD, cpu_name, workload_rows

from specmesh.client import Client
from specmesh.deploy import DeploymentConfig, LocalDeployment, free_port
from specmesh.health import wait_healthy
from specmesh.params import SamplingParams, SpecDecodeParams
from specmesh_bench.cli import git_commit
from specmesh_bench.report import percentile
from specmesh_bench.runner import first_mismatch

ROOT = Path(__file__).resolve().parents[1]
CLEAR_CODES = ("RESOURCE_EXHAUSTED", "UNAVAILABLE", "INVALID_ARGUMENT")
MIB = 1024 * 1024


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    name: str
    ids: tuple[int, ...]
    long: bool


@dataclass(frozen=True)
class GreedyCase:
    prompt: Prompt
    max_tokens: int
    reference: tuple[int, ...] = ()


class PromptBook:
    """Chat-templated token ids of the workload's first turns: short ones, long ones (single rows
    or concatenations of rows, ``long_min``-``long_max`` tokens) and the fixed greedy set."""

    def __init__(self, model: str | None, long_min: int, long_max: int, seed: int) -> None:
        from transformers import AutoTokenizer

        from specmesh_server.model_loading import resolve_model_path

        self.model_path = str(resolve_model_path(model))
        self.tok = AutoTokenizer.from_pretrained(self.model_path)
        rows = workload_rows()
        rng = random.Random(seed)
        self.short: list[Prompt] = []
        by_cat: dict[str, list[tuple[str, str, int]]] = {}
        for row in rows:
            text = row["turns"][0]
            n = len(self.encode(text))
            by_cat.setdefault(row["category"], []).append((str(row.get("id", "")), text, n))
            if n <= 800:
                self.short.append(Prompt(str(row.get("id", "")), tuple(self.encode(text)), False))
        self.long: list[Prompt] = []
        for rid, text, n in by_cat.get("rag", []):  # single long rows
            if long_min <= n <= long_max:
                self.long.append(Prompt(rid, tuple(self.encode(text)), True))
        pieces = [r for cat in ("summarization", "code_edit", "rag", "code") for r in by_cat.get(cat, [])]
        for i in range(16):  # concatenations: several tasks in one prompt, the last one to answer
            target = rng.randint(long_min, long_max)
            order = rng.sample(pieces, len(pieces))
            parts: list[str] = []
            names: list[str] = []
            ids: list[int] = []
            for rid, text, _ in order:
                cand = self._concat([*parts, text])
                if len(cand) > long_max:
                    continue
                parts.append(text)
                names.append(rid)
                ids = cand
                if len(ids) >= target:
                    break
            if len(ids) >= long_min:
                self.long.append(Prompt(f"concat{i}:" + "+".join(names), tuple(ids), True))
        if not self.short or not self.long:
            raise SystemExit(
                f"soak: the workload {WORKLOAD} gave {len(self.short)} short, {len(self.long)} long prompts"
            )
        self.greedy = self._greedy_set(by_cat)

    def encode(self, text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return list(self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))

    def _concat(self, texts: list[str]) -> list[int]:
        head = "Below are several documents and tasks, separated by lines of dashes. Do only the last task.\n\n"
        return self.encode(head + "\n\n-----\n\n".join(texts))

    def _greedy_set(self, by_cat: dict[str, list[tuple[str, str, int]]]) -> list[GreedyCase]:
        """~12 fixed prompts: the first short row of each category (a second of two of them), 3 long."""
        budgets = [32, 64, 96, 128]
        shorts: list[Prompt] = []
        for round_ in range(2):
            for cat in sorted(by_cat):
                fitting = [(rid, text) for rid, text, n in by_cat[cat] if 8 <= n <= 400]
                if round_ < len(fitting) and (round_ == 0 or cat in ("code_edit", "summarization")):
                    rid, text = fitting[round_]
                    shorts.append(Prompt(rid, tuple(self.encode(text)), False))
        longs = sorted(self.long, key=lambda p: len(p.ids))
        picked_long = [longs[0], longs[len(longs) // 2], longs[-1]]
        cases = [GreedyCase(p, budgets[i % len(budgets)]) for i, p in enumerate(shorts)]
        cases += [GreedyCase(p, 64) for p in picked_long]
        return cases


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


@dataclass
class Plan:
    rid: str
    stream: int
    kind: str  # greedy | sampled
    prompt: Prompt
    sampling: SamplingParams
    proposer: str
    cancel_after: int = 0  # chunks; 0 = no cancellation
    deadline_s: float = 0.0  # a short deadline; 0 = the generous --request-timeout
    greedy_index: int = -1


@dataclass
class Record:
    rid: str
    stream: int
    kind: str
    prompt: str
    prompt_tokens: int
    long: bool
    max_tokens: int
    proposer: str
    cancel_after: int
    deadline_s: float
    t_start: float  # seconds since the traffic started
    t_end: float = 0.0
    ttft_s: float | None = None
    outcome: str = ""  # completed | cancelled | refused | lost
    code: str = ""
    reason: str = ""
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    fallback_reason: str = ""
    finish_reason: str = ""
    greedy_index: int = -1
    greedy_equal: bool | None = None
    greedy_divergence: int | None = None
    during_outage: bool = False
    token_ids: list[int] = field(default_factory=list, repr=False)


def run_request(client: Client, plan: Plan, t0: float, request_timeout: float) -> Record:
    rec = Record(
        plan.rid, plan.stream, plan.kind, plan.prompt.name, len(plan.prompt.ids), plan.prompt.long,
        plan.sampling.max_tokens or 0, plan.proposer, plan.cancel_after, plan.deadline_s,
        time.monotonic() - t0, greedy_index=plan.greedy_index,
    )  # fmt: skip
    start = time.monotonic()
    chunks = 0
    try:
        stream = client.generate(
            list(plan.prompt.ids),
            plan.sampling,
            SpecDecodeParams(proposer=plan.proposer),
            request_id=plan.rid,
            timeout=plan.deadline_s or request_timeout,
        )
        cancelled = False
        for chunk in stream:
            if rec.ttft_s is None:
                rec.ttft_s = time.monotonic() - start
            rec.token_ids.extend(chunk.token_ids)
            chunks += 1
            if plan.cancel_after and chunks >= plan.cancel_after:
                stream.cancel()
                cancelled = True
                break
        s = stream.summary
        if cancelled:
            rec.outcome = "cancelled"
        elif s is None:
            rec.outcome, rec.reason = "lost", "the stream ended without a summary"
        elif s.completion_tokens != len(rec.token_ids):
            rec.outcome = "lost"
            rec.reason = f"summary says {s.completion_tokens} tokens, {len(rec.token_ids)} arrived"
        else:
            rec.outcome = "completed"
        if s is not None:
            rec.finish_reason = s.finish_reason
            rec.drafted = s.speculation.drafted_tokens
            rec.accepted = s.speculation.accepted_tokens
            rec.fallback_reason = s.speculation.fallback_reason
    except grpc.RpcError as exc:
        code = exc.code().name if exc.code() is not None else "NONE"
        rec.code, rec.reason = code, (exc.details() or "")[:300]
        if code in CLEAR_CODES or (code == "DEADLINE_EXCEEDED" and plan.deadline_s):  # our short deadline
            rec.outcome = "refused"
        elif code == "DEADLINE_EXCEEDED":
            rec.outcome, rec.reason = "lost", f"no end after {request_timeout:.0f} s (hang): {rec.reason}"
        else:
            rec.outcome = "lost"
    except Exception as exc:  # a client-side surprise is a lost request too, never a dead stream thread
        rec.outcome, rec.code, rec.reason = "lost", type(exc).__name__, str(exc)[:300]
    rec.t_end = time.monotonic() - t0
    rec.tokens = len(rec.token_ids)
    return rec


class Traffic:
    """The request mix; one ``random.Random`` per stream thread, seeded by its index."""

    def __init__(self, book: PromptBook, a: argparse.Namespace) -> None:
        self.book, self.a = book, a
        self._n = 0
        self._lock = threading.Lock()

    def next_id(self, stream: int) -> str:
        with self._lock:
            self._n += 1
            return f"soak-{self._n:06d}-s{stream}"

    def plan(self, rng: random.Random, stream: int) -> Plan:
        a = self.a
        rid = self.next_id(stream)
        cancel_after = rng.randint(1, 8) if rng.random() < a.cancel_frac else 0
        deadline = round(rng.uniform(0.3, a.short_deadline_s), 2) if rng.random() < a.deadline_frac else 0.0
        if rng.random() < a.greedy_frac:
            gi = rng.randrange(len(self.book.greedy))
            case = self.book.greedy[gi]
            proposer = "ngram" if rng.random() < 0.7 else "auto"
            sampling = SamplingParams(temperature=0.0, max_tokens=case.max_tokens)
            return Plan(rid, stream, "greedy", case.prompt, sampling, proposer, cancel_after, deadline, gi)
        pool = self.book.long if rng.random() < a.long_frac else self.book.short
        prompt = rng.choice(pool)
        r = rng.random()
        proposer = "ngram" if r < 0.6 else "auto" if r < 0.85 else "none"
        sampling = SamplingParams(
            temperature=0.8, top_p=0.95, seed=rng.randrange(2**31), max_tokens=rng.randint(32, 128)
        )
        return Plan(rid, stream, "sampled", prompt, sampling, proposer, cancel_after, deadline)


# --------------------------------------------------------------------------------------------
# The stack: memory sampling, the proposer's outages, logs, metrics
# --------------------------------------------------------------------------------------------


class RssSampler(threading.Thread):
    """Resident memory of the verifier (and the proposer) every ``interval`` seconds."""

    def __init__(self, dep: LocalDeployment, interval: float, t0: float) -> None:
        super().__init__(daemon=True, name="rss")
        self.dep, self.interval, self.t0 = dep, interval, t0
        self.samples: list[tuple[float, int, int]] = []  # (t, verifier bytes, proposer bytes)
        self.stop = threading.Event()

    def sample(self) -> tuple[float, int, int]:
        s = (time.monotonic() - self.t0, rss(self.dep, "verifier"), rss(self.dep, "ngram"))
        self.samples.append(s)
        return s

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sample()


def rss(dep: LocalDeployment, name: str) -> int:
    """Bytes resident of the service's process and its children (0 when it is not running)."""
    proc = dep.services_by_name[name].proc
    if proc is None or proc.poll() is not None:
        return 0
    try:
        import psutil

        p = psutil.Process(proc.pid)
        return p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
    except ImportError:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        m = re.search(r"VmRSS:\s+(\d+) kB", status)
        return int(m.group(1)) * 1024 if m else 0
    except Exception:  # it exited between poll() and the read
        return 0


@dataclass
class Outage:
    killed: float  # seconds since the traffic started
    restarted: float = 0.0  # the new process started
    healthy: float = 0.0  # it answered SERVING
    old_pid: int = 0
    new_pid: int = 0
    error: str = ""


class ProposerKiller(threading.Thread):
    """SIGKILL the n-gram proposer every ``every_s``; start it again on its port ``down_s`` later."""

    def __init__(self, dep: LocalDeployment, every_s: float, down_s: float, t0: float, end: float) -> None:
        super().__init__(daemon=True, name="killer")
        self.dep, self.every_s, self.down_s, self.t0, self.end = dep, every_s, down_s, t0, end
        self.outages: list[Outage] = []
        self.stop = threading.Event()

    def run(self) -> None:
        if self.every_s <= 0:
            return
        k = 1
        while True:
            at = self.t0 + k * self.every_s
            if at >= self.end or self.stop.wait(max(at - time.monotonic(), 0)):
                return
            svc = self.dep.services_by_name["ngram"]
            assert svc.proc is not None and svc.log_path is not None
            out = Outage(time.monotonic() - self.t0, old_pid=svc.proc.pid)
            self.outages.append(out)
            if svc.proc.poll() is None:
                svc.proc.send_signal(signal.SIGKILL)
            svc.proc.wait()
            log(f"proposer killed (pid {out.old_pid}) at t={out.killed:.0f} s")
            self.stop.wait(self.down_s)  # restarted even when the traffic has ended meanwhile
            with svc.log_path.open("ab") as f:
                f.write(f"\n===== soak: restarted after SIGKILL of pid {out.old_pid} =====\n".encode())
                f.flush()
                svc.proc = subprocess.Popen(svc.argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            out.restarted, out.new_pid = time.monotonic() - self.t0, svc.proc.pid
            try:
                wait_healthy(svc.address, 120, svc.proc)
                out.healthy = time.monotonic() - self.t0
                log(f"proposer restarted on {svc.address} (pid {out.new_pid}), healthy at t={out.healthy:.0f} s")
            except (RuntimeError, TimeoutError) as exc:
                out.error = str(exc)
                log(f"proposer restart FAILED: {exc}")
                return
            k += 1


def read_metrics(port: int) -> dict[str, dict[str, float]]:
    """specmesh_requests_total and specmesh_fallbacks_total from the verifier's /metrics, by labels."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError as exc:
        return {"error": {str(exc): 0.0}}
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = re.match(r"^(specmesh_requests_total|specmesh_fallbacks_total)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            labels = ",".join(f"{k}={v}" for k, v in re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.setdefault(m.group(1), {})[labels] = float(m.group(3))
    return out


def log_problems(path: Path, max_excerpts: int = 5) -> dict[str, Any]:
    """Tracebacks and ERROR/CRITICAL lines of a service log, with the first few tracebacks."""
    if not path.exists():
        return {"log": str(path), "missing": True}
    lines = path.read_text(errors="replace").splitlines()
    excerpts, i = [], 0
    tracebacks = 0
    while i < len(lines):
        if lines[i].startswith("Traceback"):
            tracebacks += 1
            j = i + 1
            while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()):
                j += 1
            if len(excerpts) < max_excerpts:
                excerpts.append("\n".join(lines[max(i - 2, 0) : j + 1][-60:]))
            i = j
        i += 1
    errors = Counter(
        re.sub(r"^\S+ \S+ ", "", ln)[:160] for ln in lines if " ERROR " in ln or " CRITICAL " in ln
    )  # asctime, then the message: same message = same line
    warnings = Counter(re.sub(r"^\S+ \S+ ", "", ln)[:160] for ln in lines if " WARNING " in ln)
    return {
        "log": str(path),
        "tracebacks": tracebacks,
        "error_lines": sum(errors.values()),
        "top_errors": errors.most_common(8),
        "warning_lines": sum(warnings.values()),
        "top_warnings": warnings.most_common(8),
        "traceback_excerpts": excerpts,
    }


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` in [0, 1]; None without values."""
    return percentile(values, q * 100) if values else None


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=18.0, help="traffic duration")
    p.add_argument("--streams", type=int, default=24, help="concurrent client streams (threads)")
    p.add_argument("--kill-every", type=float, default=4.0, help="minutes between SIGKILLs of the proposer; 0 = never")
    p.add_argument("--down-s", type=float, default=20.0, help="seconds the proposer stays down")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "soak", help="output folder")
    p.add_argument("--log-dir", type=Path, default=None, help="service logs; None = a new folder in /tmp (kept)")
    p.add_argument("--model", default=None, help="HF folder or .gguf; None = SmolLM2-135M-Instruct")
    p.add_argument("--max-running", type=int, default=16, help="the verifier's --max-running")
    p.add_argument("--threads", type=int, default=0, help="the verifier's torch threads (0 = torch's default)")
    p.add_argument(
        "--verifier-args",
        action="append",
        default=[],
        help="extra verifier flags, shell-split, repeatable; give the value with '=' when it starts with "
        "'-': --verifier-args='--kv-cache-memory 2GiB --spec-gating always'",
    )
    p.add_argument("--greedy-frac", type=float, default=0.35, help="share of greedy (checked) requests")
    p.add_argument("--long-frac", type=float, default=0.2, help="share of sampled requests with a long prompt")
    p.add_argument("--long-min", type=int, default=1500, help="long prompts: fewest tokens")
    p.add_argument("--long-max", type=int, default=3000, help="long prompts: most tokens")
    p.add_argument("--cancel-frac", type=float, default=0.10, help="share cancelled after 1-8 chunks")
    p.add_argument("--deadline-frac", type=float, default=0.03, help="share with a short deadline")
    p.add_argument("--short-deadline-s", type=float, default=3.0, help="short deadlines: 0.3 s to this")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="a request without an end after this long is a hang (lost); on a 2-core CPU a long prompt queued "
        "behind 16 running ones takes minutes",
    )
    p.add_argument("--rss-interval", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle seconds before the start and the end RSS")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.streams < 1 or a.minutes <= 0:
        p.error("--streams and --minutes must be positive")
    a.extra_verifier_args = [x for chunk in a.verifier_args for x in shlex.split(chunk)]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    log_dir = a.log_dir or Path(tempfile.mkdtemp(prefix="specmesh-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log("tokenizing the workload prompts …")
    book = PromptBook(a.model, a.long_min, a.long_max, a.seed)
    log(
        f"{len(book.short)} short prompts, {len(book.long)} long ones "
        f"({min(len(p.ids) for p in book.long)}-{max(len(p.ids) for p in book.long)} tokens), "
        f"{len(book.greedy)} greedy reference prompts"
    )
    metrics_port = free_port()
    dep = LocalDeployment(
        DeploymentConfig(
            model=book.model_path,
            verifier_address=f"127.0.0.1:{free_port()}",
            verifier_threads=a.threads,
            ngram_address=f"127.0.0.1:{free_port()}",
            gateway_address="",
            max_running=a.max_running,
            extra_verifier_args=("--metrics-port", str(metrics_port), *a.extra_verifier_args),
            run_dir=log_dir,
        )
    )
    log(f"starting the stack (logs in {log_dir}) …")
    t_setup = time.monotonic()
    dep.start()
    log(f"stack up in {time.monotonic() - t_setup:.0f} s: " + ", ".join(f"{s.name} {s.address}" for s in dep.services))
    interrupted = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: interrupted.set())
    try:
        return soak(a, book, dep, metrics_port, log_dir, interrupted)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        log("stopping the stack …")
        dep.stop()


def soak(
    a: argparse.Namespace,
    book: PromptBook,
    dep: LocalDeployment,
    metrics_port: int,
    log_dir: Path,
    interrupted: threading.Event,
) -> int:
    client = Client(dep.verifier_address)
    server = client.stats().server
    # Warm-up: every proposer mode once, a long prompt once.
    for proposer in ("none", "ngram", "auto"):
        client.complete(list(book.short[0].ids), SamplingParams(temperature=0.0, max_tokens=8),
                        SpecDecodeParams(proposer=proposer), timeout=a.request_timeout)  # fmt: skip
    client.complete(list(book.long[0].ids), SamplingParams(temperature=0.0, max_tokens=4),
                    SpecDecodeParams(proposer="ngram"), timeout=a.request_timeout)  # fmt: skip

    log(f"reference outputs of {len(book.greedy)} greedy prompts, speculation off, one at a time …")
    t_ref = time.monotonic()
    refs = []
    for case in book.greedy:
        out = client.complete(list(case.prompt.ids), SamplingParams(temperature=0.0, max_tokens=case.max_tokens),
                              SpecDecodeParams(proposer="none"), timeout=a.request_timeout)  # fmt: skip
        refs.append(GreedyCase(case.prompt, case.max_tokens, tuple(out.token_ids)))
    book.greedy = refs
    ref_s = time.monotonic() - t_ref
    log(f"references done in {ref_s:.0f} s")

    time.sleep(a.idle_s)  # the start RSS after the same idle time as the end one (the KV cache shrinks when idle)
    t0 = time.monotonic()
    sampler = RssSampler(dep, a.rss_interval, t0)
    rss_start = sampler.sample()
    sampler.start()
    end = t0 + a.minutes * 60
    killer = ProposerKiller(dep, a.kill_every * 60, a.down_s, t0, end)
    killer.start()
    traffic = Traffic(book, a)
    records: list[Record] = []
    rec_lock = threading.Lock()
    verifier = dep.services_by_name["verifier"]

    def stream_loop(i: int) -> None:
        rng = random.Random(a.seed * 1000 + i)
        while time.monotonic() < end and not interrupted.is_set() and verifier.proc.poll() is None:
            plan = traffic.plan(rng, i)
            rec = run_request(client, plan, t0, a.request_timeout)
            with rec_lock:
                records.append(rec)

    log(f"traffic: {a.streams} streams for {a.minutes:g} min, proposer SIGKILL every {a.kill_every:g} min …")
    threads = [threading.Thread(target=stream_loop, args=(i,), daemon=True, name=f"s{i}") for i in range(a.streams)]
    for t in threads:
        t.start()
    last_report = time.monotonic()
    while any(t.is_alive() for t in threads) and time.monotonic() < end + a.request_timeout + 60:
        time.sleep(1.0)
        if verifier.proc.poll() is not None:
            log(f"the verifier EXITED with code {verifier.proc.returncode}")
            break
        if time.monotonic() - last_report >= 30:
            last_report = time.monotonic()
            with rec_lock:
                c = Counter(r.outcome for r in records)
            rss_now = sampler.samples[-1][1] / MIB if sampler.samples else 0
            log(f"t={last_report - t0:4.0f} s  {dict(c)}  verifier RSS {rss_now:.0f} MiB")
    hung = [t.name for t in threads if t.is_alive()]
    t_traffic_end = time.monotonic()
    killer.stop.set()
    killer.join(timeout=a.down_s + 150)
    log(f"traffic over after {t_traffic_end - t0:.0f} s; idle {a.idle_s:g} s before the end RSS …")
    time.sleep(a.idle_s)
    rss_end = sampler.sample()
    sampler.stop.set()
    metrics = read_metrics(metrics_port) if verifier.proc.poll() is None else {}
    mismatches = diagnose_mismatches(client, book, records) if verifier.proc.poll() is None else []
    client.close()

    summary = summarize(
        a, book, dep, server, records, killer.outages, sampler.samples, rss_start, rss_end, t0, t_traffic_end,
        hung, metrics, mismatches, ref_s, log_dir,
    )  # fmt: skip
    summary["interrupted"] = interrupted.is_set()
    write_outputs(a.out, summary, records, sampler.samples)
    print(markdown(summary))
    log(f"wrote {a.out}/summary.json, summary.md, records.jsonl, rss.csv; service logs in {log_dir}")
    bad = summary["outcomes"]["lost"] or summary["greedy"]["differing"] or summary["verifier_exit_code"] is not None
    return 1 if bad else 0


def diagnose_mismatches(client: Client, book: PromptBook, records: list[Record]) -> list[dict]:
    """For each distinct (prompt, divergence index): the target's two most likely tokens there (plain
    decoding, logprobs), to tell a near-tie flip from a real bug."""
    seen: dict[tuple[int, int], dict] = {}
    for r in records:
        if r.greedy_equal is False and r.greedy_divergence is not None:
            key = (r.greedy_index, r.greedy_divergence)
            entry = seen.setdefault(key, {"greedy_index": key[0], "index": key[1], "requests": [], "got": []})
            entry["requests"].append(r.rid)
            entry["got"].append(r.token_ids[key[1]] if key[1] < len(r.token_ids) else None)
    out = []
    for (gi, n), entry in list(seen.items())[:20]:
        case = book.greedy[gi]
        entry["prompt"] = case.prompt.name
        entry["want"] = case.reference[n] if n < len(case.reference) else None
        try:
            res = client.complete(
                [*case.prompt.ids, *case.reference[:n]],
                SamplingParams(temperature=0.0, max_tokens=1, logprobs=2),
                SpecDecodeParams(proposer="none"),
                timeout=120,
            )
            top = res.logprobs[0].top if res.logprobs else ()
            entry["top2"] = [(t.token_id, t.logprob) for t in top[:2]]
            if len(top) >= 2:
                entry["top2_margin"] = top[0].logprob - top[1].logprob
        except grpc.RpcError as exc:
            entry["top2_error"] = f"{exc.code().name}: {exc.details()}"
        out.append(entry)
    return out


def summarize(
    a: argparse.Namespace,
    book: PromptBook,
    dep: LocalDeployment,
    server: Any,
    records: list[Record],
    outages: list[Outage],
    samples: list[tuple[float, int, int]],
    rss_start: tuple[float, int, int],
    rss_end: tuple[float, int, int],
    t0: float,
    t_traffic_end: float,
    hung: list[str],
    metrics: dict,
    mismatches: list[dict],
    ref_s: float,
    log_dir: Path,
) -> dict[str, Any]:
    windows = [(o.killed, o.healthy or math.inf) for o in outages]
    for r in records:
        r.during_outage = any(r.t_start < hi and r.t_end > lo for lo, hi in windows)
        if r.kind == "greedy" and r.outcome == "completed":
            ref = book.greedy[r.greedy_index].reference
            n = first_mismatch(ref, r.token_ids)
            r.greedy_equal, r.greedy_divergence = n is None, n
    outcomes = Counter(r.outcome for r in records)
    refused = Counter(r.code for r in records if r.outcome == "refused")
    lost = [r for r in records if r.outcome == "lost"]
    traffic_s = t_traffic_end - t0
    completed = [r for r in records if r.outcome == "completed"]
    greedy = [r for r in records if r.greedy_equal is not None]
    differing = [r for r in greedy if not r.greedy_equal]
    by_prompt = Counter(r.greedy_index for r in greedy)
    in_outage = [r for r in records if r.during_outage]
    verifier = dep.services_by_name["verifier"].proc
    traffic_samples = [s for s in samples if s[0] >= rss_start[0]]
    for o in outages:  # recovery: the first n-gram request started after the restart that drafted
        after = [r for r in completed if r.proposer == "ngram" and o.healthy and r.t_start >= o.healthy]
        drafted = [r.t_start - o.healthy for r in after if r.drafted > 0]
        o.__dict__["ngram_requests_after"] = len(after)
        o.__dict__["first_drafting_request_after_s"] = min(drafted) if drafted else None
    ngram_out = [r for r in in_outage if r.proposer == "ngram"]
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_commit": git_commit(),
        "cpu": cpu_name(),
        "model": server.model,
        "device": server.device,
        "dtype": server.dtype,
        "config": {
            "minutes": a.minutes,
            "streams": a.streams,
            "kill_every_min": a.kill_every,
            "down_s": a.down_s,
            "max_running": a.max_running,
            "threads": a.threads,
            "extra_verifier_args": a.extra_verifier_args,
            "greedy_frac": a.greedy_frac,
            "long_frac": a.long_frac,
            "cancel_frac": a.cancel_frac,
            "deadline_frac": a.deadline_frac,
            "request_timeout_s": a.request_timeout,
            "seed": a.seed,
            "workload": str(WORKLOAD),
            "prompts": {
                "short": len(book.short),
                "long": len(book.long),
                "long_tokens": [min(len(p.ids) for p in book.long), max(len(p.ids) for p in book.long)],
            },
        },
        "traffic_s": round(traffic_s, 1),
        "references_s": round(ref_s, 1),
        "outcomes": {
            "sent": len(records),
            "completed": outcomes["completed"],
            "cancelled": outcomes["cancelled"],
            "refused": dict(refused),
            "lost": len(lost) + len(hung),
            "hung_streams": hung,
        },
        "lost_requests": [
            {
                k: getattr(r, k)
                for k in (
                    "rid",
                    "kind",
                    "proposer",
                    "prompt",
                    "prompt_tokens",
                    "code",
                    "reason",
                    "t_start",
                    "t_end",
                    "tokens",
                    "during_outage",
                )
            }
            for r in lost[:50]
        ],
        "by_kind": {
            f"{kind}/{prop}": dict(Counter(r.outcome for r in records if r.kind == kind and r.proposer == prop))
            for kind in ("greedy", "sampled")
            for prop in ("ngram", "auto", "none")
            if any(r.kind == kind and r.proposer == prop for r in records)
        },
        "long_prompts": dict(Counter(r.outcome for r in records if r.long)),
        "short_deadline": dict(Counter(r.code or r.outcome for r in records if r.deadline_s)),
        "during_outage": {
            "requests": len(in_outage),
            "outcomes": dict(Counter(r.code or r.outcome for r in in_outage)),
            "ngram_requests": len(ngram_out),
            "ngram_outcomes": dict(Counter(r.code or r.outcome for r in ngram_out)),
            "ngram_fallback_reasons": dict(Counter(r.fallback_reason for r in ngram_out if r.fallback_reason)),
        },
        "greedy": {
            "reference_prompts": [
                {
                    "name": c.prompt.name,
                    "prompt_tokens": len(c.prompt.ids),
                    "max_tokens": c.max_tokens,
                    "reference_tokens": len(c.reference),
                    "compared": by_prompt[i],
                }
                for i, c in enumerate(book.greedy)
            ],
            "compared": len(greedy),
            "equal": len(greedy) - len(differing),
            "differing": len(differing),
            "compared_with_drafting": sum(r.drafted > 0 for r in greedy),
            "compared_during_outage": sum(r.during_outage for r in greedy),
            "differences": [
                {
                    "rid": r.rid,
                    "prompt": book.greedy[r.greedy_index].prompt.name,
                    "proposer": r.proposer,
                    "first_divergence": r.greedy_divergence,
                    "tokens": r.tokens,
                    "reference_tokens": len(book.greedy[r.greedy_index].reference),
                    "drafted": r.drafted,
                    "during_outage": r.during_outage,
                }
                for r in differing[:50]
            ],
            "divergence_diagnosis": mismatches,
        },
        "throughput": {
            "tokens_received": sum(r.tokens for r in records),
            "tokens_per_s": round(sum(r.tokens for r in records) / traffic_s, 2),
            "completed_tokens_per_s": round(sum(r.tokens for r in completed) / traffic_s, 2),
            "requests_per_min": round(len(records) / traffic_s * 60, 1),
            "drafted_tokens": sum(r.drafted for r in completed),
            "accepted_tokens": sum(r.accepted for r in completed),
            "latency_s": {
                "ttft_p50": pct([r.ttft_s for r in completed if r.ttft_s is not None], 0.5),
                "ttft_p95": pct([r.ttft_s for r in completed if r.ttft_s is not None], 0.95),
                "total_p50": pct([r.t_end - r.t_start for r in completed], 0.5),
                "total_p95": pct([r.t_end - r.t_start for r in completed], 0.95),
                "total_max": max((r.t_end - r.t_start for r in records), default=None),
            },
        },
        "rss_mib": {
            "verifier_start": round(rss_start[1] / MIB, 1),
            "verifier_peak": round(max(s[1] for s in traffic_samples) / MIB, 1),
            "verifier_end": round(rss_end[1] / MIB, 1),
            "verifier_median_during": round(statistics.median(s[1] for s in traffic_samples) / MIB, 1),
            "proposer_peak": round(max(s[2] for s in traffic_samples) / MIB, 1),
            "samples": len(samples),
            "interval_s": a.rss_interval,
        },
        "proposer_outages": [o.__dict__ for o in outages],
        "verifier_metrics": metrics,
        "verifier_exit_code": verifier.returncode if verifier.poll() is not None else None,
        "logs": {
            "dir": str(log_dir),
            "verifier": log_problems(log_dir / "verifier.log"),
            "ngram": log_problems(log_dir / "ngram.log"),
        },
    }


def write_outputs(out: Path, summary: dict, records: list[Record], samples: list[tuple[float, int, int]]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "summary.md").write_text(markdown(summary))
    with (out / "records.jsonl").open("w") as f:
        for r in sorted(records, key=lambda r: r.t_start):
            d = {k: v for k, v in r.__dict__.items() if k != "token_ids"}
            f.write(json.dumps(d) + "\n")
    with (out / "rss.csv").open("w") as f:
        f.write("t_s,verifier_rss_mib,proposer_rss_mib\n")
        for t, v, p in samples:
            f.write(f"{t:.1f},{v / MIB:.1f},{p / MIB:.1f}\n")


def markdown(s: dict) -> str:
    o, g, th, m = s["outcomes"], s["greedy"], s["throughput"], s["rss_mib"]
    c = s["config"]
    refused = ", ".join(f"{k} {v}" for k, v in sorted(o["refused"].items())) or "none"
    lines = [
        "# Soak run",
        "",
        f"{s['started']} · `{s['command']}` · commit {s['git_commit'][:12]}",
        f"{s['model']} on {s['device']} ({s['dtype']}), {s['cpu']}; "
        f"{c['streams']} streams for {c['minutes']:g} min, --max-running {c['max_running']}"
        + (f", verifier args `{' '.join(c['extra_verifier_args'])}`" if c["extra_verifier_args"] else "")
        + f"; n-gram proposer SIGKILLed every {c['kill_every_min']:g} min, down {c['down_s']:g} s.",
        "",
        "| | |",
        "|---|---|",
        f"| requests sent | {o['sent']} |",
        f"| completed | {o['completed']} |",
        f"| cancelled (by the client, intended) | {o['cancelled']} |",
        f"| refused with a clear status | {refused} |",
        f"| **lost** | **{o['lost']}** |",
        f"| greedy outputs compared with plain decoding | {g['compared']} ({g['compared_with_drafting']} drafted, "
        f"{g['compared_during_outage']} during an outage) |",
        f"| greedy outputs equal / **differing** | {g['equal']} / **{g['differing']}** |",
        f"| requests overlapping a proposer outage | {s['during_outage']['requests']}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(s["during_outage"]["outcomes"].items()))
        + " |",
        f"| tokens/s (all streams; completed only) | {th['tokens_per_s']:.1f}; {th['completed_tokens_per_s']:.1f} |",
        f"| requests/min | {th['requests_per_min']:.1f} |",
        f"| completed: TTFT p50 / p95, total p50 / p95 (s) | {_f(th['latency_s']['ttft_p50'])} / "
        f"{_f(th['latency_s']['ttft_p95'])}, {_f(th['latency_s']['total_p50'])} / "
        f"{_f(th['latency_s']['total_p95'])} |",
        f"| verifier RSS start / peak / end (MiB) | {m['verifier_start']:.0f} / {m['verifier_peak']:.0f} / "
        f"{m['verifier_end']:.0f} |",
        f"| verifier exit code (None = still running at the end) | {s['verifier_exit_code']} |",
    ]
    lines += ["", "Proposer outages (seconds since the traffic started):", ""]
    lines += ["| killed | restarted | healthy | first drafting n-gram request after (s) |", "|---|---|---|---|"]
    for out in s["proposer_outages"]:
        first = out.get("first_drafting_request_after_s")
        lines.append(
            f"| {out['killed']:.0f} | {out['restarted']:.0f} | {out['healthy']:.0f}"
            + (f" (error: {out['error']})" if out["error"] else "")
            + f" | {_f(first)} |"
        )
    req = s["verifier_metrics"].get("specmesh_requests_total", {})
    if req:
        lines += ["", "Verifier `specmesh_requests_total`: " + ", ".join(f"{k} {v:g}" for k, v in sorted(req.items()))]
    for name in ("verifier", "ngram"):
        lp = s["logs"][name]
        if not lp.get("missing"):
            lines.append(
                f"\n{name} log: {lp['tracebacks']} tracebacks, {lp['error_lines']} ERROR lines, "
                f"{lp['warning_lines']} WARNING lines"
            )
    if g["differences"]:
        lines += ["", "Greedy differences (first divergence index):", ""]
        lines += [
            f"- {d['rid']} {d['prompt']} ({d['proposer']}): token {d['first_divergence']}" for d in g["differences"]
        ]
    for d in g["divergence_diagnosis"]:
        lines.append(
            f"- at {d['prompt']} token {d['index']}: want {d['want']}, got {sorted(set(map(str, d['got'])))}; "
            f"the target's top-2 there {d.get('top2', d.get('top2_error'))} "
            f"(margin {d.get('top2_margin', float('nan')):.3g})"
        )
    if s["lost_requests"]:
        lines += ["", "Lost requests:", ""]
        lines += [f"- {r['rid']} ({r['kind']}, {r['proposer']}): {r['code']} {r['reason']}" for r in s["lost_requests"]]
    return "\n".join(lines) + "\n"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
