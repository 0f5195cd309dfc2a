"""The kernels against their references, without the interpreter on a GPU (with it in the CPU dry run).

- tree attention within dtype tolerance of ``tree_attention_reference`` (1–64 requests, 1–63 nodes,
  contexts to 32k, GQA groups 1/3/8, fp32/bf16/fp16), over slot rows and through block tables (the
  same rows copied into a paged pool at shuffled blocks);
- batched acceptance identical to the host walk (``verifier_svc.acceptance``), greedy and sampled,
  draw for draw;
- sampled acceptance converging to the target: the first emitted token's total-variation distance
  to the target distribution shrinks like 1/sqrt(N).
"""

from __future__ import annotations

import random

import torch
from gpu_kit.context import CheckContext, suite_support
from gpu_kit.report import Deadline, Section

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # as tests/kernels (fp32 math reference)
# (requests, max nodes, context, kv heads, group, head dim): SmolLM2's heads (3 kv × 3, dim 64) and
# Llama-3-8B's (8 kv × 4, dim 128), plus the GQA corners 1 and 8.
ATTENTION_SHAPES = [
    (1, 1, 1024, 8, 4, 128),
    (1, 63, 32768, 8, 4, 128),
    (8, 16, 4096, 3, 3, 64),
    (64, 8, 2048, 8, 1, 128),
    (16, 63, 8192, 1, 8, 128),
    (64, 63, 1024, 3, 3, 64),
    (4, 32, 16384, 8, 8, 64),
]
QUICK_ATTENTION_SHAPES = [(2, 3, 16, 1, 3, 16), (3, 5, 40, 2, 1, 16)]


def make_batch(seed: int, n_req: int, max_nodes: int, context: int, kv_heads: int, group: int, dim: int, dtype, dev):
    """Random trees (first request: ``max_nodes`` nodes after ``context`` cached positions; the rest
    random sizes below) in a slot cache whose unused positions hold NaN: reading them would show."""
    from specmesh_kernels.tree_attention import ancestor_bits

    rng = random.Random(seed)
    gen = torch.Generator(device=dev).manual_seed(seed)
    nodes = [max_nodes] + [rng.randint(0, max_nodes) for _ in range(n_req - 1)]
    prefixes = [context] + [rng.randint(1, context) for _ in range(n_req - 1)]
    parents = [[rng.randrange(-1, i) for i in range(n)] for n in nodes]
    seq = max(p + n + 1 for p, n in zip(prefixes, nodes, strict=True)) + 3
    k_cache = torch.full((n_req + 1, kv_heads, seq, dim), float("nan"), dtype=dtype, device=dev)
    v_cache = k_cache.clone()
    slots = torch.randperm(n_req + 1, generator=gen, device=dev)[:n_req]
    for b in range(n_req):
        used = prefixes[b] + nodes[b] + 1
        k_cache[slots[b], :, :used] = torch.randn(kv_heads, used, dim, generator=gen, device=dev).to(dtype)
        v_cache[slots[b], :, :used] = torch.randn(kv_heads, used, dim, generator=gen, device=dev).to(dtype)
    cu = torch.tensor([0] + [n + 1 for n in nodes], device=dev).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), kv_heads * group, dim, generator=gen, device=dev).to(dtype)
    bits = torch.tensor([b for p in parents for b in ancestor_bits(p)], dtype=torch.int64, device=dev)
    prefix = torch.tensor(prefixes, dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, cu, slots.to(torch.int32), prefix, bits


def to_paged(args: tuple, block_size: int = 16, seed: int = 0) -> tuple:
    """``make_batch``'s slot rows copied into one pool each for K and V at shuffled blocks (the verifier's
    paged layout, ``specmesh_server.paged_kv``) → ``paged_tree_attention``'s positional arguments."""
    q, k_cache, v_cache, cu, slots, prefix, bits = args
    n_req, kv_heads, seq, dim = slots.shape[0], *k_cache.shape[1:]
    cols, dev = -(-seq // block_size), q.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    table = torch.randperm(n_req * cols, generator=gen, device=dev).view(n_req, cols)  # [b, blocks]
    pos = torch.arange(cols * block_size, device=dev)
    at = (table[:, pos // block_size] * block_size + pos % block_size).reshape(-1)  # [b · cols · bs] pool slots
    pools = []
    for cache in (k_cache, v_cache):
        rows = torch.nn.functional.pad(cache[slots.long()], (0, 0, 0, cols * block_size - seq))  # [b, kv, S, D]
        pool = torch.empty(kv_heads, n_req * cols * block_size, dim, dtype=cache.dtype, device=dev)
        pool[:, at] = rows.transpose(0, 1).reshape(kv_heads, -1, dim)
        pools.append(pool)
    return q, pools[0], pools[1], cu, table.to(torch.int32), prefix, bits


def tree_attention_section(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    from specmesh_kernels.tree_attention import paged_tree_attention, tree_attention, tree_attention_reference

    shapes = QUICK_ATTENTION_SHAPES if ctx.quick else ATTENTION_SHAPES
    dtypes = [torch.float32, torch.bfloat16] if ctx.quick else [torch.float32, torch.bfloat16, torch.float16]
    t = sec.table(
        "tree attention vs reference (max |error|)",
        ["requests", "nodes", "context", "kv×group", "dim", "dtype", "max err", "paged max err", "tol"],
    )
    items = [(s, d) for s in shapes for d in dtypes]
    for done, ((n_req, nodes, context, kv, group, dim), dtype) in enumerate(items):
        if deadline.spent():
            sec.budget_spent(done, len(items))
            break
        args = make_batch(done, n_req, nodes, context, kv, group, dim, dtype, ctx.device)
        got = tree_attention(*args)
        want = tree_attention_reference(*args)
        paged = paged_tree_attention(*to_paged(args, seed=done), block_size=16)
        errs, bad = [], False
        for out in (got, paged):
            errs.append(float((out.float() - want.float()).abs().max()))
            bad |= not torch.isfinite(out).all() or not torch.allclose(
                out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype]
            )
        t.rows.append(
            [n_req, nodes, context, f"{kv}×{group}", dim, str(dtype).removeprefix("torch."), *errs, TOL[dtype]]
        )
        if bad:
            sec.fail(f"tree attention off the reference at {t.rows[-1]}")
        del args, got, want, paged
    sec.summary = f"{len(t.rows)} shape×dtype cases" + ("" if sec.status != "fail" else ", some off the reference")


def random_trees(rng: random.Random, n_req: int, max_nodes: int, vocab: int, stochastic_share: float):
    """Random trees, a share of them carrying sparse proposal distributions (a stochastic proposer's)."""
    from specmesh_server.tree import TokenTree

    trees = []
    for _ in range(n_req):
        n = rng.randint(0, max_nodes)
        parents = [rng.randrange(-1, i) for i in range(n)]
        tokens = [rng.randrange(vocab) for _ in range(n)]
        dists = None
        if rng.random() < stochastic_share:
            dists = []
            for tok in tokens:
                ids = list({tok, *(rng.randrange(vocab) for _ in range(7))})
                w = [rng.random() + 0.05 for _ in ids]
                dists.append((ids, [x / sum(w) for x in w]))
        trees.append(TokenTree(tokens, parents, dists))
    return trees


def acceptance_section(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    """The verifier's acceptance with the kernel (``--device-accept on``) against its host walk (``off``),
    request for request."""
    from verifier_svc.batch_accept import accept_batch
    from verifier_svc.requests import GenerationRequest, SpecParams

    vocab, n_req, max_nodes, rounds = (64, 6, 8, 2) if ctx.quick else (49152, 64, 63, 10)
    rng = random.Random(0)
    spec = SpecParams("none", 0, 0, "", "")
    t = sec.table("acceptance kernel vs host walk", ["round", "requests", "greedy", "sampled", "identical"])
    mismatches = 0
    for r in range(rounds):
        if deadline.spent():
            sec.budget_spent(r, rounds)
            break
        trees = random_trees(rng, n_req, max_nodes, vocab, stochastic_share=0.5)
        reqs = [
            GenerationRequest(f"r{i}", [1], rng.choice([0.0, 0.0, 0.7, 1.0]), rng.choice([1.0, 0.9]),
                              rng.choice([0, 0, 50]), rng.randrange(1 << 30), 8, (), True, spec)
            for i in range(n_req)
        ]  # fmt: skip
        ctx_lens = [rng.randint(1, 4000) for _ in range(n_req)]
        counts = [len(tr) + 1 for tr in trees]
        logits = (torch.randn(sum(counts), vocab, device=ctx.device) * 3).float()
        # Deterministic trees mostly follow the argmax, so greedy paths get deep.
        argmax = logits.argmax(-1).tolist()
        start = 0
        for tr, c in zip(trees, counts, strict=True):
            for j in range(len(tr)):
                if tr.dists is None and rng.random() < 0.7:
                    p = tr.parents[j]
                    tr.tokens[j] = argmax[start + p + 1]
            start += c
        got = accept_batch(reqs, ctx_lens, trees, logits, counts, device_accept=True)
        want = accept_batch(reqs, ctx_lens, trees, logits, counts, device_accept=False)
        same = sum(g == w for g, w in zip(got, want, strict=True))
        mismatches += n_req - same
        greedy = sum(q.temperature == 0 for q in reqs)
        t.rows.append([r, n_req, greedy, n_req - greedy, f"{same}/{n_req}"])
    if mismatches:
        sec.fail(f"{mismatches} requests accepted differently on the device and on the host")
    converge(ctx, sec, deadline)
    rounds_run = len(sec.tables[0].rows)
    tv = "; ".join(f"{r[0]} draft: TV {r[1]:.4f} → {r[2]:.4f}" for r in sec.tables[1].rows)
    sec.summary = f"{rounds_run} rounds of {n_req} requests, {mismatches} kernel/host mismatches; {tv}"


def converge(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    """TV at N and 100·N walks: it must fall about tenfold (1/sqrt(N)); the noise floor at N is
    about sqrt(V / N) / 2."""
    first_token_tv = suite_support(ctx.root).first_token_tv  # the suite's convergence test

    small, large = (40, 320) if ctx.quick else (1_000, 100_000)
    t = sec.table(
        f"sampled acceptance: first-token TV to the target, N={small} and N={large}",
        ["draft", "TV small", "TV large", "ratio"],
    )
    for stochastic in (False, True):
        if deadline.spent():
            sec.budget_spent(int(stochastic), 2)
            return
        a, b = (first_token_tv(n, stochastic, str(ctx.device))[0] for n in (small, large))
        name = "sparse q" if stochastic else "deterministic"
        t.rows.append([name, a, b, a / max(b, 1e-12)])
        ok = (b < 0.1 and b < a) if ctx.quick else (b < 0.01 and a / max(b, 1e-12) > 4)
        if not ok:
            sec.fail(f"{name} draft: TV {a:.4f} → {b:.4f} does not converge like 1/sqrt(N)")
