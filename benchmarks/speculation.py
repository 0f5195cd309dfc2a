"""Plain vs n-gram speculative decoding through the services, beside transformers.

One run, same model, prompts and machine. Per category: transformers ``generate()`` greedy and
``generate(prompt_lookup_num_tokens=K)`` (best K of a small sweep, per category) in this process;
then through the services, request by request interleaved, plain (proposer "none") and
n-gram, one stream at a time; then ``--concurrency`` streams at once in each mode. Greedy
outputs of every mode are checked against plain; a mismatch is printed as a losslessness failure.

    .venv/bin/python benchmarks/speculation.py --categories code_edit,rag,summarization --prompts 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import cpu_name, workload_rows

ROOT = Path(__file__).resolve().parents[1]


def load_prompts(categories: list[str], per_category: int) -> dict[str, list[str]]:
    rows = workload_rows()
    out: dict[str, list[str]] = {c: [] for c in categories}
    for r in rows:
        if r["category"] in out and len(out[r["category"]]) < per_category:
            out[r["category"]].append(r["turns"][0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--categories", default="code_edit,rag,summarization")
    ap.add_argument("--prompts", type=int, default=4, help="per category")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pld-sweep", default="5,10")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers reference modes")
    a = ap.parse_args()

    import torch

    from specmesh import Client, SamplingParams, SpecDecodeParams
    from specmesh.deploy import DeploymentConfig, LocalDeployment
    from specmesh.model_loading import load_model

    torch.set_num_threads(a.threads)
    lm = load_model()
    cats = a.categories.split(",")
    texts = load_prompts(cats, a.prompts)

    tokenizer = lm.tokenizer

    def encode(t: str) -> list[int]:
        msgs = [{"role": "user", "content": t}]
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))

    ids = {c: [encode(t) for t in texts[c]] for c in cats}
    n = a.max_tokens
    hf: dict[str, dict[str, list[float]]] = {c: {} for c in cats}
    hf_out: dict[tuple[int, ...], list[int]] = {}
    with torch.inference_mode():
        lm.model.generate(torch.tensor([ids[cats[0]][0]]), max_new_tokens=4, do_sample=False)
        for c in [] if a.no_hf else cats:
            for k in [0, *map(int, a.pld_sweep.split(","))]:
                key = "greedy" if k == 0 else f"pld{k}"
                for x in ids[c]:
                    kw = {"prompt_lookup_num_tokens": k} if k else {}
                    t0 = time.perf_counter()
                    out = lm.model.generate(torch.tensor([x]), max_new_tokens=n, do_sample=False, pad_token_id=2, **kw)
                    new = out[0, len(x) :].tolist()
                    hf[c].setdefault(key, []).append(len(new) / (time.perf_counter() - t0))
                    if k == 0:
                        hf_out[tuple(x)] = new
    del lm

    greedy = SamplingParams(temperature=0.0, max_tokens=n)
    modes = {"plain": SpecDecodeParams(proposer="none"), "ngram": SpecDecodeParams(proposer="ngram")}
    single: dict[str, dict[str, list[float]]] = {c: {m: [] for m in modes} for c in cats}
    conc: dict[str, dict[str, float]] = {c: {} for c in cats}
    accept: dict[str, list[float]] = {c: [] for c in cats}
    failures = []
    with LocalDeployment(DeploymentConfig(verifier_threads=a.threads)) as dep, Client(dep.verifier_address) as cl:
        cl.complete(ids[cats[0]][0], SamplingParams(temperature=0.0, max_tokens=4))
        for c in cats:
            for i, x in enumerate(ids[c]):
                order = list(modes) if i % 2 == 0 else list(reversed(modes))  # interleaved
                outs = {}
                for m in order:
                    t0 = time.perf_counter()
                    r = cl.complete(x, greedy, modes[m])
                    single[c][m].append(len(r.token_ids) / (time.perf_counter() - t0))
                    outs[m] = r.token_ids
                    if m == "ngram":
                        accept[c].append(r.summary.speculation.mean_accepted_length)
                if outs["ngram"] != outs["plain"]:
                    failures.append(f"{c}[{i}]: ngram output differs from plain")
                if not a.no_hf and outs["plain"] != hf_out[tuple(x)]:
                    failures.append(f"{c}[{i}]: plain output differs from transformers generate()")
            work = (ids[c] * a.concurrency)[: a.concurrency]
            for m in modes:
                t0 = time.perf_counter()
                with ThreadPoolExecutor(a.concurrency) as pool:
                    rs = list(pool.map(lambda x, m=m: cl.complete(x, greedy, modes[m]), work))
                conc[c][m] = sum(len(r.token_ids) for r in rs) / (time.perf_counter() - t0)

    med = statistics.median
    cpu = cpu_name()
    print(f"\nmachine: {cpu}, {a.threads} torch threads; SmolLM2-135M-Instruct fp32 CPU; greedy, {n} new tokens")
    print(f"{a.prompts} prompts per category; tokens/s = median over prompts, end to end (prefill included)\n")
    print(
        "| category | HF generate | HF prompt lookup (best K) | plain (service) | n-gram (service) | n-gram vs plain "
        f"| n-gram vs HF PLD | tokens/step | {a.concurrency} streams plain | {a.concurrency} streams n-gram | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cats:
        if a.no_hf:
            hf[c] = {"greedy": [float("nan")], "pld0": [float("nan")]}
        pld_key = max((k for k in hf[c] if k.startswith("pld")), key=lambda k: med(hf[c][k]))
        pld = med(hf[c][pld_key])
        p, g = med(single[c]["plain"]), med(single[c]["ngram"])
        print(
            f"| {c} | {med(hf[c]['greedy']):.1f} | {pld:.1f} (K={pld_key[3:]}) | {p:.1f} | {g:.1f} | {g / p:.2f}x "
            f"| {g / pld:.2f}x | {med(accept[c]):.2f} | {conc[c]['plain']:.1f} | {conc[c]['ngram']:.1f} "
            f"| {conc[c]['ngram'] / conc[c]['plain']:.2f}x |"
        )
    print(
        "\nlosslessness: "
        + ("all greedy outputs identical" if not failures else "FAILURES:\n  " + "\n  ".join(failures))
    )


if __name__ == "__main__":
    main()
