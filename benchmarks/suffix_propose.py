"""Micro-benchmark: the suffix proposer's cost per step with a full global cache, and its memory
per cached token.

The cache is filled with ~1M tokens of real text tokenized with the target's tokenizer (the
dev workload's prompts and references, then Python standard-library source), cut into
"outputs" of 256–1024 tokens. Requests then run over held-out files (not in the cache): each
step appends 3 accepted tokens (the update: the request's context and its live entry in the
global cache) and builds a tree (the lookup), as the proposer does per Advance.

.venv/bin/python benchmarks/suffix_propose.py [--tokens 1000000]
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import numpy as np
from common import cpu_name, workload_rows

from proposer_svc.suffix.cache import SuffixCache
from proposer_svc.suffix.config import SuffixConfig
from proposer_svc.suffix.request import SuffixRequest


def _texts() -> tuple[list[str], list[str]]:
    """(texts to cache, held-out texts): the workload's prose first, then standard-library files."""
    rows = workload_rows()
    cached = [t for r in rows for t in [*r["turns"], r.get("reference") or ""] if t]
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    held_out = [f.read_text(errors="replace") for f in files[::50][:40]]
    held = set(files[::50][:40])
    cached += [f.read_text(errors="replace") for f in files if f not in held]
    return cached, held_out


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1_000_000, help="cached tokens")
    p.add_argument("--steps", type=int, default=3000)
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path())
    cached_texts, held_out = _texts()
    rng = np.random.default_rng(0)
    outputs: list[np.ndarray] = []
    total = 0
    for text in cached_texts:
        ids = np.asarray(tok.encode(text), np.int32)
        while len(ids) and total < a.tokens:
            n = int(rng.integers(256, 1025))
            outputs.append(ids[:n])
            total += len(outputs[-1])
            ids = ids[n:]
        if total >= a.tokens:
            break
    gc.collect()
    rss0 = _rss_mib()
    cache = SuffixCache(SuffixConfig(max_cached_tokens=a.tokens), background=False)
    t0 = time.perf_counter()
    for out in outputs:
        cache.ingest("", out)
    fill = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache.reindex(cache.scope(""), force=True)  # everything in the index: the state between re-indexes
    index_s = time.perf_counter() - t0
    gc.collect()
    rss1 = _rss_mib()
    structure = cache.nbytes() / cache.cached_tokens

    steps, sources, drafted = [], Counter(), 0
    for text in held_out:
        ids = tok.encode(text)
        if len(ids) < 400:
            continue
        req = SuffixRequest(cache, "")
        req.extend(ids[:200])
        for i in range(200, len(ids) - 3, 3):
            t0 = time.perf_counter()
            req.extend(ids[i : i + 3])
            prop = req.propose(32, 24)
            steps.append(time.perf_counter() - t0)
            sources[prop.source or "none"] += 1
            drafted += len(prop.tokens)
            if len(steps) >= a.steps:
                break
        req.close()
        if len(steps) >= a.steps:
            break
    us = sorted(s * 1e6 for s in steps)
    print(f"machine: {cpu_name()}")
    print(
        f"cache: {cache.cached_tokens:,} tokens in {len(outputs):,} outputs; filled in {fill:.1f} s, "
        f"indexed in {index_s:.2f} s"
    )
    print(
        f"memory per cached token: {structure:.1f} B (index + tail arrays); "
        f"process RSS grew {(rss1 - rss0) * 2**20 / cache.cached_tokens:.1f} B/token"
    )
    print(
        f"per step (extend 3 tokens + propose, {len(us)} steps): median {statistics.median(us):.1f} us, "
        f"p90 {us[int(0.9 * len(us))]:.1f} us, p99 {us[int(0.99 * len(us))]:.1f} us"
    )
    print(f"trees by source: {dict(sources)}; mean nodes {drafted / max(len(us), 1):.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
