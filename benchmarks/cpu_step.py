"""The CPU verifier's step, measured: linears modes side by side (paired), against the weight-read
time, and where a step's time goes.

Two verifier CPU runners on the default model, one per mode, over the paged cache as the verifier
runs it. A mode is a ``--linears`` value (or ``gguf``: ``--weights gguf``, the shipped file's Q4_1 / Q8_0
blocks), with ``/transformers`` for transformers' own layer forward
instead of ``lean_llama``'s, ``/python`` for the lean loop in Python rather than its native form,
``/flash`` for flash attention at every step (not key order for steps of few tokens a row,
``attention.in_key_order``), ``/rowsN`` for the matrix-vector kernel taking at most N rows (not
``packed_linear.GEMV_ROWS``) (default: ``gemv`` — today's default — against ``packed/transformers``,
the step before issue 55). For each step shape — plain decode at batch 1
and 8, and 17-token trees (the pending token and 16 nodes) at batch 1 and 8, after a ``--context``-token
prefix — steps alternate A, B, A, B … so drift hits both alike; the ratio is the median of per-pair
ratios with a bootstrap 95 % interval. Each step is the forward and its logits.

``weight read`` is the time to read every linear weight once (``Tensor.sum`` over the same bytes,
median): a batch-1 decode step's floor. ``--profile`` adds, per shape and for the first mode, the
step's time by kind of work (torch.profiler's self time: linears, attention, the other operators)
and what is left of the wall time (Python and dispatch between operators).

    .venv/bin/python benchmarks/cpu_step.py --pairs 20 --profile
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import cpu_name
from gpu_kit.numbers import wall_ms

from specmesh_bench.report import bootstrap_interval

CASES = {
    "plain, batch 1": (1, 0),
    "plain, batch 4": (4, 0),
    "plain, batch 8": (8, 0),
    "plain, batch 16": (16, 0),
    "1 row × 3 tokens": (1, 2),
    "1 row × 5 tokens": (1, 4),
    "8 rows × 3 tokens": (8, 2),
    "1 row × 17 tokens": (1, 16),
    "8 rows × 17 tokens": (8, 16),
}
LINEAR_OPS = (
    "specmesh_cpu::linear",
    "specmesh_cpu::linear_gguf",
    "mkldnn::_linear_pointwise",
    "aten::addmm",
    "aten::mm",
    "aten::matmul",
)
ATTENTION_OPS = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "specmesh_cpu::ordered_attention",
    "aten::bmm",
    "aten::_softmax",
)


def weight_read_ms(model: torch.nn.Module) -> tuple[float, float]:
    """(ms to read every linear weight once, their MB)."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    mb = sum(w.numel() * w.element_size() for w in weights) / 1e6
    return wall_ms(lambda: [w.sum() for w in weights], reps=15), mb


class Step:
    """One runner's measurement rows (a ``context``-token prefix each) and one step's inputs."""

    def __init__(self, runner, rows: int, nodes: int, context: int) -> None:
        from specmesh_server.model_runner import causal_mask
        from specmesh_server.tree import TokenTree
        from verifier_svc.step_inputs import decode_inputs

        self.runner, self.rows_ctx = runner, runner.cache.measurement_rows(rows, context + nodes + 1)
        self.where = self.rows_ctx.__enter__()
        ids = torch.randint(3, runner.vocab_size, (rows, context), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(context)[None].expand(rows, context)
        runner.forward(self.where, ids, pos, causal_mask(pos, context))
        tree = TokenTree(list(range(5, 5 + nodes)), [-1 if j % 4 == 0 else j - 1 for j in range(nodes)])
        self.inputs = decode_inputs([7] * rows, [context] * rows, [tree] * rows, torch.device("cpu"))

    def __call__(self) -> float:
        s, r = self.inputs, self.runner
        t0 = time.perf_counter()
        r.logits(r.forward(self.where, s.input_ids, s.positions, s.mask, s.write_pos))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.rows_ctx.__exit__(None, None, None)


def breakdown(step: Step, repeats: int = 5) -> dict[str, float]:
    """ms per step by kind of work (profiler self time) and the rest of the wall time."""
    from torch.profiler import profile

    with profile() as prof:
        wall = sum(step() for _ in range(repeats))
    kinds = {"linears": 0.0, "attention": 0.0, "other operators": 0.0}
    for ev in prof.key_averages():
        kind = "linears" if ev.key in LINEAR_OPS else "attention" if ev.key in ATTENTION_OPS else "other operators"
        kinds[kind] += ev.self_cpu_time_total / 1e3 / repeats
    kinds["Python and dispatch"] = 1e3 * wall / repeats - sum(kinds.values())
    return kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--modes",
        default="gemv,packed/transformers",
        help="two modes, A,B (ratio B / A): LINEARS[/transformers|/python|/flash|/rowsN] (python: the lean loop, "
        "not native; flash: flash attention at every step; rowsN: the kernel takes at most N rows)",
    )
    ap.add_argument("--profile", action="store_true", help="also the first mode's time by kind of work")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")

    from specmesh_server import packed_linear
    from specmesh_server.model_loading import load_model
    from specmesh_server.model_runner import ModelRunner

    runners, gemv_rows = {}, packed_linear.GEMV_ROWS
    for mode in modes:
        lm = load_model(device="cpu", dtype="float32")
        if not runners:
            with torch.inference_mode():
                read_ms, mb = weight_read_ms(lm.model)
        linears, _, forward = mode.partition("/")
        if forward.startswith("rows"):  # the kernel takes at most this many rows (packed_linear.GEMV_ROWS)
            packed_linear.GEMV_ROWS, forward = int(forward.removeprefix("rows")), ""
        if linears == "gguf":  # --weights gguf: the shipped file's blocks, the rest as gemv
            from specmesh_server.gguf_weights import quantize_linears
            from specmesh_server.model_loading import default_gguf_path

            quantize_linears(lm.model, default_gguf_path())
            linears = "gemv"
        runners[mode] = ModelRunner(
            lm.model, lm.device, lm.dtype, 4096, linears=linears, block_size=16, lean=forward != "transformers"
        )
        packed_linear.GEMV_ROWS = gemv_rows
        if forward == "python":  # lean_llama's loop in Python, not the native one
            runners[mode].decoder.native = None
        if forward == "flash":  # flash attention at every step
            from specmesh_server.attention import mark_attention

            mark_attention(lm.model, ordered=False)
    a, b = modes
    print(
        f"# The CPU step ({cpu_name()}, {args.threads} threads, {args.pairs} pairs, {args.context}-token context)\n\n"
        f"Weight read: {read_ms:.2f} ms ({mb:.0f} MB of linear weights, {mb / read_ms:.1f} GB/s).\n"
    )
    print(f"| step | {a} ms | {b} ms | {a} / weight read | {b} / {a} (median of pairs) | 95 % interval |")
    print("|---|---|---|---|---|---|")
    profiles = {}
    with torch.inference_mode():
        for label, (rows, nodes) in CASES.items():
            steps = {mode: Step(runner, rows, nodes, args.context) for mode, runner in runners.items()}
            for step in steps.values():
                for _ in range(3):
                    step()
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(args.pairs):
                for mode, step in steps.items():
                    times[mode].append(step())
            if args.profile:
                profiles[label] = breakdown(steps[a])
            for step in steps.values():
                step.close()
            ratios = [y / x for x, y in zip(times[a], times[b], strict=True)]
            iv = bootstrap_interval([ratios])
            ma, mb_ = 1e3 * statistics.median(times[a]), 1e3 * statistics.median(times[b])
            print(
                f"| {label} | {ma:.1f} | {mb_:.1f} | {ma / read_ms:.2f}x | {statistics.median(ratios):.2f}x | "
                f"{iv.low:.2f}–{iv.high:.2f} |",
                flush=True,
            )
    if profiles:
        kinds = list(next(iter(profiles.values())))
        print(f"\n## Where a step's time goes ({a}, ms per step, profiler self time)\n")
        print("| step | " + " | ".join(kinds) + " |")
        print("|---|" + "---|" * len(kinds))
        for label, kinds_ms in profiles.items():
            print(f"| {label} | " + " | ".join(f"{v:.1f}" for v in kinds_ms.values()) + " |")


if __name__ == "__main__":
    main()
