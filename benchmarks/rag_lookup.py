"""Micro-benchmark: suffix-array build time and lookup latency of the RAG proposer on a
10-million-token corpus.

.venv/bin/python benchmarks/rag_lookup.py [--tokens 10000000] [--queries 2000] [--synthetic]

The corpus: every text of the dev workload (prompts and references) tokenized with the target's
tokenizer, then synthetic documents remixed from random spans (5-60 tokens) of that text, up to
``--tokens`` — real n-gram statistics and many long repeats, the hard case for the suffix sort.
``--synthetic`` uses Zipf-distributed tokens instead (no tokenizer needed). Lookups take the
context tail at random corpus positions (hits) and random token sequences (misses), and run the
whole proposal (longest match, occurrences, trie) with a 16-node, depth-12 budget.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import cpu_name, workload_rows

from proposer_svc.rag.lookup import CorpusIndex, RagConfig, concat_documents, propose_tree


def real_documents() -> list[np.ndarray]:
    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path())
    texts = [t for r in workload_rows() for t in [*r["turns"], r.get("reference") or ""] if t]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(x, dtype=np.uint32) for x in ids if x]


def remix(source: np.ndarray, total: int, rng: np.random.Generator, doc_len: int = 2000) -> list[np.ndarray]:
    """Documents of ``doc_len`` tokens made of random spans of ``source``."""
    docs, made = [], 0
    while made < total:
        lengths = rng.integers(5, 61, doc_len // 20)
        starts = rng.integers(0, len(source) - 61, lengths.size)
        doc = np.concatenate([source[s : s + n] for s, n in zip(starts, lengths, strict=True)])[:doc_len]
        docs.append(doc)
        made += len(doc) + 1
    return docs


def timed_lookups(index: CorpusIndex, contexts: list[list[int]], cfg: RagConfig) -> tuple[np.ndarray, float]:
    times, nodes = [], 0
    for ctx in contexts:
        t0 = time.perf_counter()
        tokens, _ = propose_tree(index, ctx, cfg, cfg.max_nodes, cfg.max_depth)
        times.append(time.perf_counter() - t0)
        nodes += len(tokens)
    return np.asarray(times) * 1e3, nodes / max(len(contexts), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=10_000_000)
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--synthetic", action="store_true", help="Zipf tokens, no tokenizer")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    if a.synthetic:
        docs = [(rng.zipf(1.2, 2000) % 49152).astype(np.uint32) for _ in range(a.tokens // 2001 + 1)]
    else:
        docs = real_documents()
        real = int(sum(len(d) + 1 for d in docs))
        docs += remix(np.concatenate(docs), a.tokens - real, rng)
    tokens = concat_documents(docs)[: a.tokens]
    print(f"{cpu_name()}; corpus {len(tokens):,} tokens in {len(docs):,} documents "
          f"({'synthetic Zipf' if a.synthetic else 'dev workload + remixed spans'})")  # fmt: skip
    t0 = time.perf_counter()
    index = CorpusIndex.build(tokens)
    print(f"suffix array build: {time.perf_counter() - t0:.1f} s")

    cfg = RagConfig()
    n = len(tokens)
    positions = rng.integers(cfg.max_match, n - 1, a.queries)
    hits = [tokens[q - 32 : q].tolist() for q in positions]
    misses = [rng.integers(0, 49152, 32).tolist() for _ in range(a.queries // 4)]
    timed_lookups(index, hits[:50], cfg)  # warm-up
    for label, contexts in (("hit contexts", hits), ("random contexts", misses)):
        ms, nodes = timed_lookups(index, contexts, cfg)
        print(f"lookup, {label} ({len(contexts)}): median {np.median(ms):.3f} ms, p99 {np.percentile(ms, 99):.3f} ms, "
              f"max {ms.max():.3f} ms; {nodes:.1f} nodes per tree")  # fmt: skip


if __name__ == "__main__":
    main()
