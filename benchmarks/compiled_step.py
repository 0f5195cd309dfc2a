"""torch.compile (inductor) of the CPU step, measured once against the eager step, paired.

Two verifier CPU runners on the default model: the default (eager, packed oneDNN linears, paged attention
read in place), and one whose decoder layers' MLP and post-attention norm (the dense, shape-static part
of a layer, most of its weights) are compiled by inductor with frozen weights (inductor packs the stock
linears itself; the packed ones cannot be frozen); the paged attention's per-row runs stay eager. One
plain decode step (batch 1 and 8) and one verification step (8 rows × 17 tokens) after a
``--context``-token prefix; steps alternate A, B, A, B … so drift hits both alike; the ratio is the
median of per-pair ratios with a bootstrap 95 % interval.

    .venv/bin/python benchmarks/compiled_step.py --pairs 30
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import cpu_name


def bootstrap(ratios: list[float], n: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n)]


def timed_step(runner, step) -> float:
    """Seconds of one forward (and its logits) of ``step`` over the runner's measurement rows."""
    t0 = time.perf_counter()
    runner.logits(runner.forward(runner.where, step.input_ids, step.positions, step.mask, step.write_pos))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specmesh_server.model_loading import load_model
    from specmesh_server.model_runner import ModelRunner, causal_mask
    from specmesh_server.tree import TokenTree
    from verifier_svc.step_inputs import decode_inputs

    torch._inductor.config.freezing = True
    # Every layer's MLP is the same code over other weights: one compiled graph per layer, not 8 then eager.
    torch._dynamo.config.recompile_limit = torch._dynamo.config.accumulated_recompile_limit = 256
    runners = {}
    for label, packed in (("eager", True), ("compiled", False)):
        lm = load_model(device="cpu", dtype="float32")
        runners[label] = ModelRunner(
            lm.model, lm.device, lm.dtype, 4096, linears="packed" if packed else "stock", block_size=16, lean=False
        )
    for layer in runners["compiled"].decoder.layers:
        layer.mlp.forward = torch.compile(layer.mlp.forward, dynamic=False)
        layer.post_attention_layernorm.forward = torch.compile(layer.post_attention_layernorm.forward, dynamic=False)

    cases = {"plain, batch 1": (1, 0), "plain, batch 8": (8, 0), "8 rows × 17 tokens": (8, 16)}
    print(
        f"# torch.compile of the CPU step ({cpu_name()}, {args.threads} threads, {args.pairs} pairs, "
        f"{args.context}-token context)\n"
    )
    print("| step | eager ms (median) | compiled ms (median) | compiled / eager (median of pairs) | 95 % interval |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for label, (rows, nodes) in cases.items():
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for runner in runners.values():
                runner.rows_ctx = runner.cache.measurement_rows(rows, args.context + nodes + 1)
                where = runner.where = runner.rows_ctx.__enter__()
                ids = torch.randint(
                    3, runner.vocab_size, (rows, args.context), generator=torch.Generator().manual_seed(0)
                )
                pos = torch.arange(args.context)[None].expand(rows, args.context)
                runner.forward(where, ids, pos, causal_mask(pos, args.context))
            tree = TokenTree(list(range(5, 5 + nodes)), [-1 if j % 4 == 0 else j - 1 for j in range(nodes)])
            step = decode_inputs([7] * rows, [args.context] * rows, [tree] * rows, torch.device("cpu"))

            for runner in runners.values():  # compile (once per layer and shape) and warm both
                for _ in range(3):
                    timed_step(runner, step)
            for _ in range(args.pairs):
                for name, runner in runners.items():
                    times[name].append(timed_step(runner, step))
            for runner in runners.values():
                runner.rows_ctx.__exit__(None, None, None)
            a, b = times["eager"], times["compiled"]
            ratios = [y / x for x, y in zip(a, b, strict=True)]
            lo, hi = bootstrap(ratios)
            print(
                f"| {label} | {1e3 * statistics.median(a):.2f} | {1e3 * statistics.median(b):.2f} | "
                f"{statistics.median(ratios):.3f} | {lo:.3f}–{hi:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
