"""Tree-attention kernel vs the torch reference path (SDPA over a dense tree mask), on a CUDA GPU.

Shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), one layer, random values;
every request has a ``context``-token cached prefix plus a random tree of ``nodes`` nodes (and its
pending token). Reports the kernel's achieved memory bandwidth (K/V bytes it must read, plus q and
out) as a fraction of the device's measured copy bandwidth.

.venv/bin/python benchmarks/kernels.py [--quick] [--dtype fp16|bf16]
Without CUDA it says so and exits 0 (the kernels' CPU tests run in Triton's interpreter instead).
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def copy_bandwidth(nbytes: int = 1 << 30, device: str | torch.device = "cuda") -> float:
    """Copy bandwidth of ``device``'s memory in bytes/s (read + write), best of several runs."""
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if torch.device(device).type != "cuda":  # do_bench times with CUDA events
        import time

        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return 2 * nbytes / best
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="min")
    return 2 * nbytes / (ms * 1e-3)


def build(
    batch: int,
    nodes: int,
    context: int,
    dtype: torch.dtype,
    device: str | torch.device = "cuda",
    heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
):
    """(tree-attention args, SDPA args) for ``batch`` random ``nodes``-node trees after ``context`` cached
    positions; ``heads``: (query heads, kv heads, head dim)."""
    from specmesh_kernels.tree_attention import ancestor_bits

    n_heads, kv_heads, dim = heads
    rng = random.Random(batch * 100_000 + nodes * 1000 + context)
    seq = context + nodes + 1
    k_cache = torch.randn(batch, kv_heads, seq, dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    parents = [[rng.randrange(-1, i) for i in range(nodes)] for _ in range(batch)]
    rows = nodes + 1
    q = torch.randn(batch * rows, n_heads, dim, dtype=dtype, device=device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * rows
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    prefix = torch.full((batch,), context, dtype=torch.int32, device=device)
    bits = torch.tensor([b for p in parents for b in ancestor_bits(p)], dtype=torch.int64, device=device)
    # The torch path: padded queries [b, H, n, D] and a dense bool mask [b, 1, n, kv] (True = attend).
    tree = ((bits.view(batch, rows)[:, :, None] >> torch.arange(rows, device=device)) & 1).bool()
    mask = torch.cat([torch.ones(batch, rows, context, dtype=torch.bool, device=device), tree], dim=2)[:, None]
    q_padded = q.view(batch, rows, n_heads, dim).transpose(1, 2)
    return (q, k_cache, v_cache, cu, slots, prefix, bits), (q_padded, k_cache, v_cache, mask)


def run(batches, trees, contexts, dtype: torch.dtype) -> None:
    import torch.nn.functional as F
    from triton.testing import do_bench

    from specmesh_kernels.tree_attention import tree_attention

    elem = torch.finfo(dtype).bits // 8
    copy_bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {copy_bw / 1e9:.0f} GB/s, dtype {dtype}")
    header = ("batch", 5), ("nodes", 5), ("context", 7), ("kernel ms", 10), ("sdpa ms", 9), ("speedup", 8), ("GB/s", 7)
    print(" ".join(f"{name:>{w}}" for name, w in header), f"{'% copy':>7}")
    for context in contexts:
        for batch in batches:
            for nodes in trees:
                try:
                    args, ref = build(batch, nodes, context, dtype)
                except torch.OutOfMemoryError:
                    print(f"{batch:>5} {nodes:>5} {context:>7}  out of memory")
                    continue
                rows, max_kv = nodes + 1, context + nodes + 1
                t_kernel = do_bench(lambda a=args, r=rows, m=max_kv: tree_attention(*a, max_q=r, max_kv=m), rep=50)
                t_sdpa = do_bench(
                    lambda r=ref: F.scaled_dot_product_attention(r[0], r[1], r[2], attn_mask=r[3], enable_gqa=True),
                    rep=50,
                )
                moved = batch * (2 * KV_HEADS * max_kv + 2 * HEADS * rows) * HEAD_DIM * elem
                bw = moved / (t_kernel * 1e-3)
                print(
                    f"{batch:>5} {nodes:>5} {context:>7} {t_kernel:>10.3f} {t_sdpa:>9.3f} {t_sdpa / t_kernel:>7.2f}x"
                    f" {bw / 1e9:>7.0f} {100 * bw / copy_bw:>6.0f}%"
                )
                del args, ref
                torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs CUDA: no GPU here, nothing to time (CPU tests use Triton's interpreter).")
        return 0
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    if args.quick:
        run((1, 8), (16,), (1024, 8192), dtype)
    else:
        run((1, 8, 16, 64), (8, 16, 63), (1024, 4096, 16384, 32768), dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
