"""Plain-decoding throughput of the verifier service vs transformers ``generate()``.

Same model, prompts and machine, one run: transformers generate() per prompt (in this
process), then the service with 1 stream at a time, then N concurrent streams.
Prints a markdown table; tokens/s are end to end (prefill included) per request, medians.

    .venv/bin/python benchmarks/plain_throughput.py --prompts 8 --max-tokens 128 --concurrency 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import cpu_name, workload_rows

ROOT = Path(__file__).resolve().parents[1]


def prompts(n: int) -> list[str]:
    rows = workload_rows()
    by_cat: dict[str, list[str]] = {}
    for r in rows:
        if len(r["turns"][0]) < 1500:
            by_cat.setdefault(r["category"], []).append(r["turns"][0])
    out, i = [], 0
    while len(out) < n:  # round-robin over categories
        for cat in sorted(by_cat):
            if i < len(by_cat[cat]) and len(out) < n:
                out.append(by_cat[cat][i])
        i += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import torch

    from specmesh import Client, SamplingParams
    from specmesh.deploy import DeploymentConfig, LocalDeployment
    from specmesh_server.model_loading import load_model

    torch.set_num_threads(a.threads)
    lm = load_model()
    texts = prompts(a.prompts)
    ids = [
        list(
            lm.tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for t in texts
    ]
    n = a.max_tokens

    hf = []
    with torch.inference_mode():
        lm.model.generate(torch.tensor([ids[0]]), max_new_tokens=4, do_sample=False)  # warm-up
        for x in ids:
            t0 = time.perf_counter()
            out = lm.model.generate(
                torch.tensor([x]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2
            )
            hf.append((out.shape[1] - len(x)) / (time.perf_counter() - t0))
    del lm

    greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    with LocalDeployment(DeploymentConfig(verifier_threads=a.threads)) as dep, Client(dep.verifier_address) as c:
        c.complete(ids[0], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        single = []
        for x in ids:
            t0 = time.perf_counter()
            r = c.complete(x, greedy)
            single.append(len(r.token_ids) / (time.perf_counter() - t0))

        def timed(x: list[int]) -> tuple[int, float]:
            t0 = time.perf_counter()
            return len(c.complete(x, greedy).token_ids), time.perf_counter() - t0

        work = (ids * ((a.concurrency + len(ids) - 1) // len(ids)))[: max(a.concurrency, len(ids))]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.concurrency) as pool:
            conc = list(pool.map(timed, work))
        wall = time.perf_counter() - t0

    med = statistics.median
    agg_single = med(single)
    agg_conc = sum(k for k, _ in conc) / wall
    cpu = cpu_name()
    print(f"\nmachine: {cpu}, {a.threads} torch threads; model SmolLM2-135M-Instruct fp32 CPU")
    print(f"{len(ids)} workload prompts, {n} new tokens each (greedy, EOS ignored)\n")
    print("| mode | tokens/s per stream (median) | aggregate tokens/s | vs generate() |")
    print("|---|---|---|---|")
    print(f"| transformers generate() | {med(hf):.1f} | {med(hf):.1f} | 1.00x |")
    print(f"| service, 1 stream | {agg_single:.1f} | {agg_single:.1f} | {agg_single / med(hf):.2f}x |")
    print(
        f"| service, {a.concurrency} concurrent | {med(k / s for k, s in conc):.1f} | {agg_conc:.1f} | "
        f"{agg_conc / med(hf):.2f}x ({agg_conc / agg_single:.2f}x single stream) |"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
