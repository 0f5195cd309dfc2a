"""SpecMesh on a GPU in one command (``make gpu-check``): kernels at real shapes, the verifier end to end,
host syncs, and the numbers, each section time-boxed; a report however far it got.

    python3 benchmarks/gpu_check.py                       # on the GPU machine (its own python3 and torch)
    python3 benchmarks/gpu_check.py --device cpu --quick  # the dry run `make test` runs (tiny, interpreted)

Writes ``gpu-report.md`` and ``gpu-report.json`` to ``$OUT`` when set (the device tool brings it back), else
``--out`` (default docs/gpu/ on a GPU, the scratch folder in a dry run). Exit status 0 when no section
failed (skipped and partial sections do not fail the run). Sections (``--sections`` picks some):

- environment: GPU, driver, CUDA, torch, triton, transformers, the measured copy bandwidth;
- tree_attention: the Triton kernel within dtype tolerance of its torch reference, over slot rows and
  through block tables (the verifier's paged pool);
- acceptance: the batched acceptance kernel identical to the host walk; sampled convergence;
- graphs: the static step replayed as CUDA graphs against the eager step (step table, launches, device-busy
  share, capture time and memory) for both shapes, and greedy equality with graphs on and off;
- end_to_end: the verifier process on the device (graphs, kernels on, kernels off), greedy equality with ``generate()``;
- decode_step: device→host copies per decode step (batch 8, 16-node trees) and the step's profile;
- draft: the draft proposer's device→host copies per proposal;
- cost_curves: verification cost per tree size, the oracle ceiling, plain decoding vs ``generate()``;
- attention_numbers: tree attention over rows and through block tables vs SDPA (and, last, compiled
  FlexAttention), as a share of the copy bandwidth;
- gpu_tests: the test suite's kernel tests that run on a GPU host (pytest, from the bundle).

Runs without installing SpecMesh: the checkout's packages are put on the path (``kernels/`` and
``router/`` under their installed names), and ``.whl/site`` too (``make gpu-bundle``'s wheels, unzipped).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE_PYTHON = (3, 12)  # the GPU machine's: benchmarks/gpu_bundle.py downloads wheels for it
SECTIONS = {  # name → (module, function, budget seconds on a GPU), in order of priority; --budget caps them all
    "environment": ("gpu_kit.environment", "environment_section", 15),
    "graphs": ("gpu_kit.graphs", "graphs_section", 120),
    "end_to_end": ("gpu_kit.end_to_end", "end_to_end_section", 110),
    "decode_step": ("gpu_kit.engine_profile", "decode_step_section", 30),
    "tree_attention": ("gpu_kit.kernel_checks", "tree_attention_section", 45),
    "acceptance": ("gpu_kit.kernel_checks", "acceptance_section", 45),
    "draft": ("gpu_kit.engine_profile", "draft_section", 15),
    "cost_curves": ("gpu_kit.numbers", "cost_section", 70),
    "attention_numbers": ("gpu_kit.numbers", "attention_section", 40),
    "gpu_tests": ("gpu_kit.suite", "suite_section", 90),
}


def transformers_recent(root: Path) -> bool:
    """Whether this python's transformers meets pyproject's floor (``transformers>=X``)."""
    import importlib.metadata
    import re

    floor = re.search(r'"transformers>=([0-9.]+)', (root / "pyproject.toml").read_text())
    try:
        have = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return False
    as_tuple = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:3])  # noqa: E731
    return floor is None or as_tuple(have) >= as_tuple(floor.group(1))


def unpack_bundle(root: Path) -> None:
    """Unzip the bundle's wheels (``make gpu-bundle``) into ``.whl/site`` and ``.whl/fallback-site``: a
    wheel is a zip of an importable tree, so no pip (nor network) is needed on the GPU machine; and its
    tokenizer into ``.whl/tokenizer``."""
    import zipfile

    if sys.version_info[:2] != BUNDLE_PYTHON:  # cp312 wheels: this python could not import them (nor is this
        return  # the GPU machine: a dry run here leaves .whl/ as bundled, within the carry's size)
    packed = root / ".whl" / "tokenizer.zip"  # the default model's tokenizer files, zipped to fit the carry
    if packed.is_file() and not (root / ".whl" / "tokenizer" / "tokenizer.json").is_file():
        with zipfile.ZipFile(packed) as z:
            z.extractall(root / ".whl" / "tokenizer")
    for wheels, site in (("*.whl", "site"), ("fallback/*.whl", "fallback-site")):
        found = sorted((root / ".whl").glob(wheels))
        stamp = root / ".whl" / site / ".unpacked"
        names = "\n".join(w.name for w in found)
        if not found or (stamp.is_file() and stamp.read_text() == names):
            continue
        for w in found:
            with zipfile.ZipFile(w) as z:
                z.extractall(root / ".whl" / site)
        stamp.write_text(names)


def checkout_on_path(root: Path, work: Path) -> None:
    """Make the checkout importable as installed (for this process and the services it starts): the
    bundle's site folder, then links ``specmesh_kernels`` → kernels/ and ``specmesh_router`` → router/."""
    import importlib.util

    bundled = sys.version_info[:2] == BUNDLE_PYTHON and (root / ".whl" / "site").is_dir()
    paths = [str(root / ".whl" / "site")] if bundled else []
    fallback = root / ".whl" / "fallback-site"
    if bundled and fallback.is_dir() and not transformers_recent(root):
        paths.append(str(fallback))
    if importlib.util.find_spec("specmesh_kernels") is None or importlib.util.find_spec("specmesh") is None:
        links = work / "path"
        links.mkdir(parents=True, exist_ok=True)
        for name, folder in (("specmesh_kernels", "kernels"), ("specmesh_router", "router")):
            if not (links / name).exists():
                (links / name).symlink_to(root / folder, target_is_directory=True)
        paths += [str(links), str(root)]
    paths.append(str(Path(__file__).resolve().parent))  # gpu_kit
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default=None, help="cuda, cuda:1, cpu … (default: cuda if present, else cpu)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few items (the CPU dry run)")
    ap.add_argument(
        "--out",
        default=None,
        help="report folder when $OUT is unset (default: docs/gpu/ on a GPU; a dry run's goes to its --work folder)",
    )
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (default: %(default)s)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset (default: all)")
    ap.add_argument(
        "--box",
        action="append",
        default=[],
        metavar="SECTION=SECONDS",
        help="a section's own time box for this run, e.g. end_to_end=200 (repeatable; --budget still caps all)",
    )
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="folder with tokenizer.json (default: .whl/tokenizer, else the default model's)",
    )
    ap.add_argument("--work", default=None, help="scratch folder (default: a new temporary one)")
    args = ap.parse_args(argv)
    boxes = {}
    for item in args.box:
        name, _, seconds = item.partition("=")
        try:
            boxes[name] = float(seconds)
        except ValueError:
            ap.error(f"--box {item}: want SECTION=SECONDS")
    unknown = (set(args.sections.split(",")) | set(boxes)) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections: {', '.join(sorted(unknown))} (known: {', '.join(SECTIONS)})")

    started = time.monotonic()
    work = Path(args.work or tempfile.mkdtemp(prefix="specmesh-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.device and not args.device.startswith("cuda"):
        # Kernels on CPU tensors need Triton's interpreter, chosen before triton is first imported
        # (the verifier processes this run starts inherit it).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    unpack_bundle(ROOT)
    checkout_on_path(ROOT, work)

    import torch
    from gpu_kit.context import CheckContext, find_tokenizer
    from gpu_kit.environment import header
    from gpu_kit.report import Deadline, Report

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (the dry run is --device cpu --quick)")
    if device.type == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    ctx = CheckContext(device, args.quick, work, find_tokenizer(ROOT, args.tokenizer), ROOT)
    default_out = ROOT / "docs" / "gpu" if device.type == "cuda" else work  # docs/gpu/ holds GPU reports only
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(args.out or default_out)
    try:
        head = header(ctx)
    except Exception as exc:  # a report however far the run gets: the header says what failed
        head = {"device": str(device), "header": f"failed: {type(exc).__name__}: {exc}"}
    report = Report(head, out)
    report.write()
    total = Deadline(args.budget - (time.monotonic() - started))
    scale = 1.0 if device.type == "cuda" else 2.0  # the interpreter is slow: the dry run's sections get longer
    import importlib

    for name in args.sections.split(","):
        module, fn, budget = SECTIONS[name]
        budget = boxes.get(name, budget)
        report.run(name, getattr(importlib.import_module(module), fn), ctx, budget * scale, total)
    print(f"gpu-check: report in {out}/gpu-report.md ({time.monotonic() - started:.0f} s)", flush=True)
    bad = [s.name for s in report.sections if s.status in ("fail", "error")]
    if bad:
        print(f"gpu-check: FAILED sections: {', '.join(bad)}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
