"""A decode step over the paged cache against the dense slot cache, per block size and way of reading
the blocks (issue 43: the cost of attention over blocks, and the block size chosen by it).

    .venv/bin/python benchmarks/paged_step.py --out docs/bench/kv-paging/paged-step.md

On the default model: ``--rows`` requests each holding ``--contexts`` cached positions; a plain decode
step (one token per row) and a verification step (one token and a 16-node chain per row), timed
``--repeats`` times each, interleaved over the variants so drift hits all alike. Variants: the dense
slot cache; the paged cache per ``--block-sizes``, attention reading the blocks in place (the CPU
default); at block size 16, the same with no two free blocks adjoining (every block its own run, the
worst fragmentation: its short runs are copied), and with the blocks gathered into a buffer (the
path before attention read blocks in place, and the one on CUDA).
Reported: the median milliseconds per step and each paged variant's median over the dense one with
its range.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import cpu_name

from specmesh_bench.cli import git_commit
from specmesh_server.kv_blocks import BlockTable
from specmesh_server.model_loading import load_model
from specmesh_server.model_runner import ModelRunner, causal_mask
from specmesh_server.tree import TokenTree
from verifier_svc.step_inputs import decode_inputs


def setup(lm, variant: tuple, rows: int, context: int) -> tuple[ModelRunner, object]:
    """A runner whose ``rows`` rows hold ``context`` prefilled positions; returns it and the rows."""
    _, block_size, in_place, scattered = variant
    runner = ModelRunner(lm.model, lm.device, lm.dtype, 8192, kv_budget_bytes=2 * 2**30, block_size=block_size)
    ids = torch.randint(0, runner.vocab_size, (rows, context))
    pos = torch.arange(context)[None].expand(rows, context)
    if block_size is None:
        runner.cache.reserve(rows, context + 64)
        where = slice(0, rows)
    else:
        runner.cache.in_place = in_place
        pool = runner.cache.manager.pool
        if scattered:  # the even blocks free, in random order, the odd ones held: no two free blocks adjoin
            taken = pool.allocate(pool.free_blocks)
            pool.release([taken[i] for i in torch.randperm(len(taken)).tolist() if taken[i] % 2 == 0])
        tables = [BlockTable(b"") for _ in range(rows)]
        for t in tables:
            runner.cache.manager.grow(t, context + 64)
        where = runner.cache.rows(tables, context + 64)
    for start in range(0, context, 512):  # prefill in chunks
        end = min(start + 512, context)
        runner.forward(where, ids[:, start:end], pos[:, start:end], causal_mask(pos[:, start:end], end))
    return runner, where


def step_seconds(runner: ModelRunner, where: object, rows: int, context: int, nodes: int) -> float:
    tree = TokenTree(list(range(100, 100 + nodes)), list(range(-1, nodes - 1)))
    step = decode_inputs([7] * rows, [context] * rows, [tree] * rows, runner.device)
    t0 = time.perf_counter()
    runner.logits(runner.forward(where, step.input_ids, step.positions, step.mask, step.write_pos))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8", help="comma list of batch sizes")
    p.add_argument("--contexts", default="512,2000", help="comma list of cached positions per row")
    p.add_argument("--block-sizes", default="8,16,64", help="comma list of paged block sizes (read in place)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="markdown report (default: print only)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    lm = load_model(None, "cpu", "float32")
    # (name, block size, in place, scattered)
    variants = [("dense", None, False, False)]
    variants += [(f"paged/{b}", int(b), True, False) for b in a.block_sizes.split(",")]
    variants += [("paged/16 scattered", 16, True, True), ("paged/16 gathered", 16, False, False)]
    lines = [
        "# Decode step: paged KV cache vs dense slot cache",
        "",
        f"- commit {git_commit()}, {cpu_name()}, {a.threads} torch threads, SmolLM2-135M fp32, {a.repeats} repeats",
        "",
        "| rows | context | step | " + " | ".join(f"{v[0]} ms" for v in variants) + " | "
        + " | ".join(f"{v[0]} / dense (range)" for v in variants[1:]) + " |",
        "|---" * (3 + 2 * len(variants) - 1) + "|",
    ]  # fmt: skip
    with torch.inference_mode():
        for rows in (int(x) for x in a.rows.split(",")):
            for context in (int(x) for x in a.contexts.split(",")):
                runners = {v: setup(lm, v, rows, context) for v in variants}
                for nodes, label in ((0, "plain"), (16, "16-node chain")):
                    times: dict = {v: [] for v in variants}
                    for _ in range(a.repeats):
                        for v in variants:  # interleaved
                            times[v].append(step_seconds(*runners[v], rows, context, nodes))
                    med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
                    dense = times[variants[0]]
                    ratios = [sorted(x / y for x, y in zip(times[v], dense, strict=True)) for v in variants[1:]]
                    cells = [f"{med[v]:.1f}" for v in variants] + [
                        f"{statistics.median(r):.3f} ({r[len(r) // 10]:.2f}–{r[-1 - len(r) // 10]:.2f})" for r in ratios
                    ]
                    lines.append(f"| {rows} | {context} | {label} | " + " | ".join(cells) + " |")
                    print(lines[-1], flush=True)
                del runners
    lines += ["", "Range: the 10th to 90th percentile of the paired per-repeat ratios."]
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
