"""Packed against padded decode steps: one verification forward (+ logits) over a batch of ragged trees.

Each shape is a batch of rows over ``--cached`` tokens each; a row brings its pending token and a
chain of n nodes. Packed steps compute the real tokens only; padded steps pad every row to the
widest. Shapes run interleaved, ``--repeats`` times; medians in ms. The verifier packs a step only
where padding is at least a tenth of it (``verifier_svc/engine.py``).

    .venv/bin/python benchmarks/packed_steps.py --repeats 15
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import cpu_name

from specmesh_server.attention import Packing
from specmesh_server.model_loading import load_model
from specmesh_server.model_runner import ModelRunner
from specmesh_server.tree import TokenTree
from verifier_svc.step_inputs import decode_inputs, prefill_inputs, unpadded

SHAPES = {  # name → nodes per row
    "one 16-node tree beside seven 3-node trees": [16] + [3] * 7,
    "one 8-node chain beside seven plain rows": [8] + [0] * 7,
    "eight equal 4-node trees": [4] * 8,
    "one 16-node tree, 1 row": [16],
}


def chain(n: int) -> TokenTree:
    return TokenTree(list(range(2000, 2000 + n)), list(range(-1, n - 1)))


def step_ms(runner: ModelRunner, nodes: list[int], cached: int, packed: bool) -> float:
    dev, b = runner.device, len(nodes)
    trees = [chain(n) for n in nodes]
    t0 = time.perf_counter()
    step = decode_inputs([5] * b, [cached] * b, trees, dev)
    real = unpadded([n + 1 for n in nodes], dev)
    packing = Packing(*real, b, step.input_ids.shape[1]) if packed else None
    hidden = runner.forward(slice(0, b), step.input_ids, step.positions, step.mask, step.write_pos, packing)
    hidden = hidden[0] if packed else hidden[real]
    runner.logits(hidden).argmax(-1).tolist()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--cached", type=int, default=300, help="tokens cached per row before the step")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model()
    runner = ModelRunner(lm.model, lm.device, lm.dtype, max_context=4096, linears="packed")
    rows = max(len(n) for n in SHAPES.values())
    runner.cache.reserve(rows, a.cached + 64)
    first = prefill_inputs([list(range(1000, 1000 + a.cached))] * rows, [0] * rows, lm.device)
    runner.forward(slice(0, rows), first.input_ids, first.positions, first.mask)
    runs = [(name, packed) for name in SHAPES for packed in (True, False)]
    times: dict[tuple[str, bool], list[float]] = {r: [] for r in runs}
    rng = random.Random(0)
    with torch.inference_mode():
        for rep in range(a.repeats + 2):
            rng.shuffle(runs)
            for name, packed in runs:
                ms = step_ms(runner, SHAPES[name], a.cached, packed)
                if rep >= 2:  # the first two rounds warm the allocator and oneDNN
                    times[(name, packed)].append(ms)
    print(f"{cpu_name()}, {a.threads} threads, {lm.dtype}, {a.cached} cached tokens per row, median of {a.repeats}\n")
    print("| step | tokens (real / padded) | packed ms | padded ms | padded / packed |")
    print("|---|---|---|---|---|")
    for name, nodes in SHAPES.items():
        pk, pd = statistics.median(times[(name, True)]), statistics.median(times[(name, False)])
        real, padded = sum(n + 1 for n in nodes), len(nodes) * (max(nodes) + 1)
        print(f"| {name} | {real} / {padded} | {pk:.1f} | {pd:.1f} | {pd / pk:.2f}x |")


if __name__ == "__main__":
    main()
