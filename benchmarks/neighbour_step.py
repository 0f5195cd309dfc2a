"""The CPU verifier's plain step beside a busy neighbour: fixed torch threads against ``--adaptive-threads``.

    .venv/bin/python benchmarks/neighbour_step.py --seconds 40

Two runners over the same model (float32, ``--linears gemv``, the lean forward): one with the threads
fixed at ``--threads``, one with a ``ThreadBudget`` (what ``--adaptive-threads`` gives the verifier).
Their batch-1 decode steps alternate (paired) for ``--seconds`` each: first on a quiet machine, then
beside ``--neighbours`` processes that each keep one core busy (a Python loop at nice 0, as a compile
job would). Reports each condition's median step, the fixed / adaptive ratio (median of pairs, 95 %
bootstrap interval), and the cost of the neighbour: adaptive beside it over fixed on the quiet machine
(issue 55's target: at most 2x with one of two cores taken). Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch
from common import cpu_name
from cpu_step import Step

from specmesh_bench.report import bootstrap_interval

BUSY = "while True: pass"


def paired(fixed: Step, adaptive: Step, budget, threads: int, seconds: float) -> tuple[list[float], list[float], float]:
    """(fixed step times, adaptive step times, mean adaptive threads) over ``seconds``."""
    a, b, used = [], [], []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        torch.set_num_threads(threads)
        a.append(fixed())
        torch.set_num_threads(budget.threads)
        b.append(adaptive())
        used.append(budget.threads)
    return a, b, statistics.mean(used)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="per condition")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--neighbours", type=int, default=1, help="busy processes beside the steps")
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    from specmesh_server.model_loading import load_model
    from specmesh_server.model_runner import ModelRunner
    from specmesh_server.thread_budget import ThreadBudget

    torch.set_num_threads(args.threads)
    runners = []
    budget = ThreadBudget(args.threads)
    for threads in (None, budget):
        lm = load_model(device="cpu", dtype="float32")
        runners.append(ModelRunner(lm.model, lm.device, lm.dtype, 4096, linears="gemv", block_size=16, threads=threads))
    print(
        f"# The plain step beside a busy neighbour ({cpu_name()}, --threads {args.threads}, "
        f"{args.context}-token context, {args.seconds:.0f} s per condition)\n"
    )
    print("| condition | pairs | fixed ms | adaptive ms | adaptive threads (mean) | fixed / adaptive | 95 % interval |")
    print("|---|---|---|---|---|---|---|")
    quiet_fixed = None
    with torch.inference_mode():
        fixed, adaptive = (Step(r, 1, 1, args.context) for r in runners)
        for _ in range(5):
            fixed(), adaptive()
        for label, neighbours in (("quiet", 0), (f"{args.neighbours} busy core(s) beside", args.neighbours)):
            procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(neighbours)]
            try:
                time.sleep(1.5 if neighbours else 0.0)  # two of the budget's intervals
                a, b, used = paired(fixed, adaptive, budget, args.threads, args.seconds)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            ratios = [x / y for x, y in zip(a, b, strict=True)]
            iv = bootstrap_interval([ratios])
            ma, mb = 1e3 * statistics.median(a), 1e3 * statistics.median(b)
            quiet_fixed = quiet_fixed or ma
            print(
                f"| {label} | {len(a)} | {ma:.1f} | {mb:.1f} | {used:.2f} | {statistics.median(ratios):.2f}x "
                f"| {iv.low:.2f}–{iv.high:.2f} |",
                flush=True,
            )
            time.sleep(1.5)
        print(
            f"\nAdaptive beside the neighbour over fixed on the quiet machine: {mb / quiet_fixed:.2f}x (target ≤ 2x)."
        )


if __name__ == "__main__":
    main()
