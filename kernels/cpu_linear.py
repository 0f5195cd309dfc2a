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
import hashlib
import logging
import subprocess
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_linear.cpp")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
STALE_LOCK_S = 600  # a build takes ~20-60 s; a lock this old is a killed builder's
# ggml's numbers for the block formats ``linear_gguf`` reads (gguf.GGMLQuantizationType)
GGML_Q4_1, GGML_Q8_0 = 3, 8


def cpu_supported() -> bool:
    """The kernel needs AVX2 and FMA (every x86-64 server CPU since 2013; torch reports them as AVX2)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def load(build_dir: Path) -> bool:
    """Register ``torch.ops.specmesh_cpu``: the library built for this source, flags and torch under
    ``build_dir`` is loaded as it is (no compiler needed); otherwise it is built there first (once; other
    processes wait on torch's lock, one left by a killed builder is cleared). False, with the reason
    logged, where it cannot be built (no AVX2/FMA/F16C, no compiler or ninja, no writable folder)."""
    if not cpu_supported():
        log.warning("cpu_linear: this CPU has no AVX2/FMA; the kernel is not used")
        return False
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode() + torch.__version__.encode())
    folder = build_dir / f"specmesh_cpu-{digest.hexdigest()[:16]}"
    library = folder / "specmesh_cpu.so"
    try:
        if not library.is_file():
            from torch.utils.cpp_extension import load as build

            folder.mkdir(parents=True, exist_ok=True)
            lock = folder / "lock"
            if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                lock.unlink(missing_ok=True)
            build(
                name="specmesh_cpu",
                sources=[str(SOURCE)],
                extra_cflags=list(CFLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                is_python_module=False,
            )
        else:
            torch.ops.load_library(str(library))
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as exc:
        log.warning("cpu_linear: the kernel could not be built or loaded (%s); the caller keeps its own linears", exc)
        return False
    return True


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ (+ bias [N]) → [..., N], float32 CPU tensors (after :func:`load`)."""
    return torch.ops.specmesh_cpu.linear(x, weight, bias)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What :func:`linear` computes, the stock way."""
    return torch.nn.functional.linear(x, weight, bias)


def linear_gguf(x: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """x [..., K] float32 · W[N, K]ᵀ with W as GGUF blocks, uint8 [N, K / 32 · block bytes] of ``kind``
    (``GGML_Q4_1`` or ``GGML_Q8_0``) → [..., N] (after :func:`load`). Each output row is the float32
    kernel's sum over the dequantized row, whatever the number of rows."""
    return torch.ops.specmesh_cpu.linear_gguf(x, blocks, kind)


def dequantize_reference(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """GGUF blocks uint8 [N, K / 32 · block bytes] → float32 [N, K], in torch.

    Q8_0, 34 bytes a block: fp16 d, int8 q[32]; w = d · q.
    Q4_1, 20 bytes a block: fp16 d, fp16 m, uint8 qs[16]; w[j] = d · (qs[j] & 15) + m, w[j + 16] = d · (qs[j] >> 4) + m.

    >>> one = torch.tensor([0, 60, 0, 0] + [0x21] * 16, dtype=torch.uint8)[None]   # d = 1.0 (fp16 0x3C00), m = 0
    >>> dequantize_reference(one, GGML_Q4_1)[0, [0, 16]].tolist()
    [1.0, 2.0]
    """
    n = blocks.shape[0]
    if kind == GGML_Q8_0:
        b = blocks.view(n, -1, 34)  # [N, blocks, 34]
        d = b[..., :2].contiguous().view(torch.float16).float()  # [N, blocks, 1]
        return (d * b[..., 2:].contiguous().view(torch.int8).float()).reshape(n, -1)
    if kind != GGML_Q4_1:
        raise ValueError(f"GGUF block kind {kind}: only Q4_1 ({GGML_Q4_1}) and Q8_0 ({GGML_Q8_0})")
    b = blocks.view(n, -1, 20)
    d, m = (b[..., i : i + 2].contiguous().view(torch.float16).float() for i in (0, 2))  # [N, blocks, 1] each
    qs = b[..., 4:]  # [N, blocks, 16]
    return (d * torch.cat([qs & 15, qs >> 4], dim=-1).float() + m).reshape(n, -1)


def linear_gguf_reference(x: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """What :func:`linear_gguf` computes, the stock way (up to summation order and the fused d · q + m)."""
    return torch.nn.functional.linear(x, dequantize_reference(blocks, kind))
