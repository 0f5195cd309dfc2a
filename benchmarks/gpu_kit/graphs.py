"""CUDA graphs: the static step (``specmesh_server.static_step``) replayed against the eager step it replaces.

Per target shape (SmolLM2-135M, Llama-3-8B; bf16 on a GPU, random weights), one runner over the paged
cache with the tree-attention kernel, after a 512-token context per row:

- the step table: milliseconds per decode step (forward, logits, the argmax to the host: one device→host
  copy) eager and replayed, at batch 1/8/32 × 1 and 17 tokens per row (plain, and the pending token with
  a 16-node tree), and the tree step's cost over a plain one at the same batch; the weight-read floor
  (weight bytes / measured copy bandwidth) beside the plain step at batch 1;
- under the profiler, batch 8 × 17: kernel launches, graph launches and synchronisations per step, and the
  device-busy share of its wall time;
- the capture: buckets, seconds, memory.

Then greedy equality in fp32 (SmolLM2's shape): rows decoded through verification steps whose trees hold
``generate()``'s continuation behind a wrong first branch (so the accepted nodes move in the cache), graphs
on and off, each against ``generate()``. On a CPU (the dry run) the same code runs the static step eagerly.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import torch
from gpu_kit.context import CheckContext, random_model
from gpu_kit.report import Deadline, Section

CASES = ((1, 1), (8, 1), (32, 1), (1, 17), (8, 17), (32, 17))  # (batch, tokens per row)
CONTEXT = 512
BENCH_SUMMARY = "docs/bench/issue46-tp1/summary.json"  # the latest CPU bench: tokens per step per category


def build(shape: dict[str, Any], ctx: CheckContext, dtype: torch.dtype, max_batch: int, graphs: bool) -> Any:
    from specmesh_server.model_runner import ModelRunner

    model = random_model(shape, ctx.device, dtype)
    budget = (4 << 30) if ctx.cuda else (64 << 20)
    runner = ModelRunner(
        model, ctx.device, dtype, max_context=2048, tree_kernel=True, block_size=16, kv_budget_bytes=budget
    )
    t0 = time.perf_counter()
    runner.use_static(max_batch, 2048, graphs=graphs)
    return runner, time.perf_counter() - t0


class Rows:
    """``batch`` requests with ``context`` cached positions each (prefilled), and their block tables."""

    def __init__(self, runner: Any, batch: int, context: int, room: int, ids: torch.Tensor | None = None) -> None:
        from specmesh_server.kv_blocks import BlockTable
        from specmesh_server.model_runner import causal_mask

        g = torch.Generator().manual_seed(0)
        self.runner, self.lengths = runner, [context] * batch
        self.tables = [BlockTable(b"") for _ in range(batch)]
        for t in self.tables:
            runner.cache.manager.grow(t, context + room)
        if ids is None:
            ids = torch.randint(3, runner.vocab_size, (batch, context), generator=g)
        ids = ids.to(runner.device)
        pos = torch.arange(context, device=runner.device)[None].expand(batch, context)
        rows = runner.cache.rows(self.tables, context)
        with torch.inference_mode():
            runner.forward(rows, ids, pos, causal_mask(pos, context))

    def close(self) -> None:
        for t in self.tables:
            self.runner.cache.manager.close(t)


def step(runner: Any, rows: Rows, pending: list[int], trees: list[Any], static: bool) -> list[int]:
    """One decode step as the engine runs it (static or eager), to the argmax of every real token on the host."""
    from verifier_svc.model_steps import _eager_forward

    with torch.inference_mode():
        if static:
            hidden = runner.static.forward(pending, rows.lengths, trees, [t.blocks for t in rows.tables])
        else:
            seqs = [_Seq(p, n) for p, n in zip(pending, rows.lengths, strict=True)]
            keep, runner.static = runner.static, None
            try:
                width = 1 + max(len(t) for t in trees)
                paged = runner.cache.rows(rows.tables, max(rows.lengths) + width)
                hidden, _ = _eager_forward(runner, seqs, trees, paged, packed=False)
            finally:
                runner.static = keep
        return runner.logits(hidden).argmax(-1).tolist()  # the step's one device→host copy


class _Seq:  # what the eager forward reads of a request
    def __init__(self, pending: int, length: int) -> None:
        self.pending, self.length = pending, length


def tree_of(nodes: int, vocab: int, seed: int) -> Any:
    """Four chains of random tokens (the decode_step section's shape), ``nodes`` nodes."""
    from specmesh_server.tree import TokenTree

    g = torch.Generator().manual_seed(seed)
    return TokenTree(
        torch.randint(3, vocab, (nodes,), generator=g).tolist(), [-1 if j % 4 == 0 else j - 1 for j in range(nodes)]
    )


def graphs_section(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    shapes = list(ctx.shapes().items())
    for done, (name, shape) in enumerate(shapes):
        if deadline.left() < (70 if shape["hidden_size"] >= 4096 else 15):
            sec.budget_spent(done, len(shapes))
            break
        step_table(ctx, sec, deadline, name, shape, projected=done == 0)
        if done == 0 and deadline.left() > 10:  # correctness before the larger shape's numbers
            equality(ctx, sec, deadline)


def step_table(
    ctx: CheckContext, sec: Section, deadline: Deadline, name: str, shape: dict[str, Any], projected: bool
) -> None:
    """One shape's step table (and profiles, and for the default target the projection)."""
    from gpu_kit.numbers import copy_bandwidth, wall_ms

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    cases = CASES if ctx.cuda else ((1, 1), (2, 1), (1, 3), (2, 3))
    context = CONTEXT if ctx.cuda else 16
    runner, seconds = build(shape, ctx, dtype, max(b for b, _ in cases), graphs=True)
    sec.notes.append(f"{name}: {runner.static.describe()} (built and captured in {seconds:.1f} s)")
    if ctx.cuda and not runner.static.captured:
        sec.fail(f"{name}: no CUDA graphs: {runner.static.failure}")
        return
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    floor_ms = 1e3 * weights / copy_bandwidth(ctx.device)
    t = sec.table(
        f"{name} ({str(dtype).removeprefix('torch.')}): ms per decode step after {context} cached tokens "
        f"(weight-read floor {floor_ms:.3g} ms)",
        ["batch", "tokens per row", "eager ms", "graph ms", "speed-up", "graph / plain step"],
    )
    plain: dict[int, float] = {}
    for batch, width in cases:
        if deadline.left() < 5:
            sec.notes.append(f"{name}: step table cut short: budget spent")
            break
        rows = Rows(runner, batch, context, 80)
        trees = [tree_of(width - 1, runner.vocab_size, i) for i in range(batch)]
        pending = [5] * batch
        runs = {
            label: functools.partial(step, runner, rows, pending, trees, static=label == "graph")
            for label in ("eager", "graph")
        }
        ms = {label: wall_ms(fn, 20 if ctx.cuda else 2, warmup=2) for label, fn in runs.items()}
        if width == 1:
            plain[batch] = ms["graph"]
        ratio = ms["graph"] / plain[batch] if batch in plain else None
        t.rows.append([batch, width, ms["eager"], ms["graph"], ms["eager"] / ms["graph"], ratio])
        if (batch, width) == (8, 17) and ctx.cuda:
            for label, fn in runs.items():
                profile_step(sec, name, fn, label)
        rows.close()
    sec.summary += f"{'; ' if sec.summary else ''}{name}: " + ", ".join(
        f"b{r[0]}×{r[1]} {r[3]:.3g} ms ({r[4]:.1f}x)" for r in t.rows
    )
    if 1 in plain:
        sec.notes.append(f"{name}: plain step at batch 1 is {plain[1] / floor_ms:.2f}x the weight-read floor")
    if projected:  # the default target's shape: what its proposers' CPU acceptance would buy here
        projection(ctx, sec, name, {(r[0], r[1]): r[3] for r in t.rows})
    del runner
    if ctx.cuda:
        torch.cuda.empty_cache()


def projection(ctx: CheckContext, sec: Section, name: str, graph_ms: dict[tuple[int, int], float]) -> None:
    """Projected speed-up per category and proposer: the tokens per step ``specmesh bench`` measured on the
    CPU (``BENCH_SUMMARY``, greedy) over this device's cost of a tree step against a plain one, at the
    widest tree measured, at 1 stream (batch 1) and 8 (the largest batch measured, up to 8)."""
    path = ctx.root / BENCH_SUMMARY
    if not path.is_file():
        sec.notes.append(f"projection skipped: no {BENCH_SUMMARY}")
        return
    rows = [r for r in json.loads(path.read_text()) if r["sampling"] == "greedy" and r["mode"] != "plain"]
    width = max(w for _, w in graph_ms)
    batches = {1: 1, 8: max((b for b, _ in graph_ms if b <= 8), default=1)}
    ratio = {c: graph_ms[(b, width)] / graph_ms[(b, 1)] for c, b in batches.items() if (b, width) in graph_ms}
    modes = sorted({r["mode"] for r in rows})
    costs = ", ".join(f"{c} stream(s) {v:.2f}x" for c, v in ratio.items())
    t = sec.table(
        f"{name}: projected speed-up per category (CPU tokens/step ÷ this device's {width}-token step cost over a "
        f"plain step: {costs}; {BENCH_SUMMARY})",
        ["category", *(f"{m}, {c} stream(s)" for m in modes for c in ratio)],
    )
    for category in sorted({r["category"] for r in rows}):
        cells = []
        for mode in modes:
            for c, cost in ratio.items():
                r = next((r for r in rows if (r["category"], r["mode"], r["concurrency"]) == (category, mode, c)), None)
                tokens = r["mean_accepted_length"] if r else None
                cells.append(f"{tokens:.2f} → {tokens / cost:.2f}x" if tokens else None)
        t.rows.append([category, *cells])


def profile_step(sec: Section, name: str, fn: Any, label: str, steps: int = 10) -> None:
    from gpu_kit.engine_profile import device_events, profiler

    fn()
    torch.cuda.synchronize()
    with profiler(True) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.events()
    names = [e.name for e in events]
    launches = sum(names.count(n) for n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")) / steps
    syncs = sum(names.count(n) for n in ("cudaStreamSynchronize", "cudaDeviceSynchronize")) / steps
    busy = sum(e.time_range.elapsed_us() for e in device_events(prof)) / 1e3 / steps
    t = sec.table(f"{name}: batch 8 × 17 tokens, {label} step under the profiler", ["quantity", "per step"])
    t.rows += [
        ["kernel launches (cudaLaunchKernel, cuLaunchKernel[Ex])", launches],
        ["graph launches (cudaGraphLaunch)", names.count("cudaGraphLaunch") / steps],
        ["synchronisations", syncs],
        ["device→host copies", sum(1 for e in events if "Memcpy DtoH" in e.name) / steps],
        ["wall ms", 1e3 * wall / steps],
        ["device busy ms", busy],
        ["device busy share", busy / (1e3 * wall / steps)],
    ]  # fmt: skip


def equality(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    """Greedy decoding through verification steps, the static step (graphs) and the eager one, against
    ``generate()`` (fp32): each step verifies a wrong first node, then ``generate()``'s next tokens."""
    from gpu_kit.context import SMOLLM2_135M, TINY

    shape = TINY if ctx.quick else SMOLLM2_135M
    n_rows, prompt, n_tokens = (2, 12, 6) if ctx.quick else (4, 64, 32)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, shape["vocab_size"], (n_rows, prompt), generator=g)
    t = sec.table(
        "greedy equality (fp32, verification steps) against generate()", ["step", "rows", "identical", "steps"]
    )
    for static in (True, False):
        if deadline.left() < 10:
            sec.notes.append("equality: budget spent")
            return
        runner, _ = build(shape, ctx, torch.float32, n_rows, graphs=True)
        label = ("graphs" if ctx.cuda else "static step (eager)") if static else "eager step"
        with torch.inference_mode():
            want = runner.model.generate(
                prompts.to(ctx.device), attention_mask=torch.ones_like(prompts, device=ctx.device),
                max_new_tokens=n_tokens, do_sample=False, pad_token_id=2, eos_token_id=None,
            )[:, prompt:].tolist()  # fmt: skip
        rows = Rows(runner, n_rows, prompt - 1, n_tokens + 16, ids=prompts[:, :-1])
        out = decode(runner, rows, prompts[:, -1].tolist(), want, n_tokens, static, shape["vocab_size"])
        identical = sum(o[:n_tokens] == w for o, w in zip(out, want, strict=True))
        t.rows.append([label, n_rows, identical, len(out[0])])
        if identical < n_rows:
            sec.fail(f"{label}: {n_rows - identical} of {n_rows} rows differ from generate()")
        rows.close()
        del runner
    sec.summary += f"; equality {', '.join(f'{r[0]} {r[2]}/{r[1]}' for r in t.rows)}"


def decode(
    runner: Any, rows: Rows, pending: list[int], want: list[list[int]], n: int, static: bool, vocab: int
) -> list[list[int]]:
    """Each row's greedy output from verification steps whose trees are a wrong node and ``want``'s next
    four tokens under the root (accepted nodes 1, 2, … move down one position in the cache)."""
    from specmesh_server.tree import TokenTree

    out: list[list[int]] = [[] for _ in pending]
    for _ in range(4 * n):
        if min(len(o) for o in out) >= n:
            break
        trees = []
        for i, o in enumerate(out):
            nxt = want[i][len(o) : len(o) + 4]
            wrong = (nxt[0] + 1) % vocab if nxt else 3  # a finished row still rides along: a one-node tree
            trees.append(TokenTree([wrong, *nxt], [-1, *([-1, *range(1, len(nxt))] if nxt else [])]))
        best = step(runner, rows, pending, trees, static=static)
        at, moves = 0, []
        for i, tree in enumerate(trees):
            row = best[at : at + len(tree) + 1]  # the argmax after the pending token, then after each node
            node, path = -1, []
            while True:  # from the root, the child whose token is its parent's argmax
                kids = [k for k in range(len(tree)) if tree.parents[k] == node and tree.tokens[k] == row[node + 1]]
                if not kids:
                    break
                node = kids[0]
                path.append(node)
            base = rows.lengths[i] + 1
            if path != list(range(len(path))):
                moves.append((rows.tables[i], [base + k for k in path], base))
            out[i] += [tree.tokens[k] for k in path] + [row[node + 1]]
            rows.lengths[i] = base + len(path)
            pending[i] = out[i][-1]
            at += len(tree) + 1
        runner.move_positions(moves)
    return out
