"""A float32 linear layer for a few rows on a CPU (AVX2 + FMA): the C++ kernel beside this file,
its loader and its reference.

At batch 1 a decode step multiplies one row by every weight matrix, so it costs one read of the
weights. oneDNN (packed weights) and MKL (stock ``F.linear``) spend 1.6–2.2x that read on such
products: on a 2-core EPYC, SmolLM2-135M's 211 linears at 1 row take 35–53 ms, this kernel 17 ms
(~31 GB/s; ``Tensor.sum`` over the same bytes read 28 GB/s that hour). Each thread reads its weight
rows one after another, one sequential stream (reading 8 rows side by side, 8 streams, was 1.4–1.6x
slower). From about 4 rows on, oneDNN's blocked GEMM is as fast: the caller chooses by row count
(``specmesh_server.packed_linear``).

The same library holds the decoder loop that calls these linears (``cpu_decoder.cpp``,
:func:`decode_layers`): a CPU step's every layer in one call, the same operators in the same order as
``specmesh_server.lean_llama``'s Python loop (its reference, tested bit for bit), without a Python call
per operator.

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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)
# the linears, and the decoder loop that calls them (cpu_decoder.cpp): one library, specmesh_cpu
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_linear.cpp", "cpu_decoder.cpp"))
HEADER = Path(__file__).with_name("cpu_linear.h")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
STALE_LOCK_S = 600  # a build takes ~20-60 s; a lock this old is a killed builder's
# ggml's numbers for the block formats ``linear_gguf`` reads (gguf.GGMLQuantizationType)
GGML_Q4_1, GGML_Q8_0 = 3, 8
# the other kinds of weight ``decode_layers`` multiplies by: this module's float32 kernel, oneDNN's packed weights
FLOAT32, ONEDNN = -1, -2


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
    code = b"".join(p.read_bytes() for p in (*SOURCES, HEADER))
    digest = hashlib.sha256(code + " ".join(CFLAGS).encode() + torch.__version__.encode())
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
                sources=[str(p) for p in SOURCES],
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


@dataclass(frozen=True)
class InPlaceReads:
    """A forward's cache writes and each row's reads where they lie (``specmesh_server.paged_kv``), as
    :func:`decode_layers` takes them. Row r reads its runs (rows of ``runs`` whose first column is r, in
    order), then its copied run, if ``positions[r]`` holds any.

    >>> none = torch.empty(0, dtype=torch.long)
    >>> InPlaceReads.of([7], [], 16, [(0, 32, 0, 300, 1)], [(0, 0)], [none]).runs.tolist()
    [[0, 32, 0, 300, 1]]
    """

    write: torch.Tensor  # int64 [tokens]: each new token's slot
    read_blocks: torch.Tensor  # int64 [m]: the blocks the rows' short runs copy, in order
    block_size: int
    runs: torch.Tensor  # int64 [R, 5]: row, slot, start, stop, masked
    gathered: torch.Tensor  # int64 [b, 2]: per row its copied run's first slot in the copies, masked
    positions: tuple[torch.Tensor, ...]  # int64 [count] per row: the copied run's positions (empty: none)

    @staticmethod
    def of(write, read_blocks, block_size, runs, gathered, positions) -> InPlaceReads:
        """From plain lists, one (slot, masked) and one positions tensor per row."""
        return InPlaceReads(
            torch.as_tensor(write, dtype=torch.long),
            torch.as_tensor(read_blocks, dtype=torch.long),
            block_size,
            torch.as_tensor(runs, dtype=torch.long).view(-1, 5),
            torch.as_tensor(gathered, dtype=torch.long).view(len(positions), 2),
            tuple(positions),
        )


def decoder_loaded() -> bool:
    """Whether the library holding :func:`decode_layers` is loaded (:func:`load`)."""
    try:
        torch.ops.specmesh_cpu.decode_layers  # noqa: B018 (the lookup fails where it is not registered)
    except (AttributeError, RuntimeError):
        return False
    return True


def decode_layers(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norms: list[torch.Tensor],
    products: list[torch.Tensor],
    kinds: list[int],
    pools: tuple[torch.Tensor, torch.Tensor],
    reads: InPlaceReads,
    mask: torch.Tensor,
    heads: int,
    kv_heads: int,
    eps: float,
    scaling: float,
    packing: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Every decoder layer of a CPU step over the paged cache read in place (after :func:`load`); returns
    x after the last layer (before the final norm). See ``cpu_decoder.cpp``.

    x: float32 [b, n, hidden]; cos, sin: [b·n, D]; norms: per layer the input and post-attention norms'
    weights; products: per layer qkv, o, gate_up, down (fused: q/k/v and gate/up concatenated) or q, k, v,
    o, gate, up, down; kinds: each product's (``FLOAT32``: this module's kernel, ``ONEDNN``: a weight packed
    by ``torch.ops.mkldnn._reorder_linear_weight``, otherwise a GGUF type for :func:`linear_gguf`); pools:
    keys, values float32 [layers, kv_heads, slots, D]; mask: the folded mask float32 [B, 1, g·w, kv_len].
    ``packing``: a packed step's (x [1, N, hidden]) each token's row and column int64 [N] in the padded
    layout [B, w] attention reads, and w; None: attention reads x's own rows.
    """
    r = reads
    rows, cols, width = packing if packing is not None else (None, None, 0)
    return torch.ops.specmesh_cpu.decode_layers(
        x, cos, sin, norms, products, kinds, *pools, r.write, r.read_blocks, r.block_size, r.runs, r.gathered,
        list(r.positions), mask, rows, cols, width, heads, kv_heads, eps, scaling,
    )  # fmt: skip


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
