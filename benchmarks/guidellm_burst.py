"""A burst of prompts through the gateway: guidellm's first wave beside the same burst sent by a quiet
client, and beside guidellm run at the lowest CPU priority (issue 55's "the step under load").

    .venv/bin/python benchmarks/guidellm_burst.py --out docs/bench/issue55-cpu/burst

One verifier (plain decoding, ``--threads``, adaptive threads as deployed) and one gateway
(``specmesh.deploy.LocalDeployment``). Then, each wave of ``--streams`` requests of ``--prompt-tokens``
synthetic tokens and ``--output-tokens`` tokens (``ignore_eos``), every prompt cold (a fresh prefix):

- ``quiet``: one request alone, then the whole wave at once, from an ``openai`` client in this
  process (idle between its requests): each request's TTFT, i.e. each prompt's place in the line
  of prefills;
- ``guidellm``: ``guidellm run`` with a concurrent profile of ``--streams`` streams, ``2 × --streams``
  requests (its first wave, then a second as the first ends), per request the TTFT it reports;
- ``guidellm, nice 19``: the same at the lowest CPU priority.

While each guidellm run lasts, the processes' CPU is sampled (``top``, every 0.5 s): on a machine of
few cores guidellm's own data worker, which makes its synthetic prompts while the first wave is in
flight, takes a core from the verifier, and the verifier, which yields cores to busy neighbours
(``--adaptive-threads``), prefills at its one-thread pace. The output is ``burst.md`` in ``--out``
(guidellm's own reports stay in a temporary folder).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from common import cpu_name

from specmesh.deploy import DeploymentConfig, LocalDeployment, free_port
from specmesh_server.model_loading import resolve_model_path

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bright", "stars")


def prompt(tokenizer, tokens: int, tag: str) -> str:
    """A prompt of about ``tokens`` tokens that no earlier request shares a prefix with (``tag`` first)."""
    text, k = tag, 0
    while len(tokenizer(text).input_ids) < tokens:
        text += f" {WORDS[k % len(WORDS)]}{k % 7}"
        k += 1
    return text


async def quiet_wave(url: str, model: str, texts: list[str], output_tokens: int) -> list[float]:
    """Each request's TTFT (s), all sent at once from one idle client."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="none")

    async def one(text: str) -> float:
        t0 = time.perf_counter()
        stream = await client.completions.create(
            model=model, prompt=text, max_tokens=output_tokens, stream=True, extra_body={"ignore_eos": True}
        )
        first = None
        async for _ in stream:
            first = first or time.perf_counter() - t0
        return first or float("nan")

    try:
        return list(await asyncio.gather(*(one(t) for t in texts)))
    finally:
        await client.close()


def guidellm(url: str, model: str, args: argparse.Namespace, folder: Path, prefix: list[str]) -> dict:
    """One ``guidellm run``: per request (start offset s, TTFT s) in start order, and the CPU samples."""
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / "report.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": url.removesuffix("/v1"), "model": model, "timeout": 300},
        "profile": {"kind": "concurrent", "streams": [args.streams]},
        "constraints": [{"kind": "max_requests", "count": 2 * args.streams}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(resolve_model_path(None))},
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                  "output_tokens": args.output_tokens}],
        "outputs": [{"kind": "json", "path": str(report)}],
        "seed": {"kind": "static", "value": time.time_ns() % 2**31},  # each run's prompts new: no cache hits
    }}  # fmt: skip
    (folder / "scenario.json").write_text(json.dumps(scenario))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "GUIDELLM__MAX_WORKER_PROCESSES": "1", "GUIDELLM__DEFAULT_RESULTS_DIR": str(folder)}  # fmt: skip
    top_out = (folder / "top.txt").open("w")
    top = subprocess.Popen(["top", "-b", "-d", "0.5", "-w", "200"], stdout=top_out)
    cmd = [*prefix, sys.executable, "-m", "guidellm", "run", "--scenario", str(folder / "scenario.json")]
    try:
        subprocess.run([*cmd, "--disable-progress"], cwd=folder, capture_output=True, check=True, env=env)
    finally:
        top.terminate()
        top.wait()
        top_out.close()
    requests = json.loads(report.read_text())["benchmarks"][0]["requests"]["successful"]
    t0 = min(r["request_start_time"] for r in requests)
    timed = sorted((r["request_start_time"] - t0, r["time_to_first_token_ms"] / 1e3) for r in requests)
    return {"requests": timed, "cpu": cpu_by_command(folder / "top.txt")}


def cpu_by_command(top_text: Path) -> dict[str, float]:
    """Median CPU % per command over the samples where it used more than 5 %."""
    seen: dict[str, list[float]] = defaultdict(list)
    for line in top_text.read_text().splitlines():
        fields = line.split()
        busy = len(fields) >= 12 and fields[0].isdigit() and re.fullmatch(r"[\d.]+", fields[8])
        if busy and float(fields[8]) > 5:
            seen[f"{fields[11]} ({fields[0]})"].append(float(fields[8]))
    return {k: statistics.median(v) for k, v in seen.items() if len(v) >= 3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specmesh-burst-") as run_dir:
        config = DeploymentConfig(
            ngram_address="",
            suffix_address="",
            gateway_address=f"127.0.0.1:{free_port()}",
            verifier_threads=args.threads,
            run_dir=Path(run_dir),
        )
        with LocalDeployment(config) as dep:
            url = dep.gateway_url
            model = json.load(urllib.request.urlopen(url + "/models", timeout=30))["data"][0]["id"]

            def wave(n: int) -> list[float]:
                texts = [prompt(tokenizer, args.prompt_tokens, f"{time.time_ns()}-{i}") for i in range(n)]
                return asyncio.run(quiet_wave(url, model, texts, args.output_tokens))

            wave(args.streams)  # warm-up: the first prefills of each size
            alone = wave(1)[0]
            together = wave(args.streams)
            runs = {
                "guidellm": guidellm(url, model, args, Path(run_dir) / "guidellm", []),
                "guidellm, nice 19": guidellm(url, model, args, Path(run_dir) / "nice", ["nice", "-n", "19"]),
            }
    write(args, alone, together, runs)


def write(args: argparse.Namespace, alone: float, together: list[float], runs: dict[str, dict]) -> None:
    first = args.streams
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"# A burst of {args.streams} prompts of {args.prompt_tokens} tokens ({cpu_name()}, {args.threads} threads, "
        f"{when})\n",
        f"    .venv/bin/python benchmarks/guidellm_burst.py {' '.join(sys.argv[1:])}\n",
        f"One cold prompt alone: TTFT {alone:.2f} s. The same burst from a quiet client: "
        + ", ".join(f"{t:.2f}" for t in sorted(together))
        + " s.\n",
        "| client | first wave: each request's finish of TTFT from the wave's start, s | "
        "last / quiet client's last | second wave TTFT, s | processes' CPU % (median while busy) |",
        "|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        reqs = run["requests"]
        ends = sorted(start + ttft for start, ttft in reqs[:first])
        cpu = ", ".join(f"{k} {v:.0f}" for k, v in sorted(run["cpu"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {name} | {', '.join(f'{e:.2f}' for e in ends)} | {ends[-1] / max(together):.2f}x "
            f"| {', '.join(f'{t:.2f}' for _, t in reqs[first:])} | {cpu} |"
        )
    text = "\n".join(lines) + "\n"
    (args.out / "burst.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
