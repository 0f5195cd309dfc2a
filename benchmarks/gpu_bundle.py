"""``make gpu-bundle``: what the GPU machine lacks for ``make gpu-check``, downloaded here into ``.whl/``.

The GPU machine (x86-64, Python 3.12, no network) has torch, triton, transformers, accelerate, grpcio,
protobuf, prometheus-client, tokenizers, safetensors, httpx and numpy. This script
1. imports everything the check and the services it starts import, maps those modules to their
   distributions, and names any that neither the GPU image (those packages and what they require)
   nor the bundle provides: such a gap shows here, not on the GPU;
2. downloads cp312 manylinux wheels, pinned to this venv's versions, of what the image lacks or has in
   an unknown version that the generated stubs check (grpcio, protobuf and the grpc plug-ins);
   transformers + huggingface-hub (with the httpx2 stack and click it needs) into ``.whl/fallback`` (used
   there only if the machine's transformers is older than pyproject's floor), where it fits the carry, and
   numba + llvmlite (the suffix proposer), where tree + bundle stay within ``OPTIONAL_CEILING``; a tier
   that does not fit is named with the total it would make and by how much it is over;
3. zips the default model's tokenizer files into ``.whl/tokenizer.zip`` (gpu_check.py unpacks them; the
   weights stay behind: the check builds random-weight models there);
4. checks that the tree plus ``.whl/`` fit the 64 MiB a device run carries, and prints the command.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".whl"
CARRY_LIMIT = 64 * 2**20
# Optional wheels leave room for the tree to grow between bundling and the run (a 2026-11-27 run was refused
# when bench records pushed it over the carry).
OPTIONAL_CEILING = 58 * 2**20
GPU_PYTHON = "3.12"  # the GPU machine's (gpu_check.py's BUNDLE_PYTHON)
GPU_IMAGE = (
    "torch", "triton", "transformers", "accelerate", "grpcio", "protobuf", "prometheus-client", "tokenizers",
    "safetensors", "httpx", "numpy",
)  # fmt: skip
# Always bundled: the stubs under specmesh/v1 were generated for these versions and check them at import.
PINNED = ("grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection", "redis")
# xgrammar's (structured outputs) pydantic: this venv's transformers/hub closure holds it, the GPU image's older
# one did not (2026-11-27: every verifier import failed on ``No module named 'pydantic'``).
IMAGE_LACKS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection")
TESTING = ("pytest", "pytest-timeout", "pygments")  # the check's gpu_tests section (with what they require)
OPTIONAL = ("numba", "llvmlite")  # the suffix proposer: 3.7 + 56.9 MiB (0.68.1, 0.50.0), with the tree over 64
# Used on the GPU machine only where its own transformers is older than pyproject's floor (gpu_check.py):
# with huggingface-hub 2.x come the HTTP stack it imports at start-up (httpx2, not the image's httpx) and
# the click it requires (the first GPU run, docs/gpu/, failed on ``No module named 'httpx2'``).
FALLBACK = ("transformers", "huggingface-hub", "httpx2", "httpcore2", "truststore", "click")
# Modules the check's process and its services import (the services' own imports come along).
ENTRY_MODULES = (
    "verifier_svc.server", "verifier_svc.engine", "proposer_svc.suffix.server", "proposer_svc.draft.proposer",
    "proposer_svc.oracle", "specmesh.cli", "specmesh.health", "specmesh.deploy", "specmesh_server.model_loading",
    "gpu_kit.end_to_end", "gpu_kit.numbers", "gpu_kit.engine_profile", "gpu_kit.kernel_checks", "gpu_kit.environment",
)  # fmt: skip
# Imported here but optional where they are absent (transformers probes for them; numba imports scipy, 34 MB,
# where it is installed), not used at run time, or (httpx2, httpcore2, truststore) brought by FALLBACK with the
# huggingface-hub that needs them.
NOT_NEEDED = {"pillow", "grpcio-tools", "truststore", "setuptools", "specmesh", "httpx2", "httpcore2", "scipy"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64")


def canonical(name: str) -> str:
    """PEP 503 name.

    >>> canonical("Prometheus_Client"), canonical("grpcio.tools")
    ('prometheus-client', 'grpcio-tools')
    """
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements_closure(roots: tuple[str, ...]) -> set[str]:
    """``roots`` and everything they require on the GPU machine (Linux, CPython 3.12, no extras), read
    from this venv's metadata; a requirement not installed here ends the walk at its name."""
    from packaging.requirements import Requirement

    target = {"python_version": GPU_PYTHON, "python_full_version": GPU_PYTHON + ".0", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "extra": ""}  # fmt: skip
    seen: set[str] = set()
    todo = [canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for text in reqs:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(target):
                todo.append(canonical(req.name))
    return seen


def imported_distributions() -> set[str]:
    """Distributions of every top-level module the entry modules import."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    for m in ENTRY_MODULES:
        importlib.import_module(m)
    owners = md.packages_distributions()
    return {canonical(d) for top in {n.split(".")[0] for n in sys.modules} for d in owners.get(top, [])}


def download(names: list[str], dest: Path) -> None:
    specs = [f"{n}=={md.version(n)}" for n in names]
    plats = [x for p in PLATFORMS for x in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           GPU_PYTHON, "--implementation", "cp", *plats, "-d", str(dest), *specs]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"gpu-bundle: pip download failed:\n{done.stdout}{done.stderr}")


def tree_bytes() -> int:
    """Bytes of what a device run carries besides .whl/: tracked files and untracked, not ignored ones."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def mib(n: int) -> str:
    """Bytes in MiB, one decimal.

    >>> mib(58 * 2**20), mib(3_890_001)
    ('58.0', '3.7')
    """
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-optional", action="store_true", help="leave numba/llvmlite out even if they fit")
    args = ap.parse_args(argv)

    image = requirements_closure(GPU_IMAGE)
    gap = imported_distributions() - image - NOT_NEEDED - set(PINNED) - set(OPTIONAL)
    if gap:
        print(f"gpu-bundle: also bundling what the GPU image may lack: {', '.join(sorted(gap))}")
    wanted = sorted(
        set(PINNED)
        | set(TESTING)
        | set(IMAGE_LACKS)
        | ((requirements_closure((*TESTING, *gap)) | gap) - image - NOT_NEEDED)
    )
    BUNDLE.mkdir(exist_ok=True)
    for old in BUNDLE.glob("*.whl"):
        old.unlink()
    for built in ("site", "fallback-site"):
        shutil.rmtree(BUNDLE / built, ignore_errors=True)
    download(wanted, BUNDLE)

    from transformers import AutoTokenizer

    from specmesh_server.model_loading import resolve_model_path

    # Zipped (3.5 MB → under 1 MB of the carry); gpu_check.py unpacks it into .whl/tokenizer.
    shutil.rmtree(BUNDLE / "tokenizer", ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        AutoTokenizer.from_pretrained(resolve_model_path()).save_pretrained(tmp)
        shutil.make_archive(str(BUNDLE / "tokenizer"), "zip", tmp)

    tree = tree_bytes()
    shutil.rmtree(BUNDLE / "fallback", ignore_errors=True)
    tiers = [
        (FALLBACK, BUNDLE / "fallback", CARRY_LIMIT, "the check needs the machine's transformers to be recent enough"),
        (OPTIONAL, BUNDLE, OPTIONAL_CEILING, "the check skips the suffix proposer unless the GPU image has numba"),
    ]
    for names, dest, ceiling, without in tiers if not args.no_optional else tiers[:1]:
        extra = BUNDLE / "incoming"
        shutil.rmtree(extra, ignore_errors=True)
        before = tree + dir_bytes(BUNDLE)  # what is carried without them (``extra`` lies inside .whl/)
        download(list(names), extra)
        size = dir_bytes(extra)
        sizes = ", ".join(f"{w.name.split('-')[0]} {w.stat().st_size / 2**20:.1f}" for w in sorted(extra.glob("*.whl")))
        if before + size <= ceiling:
            dest.mkdir(exist_ok=True)
            for w in extra.glob("*.whl"):
                w.rename(dest / w.name)
        else:
            over = before + size - CARRY_LIMIT
            carry = (
                f", {mib(over)} MiB over the {mib(CARRY_LIMIT)} MiB a run carries"
                if over > 0 and ceiling < CARRY_LIMIT
                else ""
            )
            print(
                f"gpu-bundle: {' + '.join(names)} ({sizes} MiB) do not fit: with them tree + .whl would be "
                f"{mib(before + size)} MiB, {mib(before + size - ceiling)} MiB over the {mib(ceiling)} MiB allowed "
                f"them{carry}: {without}"
            )
        shutil.rmtree(extra, ignore_errors=True)
    total = tree + dir_bytes(BUNDLE)
    wheels = sorted(str(w.relative_to(BUNDLE)) for w in BUNDLE.rglob("*.whl"))
    print(f"gpu-bundle: {len(wheels)} wheels in .whl/: {', '.join(wheels)}")
    print(
        f"gpu-bundle: total {mib(total)} MiB (tree {mib(tree)} MiB + .whl {mib(dir_bytes(BUNDLE))} MiB) of the "
        f"{CARRY_LIMIT / 2**20:.0f} MiB a device run carries"
    )
    if total > CARRY_LIMIT:
        print("gpu-bundle: over the limit: the run would not carry it", file=sys.stderr)
        return 1
    print('gpu-bundle: on the GPU machine run (device tool, carry [".whl"], timeout_s 480):')
    print("    make gpu-check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
