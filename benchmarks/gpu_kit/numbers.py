"""The numbers: tree attention against SDPA (and FlexAttention) as a share of the copy bandwidth; the
verification cost curve and the oracle ceiling per target shape; plain decoding against ``generate()``.

The oracle ceiling at batch b is the best speed-up a proposer that is always right could reach on this
device: a w-token step (the pending token and a chain of w − 1 nodes, all accepted) emits w tokens for
cost(b, w) where a plain step emits one for cost(b, 1), so ceiling(b) = max_w w · cost(b, 1) / cost(b, w).
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gpu_kit.context import CheckContext, random_model
from gpu_kit.report import Deadline, Section

WIDTHS = (1, 2, 3, 5, 9, 17, 33, 64)  # tokens per row: the pending token + 0, 1, 2, 4, 8, 16, 32, 63 nodes


@functools.cache
def attention_bench() -> Any:
    """benchmarks/kernels.py (the attention micro-benchmark), loaded by path: ``kernels`` names another package."""
    path = Path(__file__).resolve().parents[1] / "kernels.py"
    spec = importlib.util.spec_from_file_location("specmesh_attention_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def copy_bandwidth(device: torch.device) -> float:
    """The device's measured copy bandwidth, bytes/s (1 GiB on a GPU, 64 MiB on a CPU), measured once."""
    return attention_bench().copy_bandwidth((1 << 30) if device.type == "cuda" else (1 << 26), device)


def timed_ms(ctx: CheckContext, fn: Callable[[], Any], reps: int = 5) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench on CUDA)."""
    if ctx.cuda:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=40))
    return wall_ms(fn, reps)


def wall_ms(fn: Callable[[], Any], reps: int = 3, warmup: int = 1) -> float:
    """Median wall-clock milliseconds of ``reps`` calls of ``fn`` after ``warmup`` (whole steps or decodes,
    each ending on the host: what do_bench's device timing would not see)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def flex_fn(ref: tuple, context: int) -> Callable[[], Any] | None:
    """FlexAttention (compiled) over the same tree mask, or None where this torch has none."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    q, k, v, mask = ref  # q [b, H, n, D]; mask [b, 1, n, kv]
    b, _, n, _ = q.shape
    kv = k.shape[2]
    tree = mask[:, 0, :, context:]  # [b, n, n]

    def mask_mod(bi, h, qi, ki):
        return (ki < context) | tree[bi, qi, (ki - context).clamp(min=0)]

    block = create_block_mask(mask_mod, b, None, n, kv, device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q, k, v, block_mask=block, enable_gqa=True)


def attention_section(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    import torch.nn.functional as F
    from gpu_kit.kernel_checks import to_paged

    from specmesh_kernels.tree_attention import paged_tree_attention, tree_attention

    bench = attention_bench()
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    heads = (bench.HEADS, bench.KV_HEADS, bench.HEAD_DIM) if ctx.cuda else (4, 2, 16)
    grid = (
        [(1, 8, 64), (8, 16, 64), (1024, 32768)] if ctx.cuda else [(1, 2), (3,), (16,)]
    )  # batches, nodes (63 = the kernel's most), contexts
    batches, trees, contexts = grid
    trees = tuple(min(n, 63) for n in trees)
    copy_bw = copy_bandwidth(ctx.device)
    elem = torch.finfo(dtype).bits // 8
    t = sec.table(
        f"tree attention, {heads[0]} q / {heads[1]} kv heads, dim {heads[2]}, {str(dtype).removeprefix('torch.')}",
        "batch nodes context|kernel ms|paged ms|sdpa ms|flex ms|vs sdpa|paged / rows|GB/s|% of copy".replace(
            " ", "|"
        ).split("|"),
    )
    items = [(c, b, n) for c in contexts for b in batches for n in trees]
    for done, (context, batch, nodes) in enumerate(items):
        if deadline.spent():
            sec.budget_spent(done, len(items))
            break
        args, ref = bench.build(batch, nodes, context, dtype, ctx.device, heads)
        rows, max_kv = nodes + 1, context + nodes + 1
        kern = timed_ms(ctx, lambda a=args, r=rows, m=max_kv: tree_attention(*a, max_q=r, max_kv=m))
        paged_args = to_paged(args)  # the same rows in a pool of shuffled 16-position blocks
        paged = timed_ms(
            ctx, lambda a=paged_args, r=rows, m=max_kv: paged_tree_attention(*a, block_size=16, max_q=r, max_kv=m)
        )
        del paged_args
        try:  # a dense mask with GQA may take the math path: [b, H, n, kv] fp32 scores
            sdpa = timed_ms(
                ctx, lambda r=ref: F.scaled_dot_product_attention(r[0], r[1], r[2], attn_mask=r[3], enable_gqa=True)
            )
        except RuntimeError as exc:  # out of memory (a subclass), or no SDPA kernel for it: a row, not the end
            sdpa = float("nan")
            sec.notes.append(f"sdpa at batch {batch}, {nodes} nodes, {context}: {type(exc).__name__}: {str(exc)[:150]}")
        moved = batch * (2 * heads[1] * max_kv + 2 * heads[0] * rows) * heads[2] * elem
        bw = moved / (kern * 1e-3)
        t.rows.append(
            [batch, nodes, context, kern, paged, sdpa, None, sdpa / kern, paged / kern, bw / 1e9, 100 * bw / copy_bw]
        )
        del args, ref
        if ctx.cuda:
            torch.cuda.empty_cache()
    # FlexAttention last (each shape compiles for tens of seconds; a fault in compiled code spoils nothing
    # measured before it): batch 8, 16 nodes, each context, while the budget lasts.
    for row in t.rows if ctx.cuda else []:
        batch, nodes, context = row[:3]
        if (batch, nodes) != (8, 16) or deadline.left() < 30:
            continue
        try:
            fn = flex_fn(bench.build(batch, nodes, context, dtype, ctx.device, heads)[1], context)
            row[6] = timed_ms(ctx, fn) if fn else None
        except Exception as exc:  # FlexAttention is optional: say why it has no number
            sec.notes.append(f"flex attention at batch 8, 16 nodes, {context}: {type(exc).__name__}: {exc}"[:300])
            break
    sec.summary = f"copy bandwidth {copy_bw / 1e9:.0f} GB/s; {len(t.rows)} shapes"
    if not ctx.cuda:
        sec.summary += " (interpreter: times mean nothing)"


def cost_section(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    from specmesh_server.model_runner import ModelRunner, measure_step_cost

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    rows = (1, 8, 32) if ctx.cuda else (1, 2)
    widths = WIDTHS if ctx.cuda else (1, 2, 3)
    prefix = 1024 if ctx.cuda else 16
    shapes = list(ctx.shapes().items())
    for done, (name, shape) in enumerate(shapes):
        # An 8B model's build and curves take tens of seconds and cannot stop halfway: start only with room.
        if deadline.left() < (45 if shape["hidden_size"] >= 4096 else 5):
            sec.budget_spent(done, len(shapes))
            break
        model = random_model(shape, ctx.device, dtype)
        runner = ModelRunner(model, ctx.device, dtype, max_context=prefix + 1100)
        table = measure_step_cost(
            runner, rows=rows, widths=widths, prefix=prefix, max_tokens=max(rows) * max(widths), repeats=3
        )
        t = sec.table(
            f"{name}: verification step cost / plain step (batch × nodes), after {prefix} cached tokens",
            ["batch", "plain ms", *(f"{w - 1} nodes" for w in table.widths[1:]), "oracle ceiling"],
        )
        for r, seconds in zip(table.rows, table.seconds, strict=True):
            base = seconds[0]
            ceiling = max(w * base / s for w, s in zip(table.widths, seconds, strict=False))
            t.rows.append([r, 1e3 * base, *(s / base for s in seconds[1:]), ceiling])
        ceilings = ", ".join(f"batch {row[0]} {row[-1]:.1f}x" for row in t.rows)
        sec.summary += f"{'; ' if sec.summary else ''}{name} oracle ceiling {ceilings}"
        plain_vs_generate(ctx, sec, name, model, runner, deadline)
        del model, runner
        if ctx.cuda:
            torch.cuda.empty_cache()


@torch.inference_mode()
def plain_vs_generate(ctx: CheckContext, sec: Section, name: str, model: Any, runner: Any, deadline: Deadline) -> None:
    """Per-token time of plain decoding through the runner (batch 1, the argmax fed back on the device) and
    of ``generate()``: (time for n tokens − time for 1) / (n − 1), so prefill is not counted."""
    from specmesh_server.model_runner import causal_mask

    if deadline.left() < (25 if model.config.hidden_size >= 4096 else 5):
        sec.notes.append(f"{name}: plain vs generate() skipped: budget spent")
        return
    n = 8 if ctx.quick else 64
    prompt_len = 16 if ctx.quick else 512
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, prompt_len), device=ctx.device)

    def runner_decode(steps: int) -> None:
        pos = torch.arange(prompt_len, device=ctx.device)[None]
        hidden = runner.forward(slice(0, 1), ids, pos, causal_mask(pos, prompt_len))
        tok = runner.logits(hidden[:, -1:]).argmax(-1)  # [1, 1]
        for s in range(steps - 1):
            p = torch.full((1, 1), prompt_len + s, device=ctx.device)
            tok = runner.logits(runner.forward(slice(0, 1), tok, p, causal_mask(p, prompt_len + s + 1))).argmax(-1)
        ctx.sync()

    def generate(steps: int) -> None:
        model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=2)
        ctx.sync()

    per_token = {}
    for label, fn in (("runner (plain decode)", runner_decode), ("generate()", generate)):
        one, many = wall_ms(lambda f=fn: f(1)), wall_ms(lambda f=fn: f(n))
        per_token[label] = (many - one) / (n - 1)
    t = sec.table(f"{name}: plain decoding per token, batch 1, {prompt_len}-token prompt", ["path", "ms/token"])
    t.rows += [[k, v] for k, v in per_token.items()]
