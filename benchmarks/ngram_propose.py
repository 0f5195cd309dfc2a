"""Micro-benchmark: n-gram proposal latency from a 4k-token context (median of many calls).

.venv/bin/python benchmarks/ngram_propose.py
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from common import workload_rows

from specmesh_server.ngram import NgramConfig, NgramIndex

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path())
    rows = workload_rows()
    text = "\n".join(r["turns"][0] for r in rows if r["category"] in ("code_edit", "rag"))
    ids = tok.encode(text)[:4096]
    idx = NgramIndex(NgramConfig())
    t0 = time.perf_counter()
    idx.extend(ids[:-64])
    build = time.perf_counter() - t0
    times, extend = [], []
    for t in ids[-64:]:  # grow one token at a time, propose after each
        t0 = time.perf_counter()
        idx.extend([t])
        extend.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        idx.propose()
        times.append(time.perf_counter() - t0)
    print(f"context {len(idx.tokens)} tokens: index build {build * 1e3:.1f} ms once; per step: extend "
          f"{statistics.median(extend) * 1e6:.1f} us, propose median {statistics.median(times) * 1e6:.1f} us, "
          f"max {max(times) * 1e6:.1f} us")  # fmt: skip


if __name__ == "__main__":
    main()
