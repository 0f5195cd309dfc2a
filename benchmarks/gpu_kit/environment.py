"""What the report is about: the machine, the versions, the measured copy bandwidth, the packages found."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import torch
from gpu_kit.context import CheckContext
from gpu_kit.report import Deadline, Section


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown (no nvidia-smi)"


def header(ctx: CheckContext) -> dict[str, Any]:
    from gpu_kit.numbers import copy_bandwidth

    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        device = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
    else:
        from specmesh_bench.cli import cpu_name

        device = f"CPU: {cpu_name()}"
    try:  # on CUDA this is Triton's first launch: it builds its driver stub with the C compiler
        bw = copy_bandwidth(ctx.device)
        bandwidth = f"{bw / 1e9:.0f} GB/s (device-to-device copy, read + write)"
    except Exception as exc:  # the report must still be written: the environment section says why
        bandwidth = f"not measured: {type(exc).__name__}: {str(exc)[:200]}"
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": "quick dry run" if ctx.quick else "full",
        "device": device,
        "driver": driver_version() if ctx.cuda else "—",
        "cuda": torch.version.cuda or "—",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "copy bandwidth": bandwidth,
        "tokenizer": str(ctx.tokenizer) if ctx.tokenizer else "none (prompts of random ids)",
    }


def environment_section(ctx: CheckContext, sec: Section, deadline: Deadline) -> None:
    """The packages the services import, and the Triton mode the kernels run in."""
    from specmesh_kernels import tree_attention
    from specmesh_kernels._runtime import interpreted

    t = sec.table("packages", ["package", "version"])
    for dist in ("torch", "triton", "transformers", "accelerate", "grpcio", "protobuf", "numpy", "numba", "redis"):
        t.rows.append([dist, _version(dist)])
    mode = "interpreter" if interpreted(tree_attention._tree_attention_kernel) else "compiled"
    sec.summary = f"Triton kernels {mode} on {ctx.device}"
    # Triton compiles a small C launcher per kernel signature: it needs a C compiler and Python.h.
    cc = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    t.rows.append(["C compiler (Triton's launcher)", cc or "none"])
    t.rows.append(["Python.h", "found" if headers.is_file() else f"missing ({headers})"])
    if ctx.cuda and mode == "interpreter":
        sec.fail("TRITON_INTERPRET is set on a CUDA machine: the kernels would not be compiled")
    if ctx.cuda and (cc is None or not headers.is_file()):
        sec.fail("Triton cannot build its launchers here (no C compiler or no Python.h): every kernel will fail")
