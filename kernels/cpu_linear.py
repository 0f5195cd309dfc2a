"""A float32 linear layer for a few rows on a CPU (AVX2 + FMA): the C++ kernel beside this file,
its loader and its reference.

At batch 1 a decode step multiplies one row by every weight matrix, so it costs one read of the
weights. oneDNN (packed weights) and MKL (stock ``F.linear``) spend 1.6–2.2x that read on such
products: on a 2-core EPYC, SmolLM2-135M's 211 linears at 1 row take 35–53 ms, this kernel 22 ms
(the memory reads ~28 GB/s; ``Tensor.sum`` over the same bytes ~30 GB/s). From about 8 rows on the
product is bound by arithmetic, where oneDNN's blocked GEMM wins: the caller chooses by row count
(``specmesh_server.packed_linear``).

The kernel (``cpu_linear.cpp``) is built once with torch's extension builder (g++, ninja) into a
folder the caller names, and runs on torch's own intra-op thread pool (``at::parallel_for``), so it
shares the threads of the ops around it.

    >>> import torch
    >>> x, w = torch.ones(1, 16), torch.arange(32.0).view(2, 16)
    >>> linear_reference(x, w, None).tolist()
    [[120.0, 376.0]]
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_linear.cpp")


def cpu_supported() -> bool:
    """The kernel needs AVX2 and FMA (every x86-64 server CPU since 2013; torch reports them as AVX2)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def load(build_dir: Path) -> bool:
    """Build (once per source; later calls and processes reuse ``build_dir``) and register
    ``torch.ops.specmesh_cpu.linear``; False, with the reason logged, where it cannot be built."""
    if not cpu_supported():
        log.warning("cpu_linear: this CPU has no AVX2/FMA; the kernel is not used")
        return False
    from torch.utils.cpp_extension import load as build

    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        build(
            name="specmesh_cpu",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
        )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler or ninja: the caller keeps its own path
        log.warning("cpu_linear: the kernel could not be built (%s); the caller keeps its own linears", exc)
        return False
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ (+ bias [N]) → [..., N], float32 CPU tensors (after :func:`load`)."""
    return torch.ops.specmesh_cpu.linear(x, weight, bias)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What :func:`linear` computes, the stock way."""
    return torch.nn.functional.linear(x, weight, bias)
