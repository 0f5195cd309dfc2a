"""A float32 linear layer for a few rows on a CPU (AVX2 + FMA): the C++ kernel beside this file,
its loader and its reference.

At batch 1 a decode step multiplies one row by every weight matrix, so it costs one read of the
weights. oneDNN (packed weights) and MKL (stock ``F.linear``) spend 1.6–2.2x that read on such
products: on a 2-core EPYC, SmolLM2-135M's 211 linears at 1 row take 35–53 ms, this kernel 17 ms
(~31 GB/s; ``Tensor.sum`` over the same bytes read 28 GB/s that hour). Each thread reads its weight
rows one after another, one sequential stream (reading 8 rows side by side, 8 streams, was 1.4–1.6x
slower). Steps of more rows take 3 weight rows at a time by 4 rows of x in registers, which beats oneDNN's
blocked GEMM to about 24 rows on a Zen 3 (8 rows: 32 against 50 ms); where the build has AVX-512, 4 weight
rows by 6 pairs of rows, each pair's two 8-lane sums in one 16-lane vector (the same bits), which beat it to
about 48 on a Zen 5 (32 rows: 29 against 33 ms). The caller chooses by row count (:func:`row_limit`,
``specmesh_server.packed_linear``).

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
BASE_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
# where the CPU has them (Zen 4, Ice Lake and later): the u8·s8 dot product of the GGUF kernels in one
# instruction (vpdpbusd) instead of two; the same integers, so the same bits either way
VNNI_CFLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
STALE_LOCK_S = 600  # a build takes ~20-60 s; a lock this old is a killed builder's
# ggml's numbers for the block formats ``linear_gguf`` reads (gguf.GGMLQuantizationType)
GGML_Q4_1, GGML_Q8_0 = 3, 8
BLOCK_BYTES = {GGML_Q4_1: 20, GGML_Q8_0: 34}  # a block of 32 weights, the file's layout
# the other kinds of weight ``decode_layers`` multiplies by: this module's float32 kernel, oneDNN's packed weights
FLOAT32, ONEDNN = -1, -2


def vnni_supported() -> bool:
    """Whether this CPU has AVX-512 VNNI with VL (Linux's /proc/cpuinfo flags)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))


def cflags() -> tuple[str, ...]:
    """The build's flags on this CPU (part of the built library's folder name, so a CPU without VNNI never
    loads a library built with it)."""
    return BASE_CFLAGS + (VNNI_CFLAGS if vnni_supported() else ())


def row_limit() -> int:
    """The most rows of x a product takes this kernel for rather than oneDNN's packed weights
    (``specmesh_server.packed_linear``): 48 where the build has AVX-512 (pairs of rows in 16-lane
    multiply-adds; on a 2-core Zen 5, SmolLM2-135M's 211 linears at 32 rows 29 ms against oneDNN's 33, a
    tie at 64), 24 with AVX2 alone (3 × 4 tiles of 8 lanes; on a 2-core Zen 3, 24 rows 77 against 88 ms,
    a tie at 32)."""
    return 48 if vnni_supported() else 24


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
    flags = cflags()
    digest = hashlib.sha256(code + " ".join(flags).encode() + torch.__version__.encode())
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
                extra_cflags=list(flags),
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
    ordered: bool = False,
) -> torch.Tensor:
    """Every decoder layer of a CPU step over the paged cache read in place (after :func:`load`); returns
    x after the last layer (before the final norm). See ``cpu_decoder.cpp``.

    x: float32 [b, n, hidden]; cos, sin: [b·n, D]; norms: per layer the input and post-attention norms'
    weights; products: per layer qkv, o, gate_up, down (fused: q/k/v and gate/up concatenated) or q, k, v,
    o, gate, up, down; kinds: each product's (``FLOAT32``: this module's kernel, ``ONEDNN``: a weight packed
    by ``torch.ops.mkldnn._reorder_linear_weight``, otherwise a GGUF type for :func:`linear_gguf`); pools:
    keys, values float32 [layers, kv_heads, slots, D]; mask: the folded mask float32 [B, 1, g·w, kv_len].
    ``packing``: a packed step's (x [1, N, hidden]) each token's row and column int64 [N] in the padded
    layout [B, w] attention reads, and w; None: attention reads x's own rows. ``ordered``: attention in key
    order (:func:`ordered_attention`), as a model over GGUF blocks takes it; otherwise flash attention per run.
    """
    r = reads
    rows, cols, width = packing if packing is not None else (None, None, 0)
    return torch.ops.specmesh_cpu.decode_layers(
        x, cos, sin, norms, products, kinds, *pools, r.write, r.read_blocks, r.block_size, r.runs, r.gathered,
        list(r.positions), mask, rows, cols, width, heads, kv_heads, eps, scaling, ordered,
    )  # fmt: skip


def ordered_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    copied_keys: torch.Tensor,
    copied_values: torch.Tensor,
    runs: torch.Tensor,
    gathered: torch.Tensor,
    positions: list[torch.Tensor],
    mask: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention in key order, as :func:`decode_layers` computes it for GGUF steps (after :func:`load`): q
    [B, kv_heads, g·n, D] (folded queries) over the pools [kv_heads, slots, D] and the copies
    [kv_heads, copied, D] (or empty), each row's runs and copied run as :class:`InPlaceReads` holds them, the
    folded mask [B or 1, 1, g·n or 1, columns] → [B, kv_heads, g·n, D]."""
    return torch.ops.specmesh_cpu.ordered_attention(
        q, keys, values, copied_keys, copied_values, runs, gathered, positions, mask, scaling
    )


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What :func:`linear` computes, the stock way."""
    return torch.nn.functional.linear(x, weight, bias)


def linear_gguf(x: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """x [..., K] float32 · W[N, K]ᵀ with W as GGUF blocks of ``kind`` (``GGML_Q4_1`` or ``GGML_Q8_0``) repacked
    by :func:`pack_gguf` → [..., N] (after :func:`load`), in ggml's manner: x quantized to int8 per
    32 values, each block's integer dot product exact, the blocks' float terms added in order
    (:func:`linear_gguf_reference`, the same bits). A row's result is the same bits whatever the number of rows."""
    return torch.ops.specmesh_cpu.linear_gguf(x, blocks, kind)


GROUP = 8  # weight rows :func:`pack_gguf` interleaves: one 32-byte vector holds 4 weights of each


def pack_gguf(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """A GGUF tensor's blocks uint8 [N, K / 32 · block bytes] (N a multiple of 8) → the groups
    :func:`linear_gguf` reads, uint8 [N / 8, K / 32 · record bytes]: the same bits regrouped, per 8 rows
    one record per block (``cpu_linear.cpp`` draws them):

    - Q4_1, 160 bytes: the 8 rows' fp16 d, their fp16 m, then for c < 4 the 32 bytes
      ``w[n, 8c + j] | w[n, 8c + 4 + j] << 4`` at 4n + j (n < 8 the row, j < 4);
    - Q8_0, 272 bytes: the 8 rows' fp16 d, then for c < 8 the 32 bytes ``qw[n, 4c + j] + 128`` at 4n + j.

    >>> one = torch.tensor([0, 60, 0, 0] + [0x21] * 16, dtype=torch.uint8).repeat(8, 1)  # Q4_1, d = 1.0, m = 0
    >>> packed = pack_gguf(one, GGML_Q4_1)   # weights 0-15 are 1, 16-31 are 2: chunk 0 holds 1 | 1 << 4
    >>> packed.shape, packed[0, :2].tolist(), packed[0, 32:36].tolist(), packed[0, 96:98].tolist()
    (torch.Size([1, 160]), [0, 60], [17, 17, 17, 17], [34, 34])
    >>> torch.equal(unpack_gguf(packed, GGML_Q4_1, 32), one)
    True
    """
    size = _block_bytes(kind)
    n = blocks.shape[0]
    if n % GROUP:
        raise ValueError(f"pack_gguf: {n} weight rows, not a multiple of {GROUP}")
    b = blocks.view(n // GROUP, GROUP, -1, size)  # [G, 8, nb, bytes]
    groups, _, nb, _ = b.shape
    dw = b[..., 0:2].permute(0, 2, 1, 3).reshape(groups, nb, 16)  # [G, nb, 8 · fp16]
    if kind == GGML_Q8_0:
        quants = (b[..., 2:] ^ 0x80).reshape(groups, GROUP, nb, 8, 4)  # [G, n, nb, c, j]: int8 qw → uint8 qw + 128
        parts = [dw]
    else:
        qs = b[..., 4:]  # [G, n, nb, 16]: weight j < 16 in the low nibble of byte j, 16 + j in its high one
        w = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(groups, GROUP, nb, 4, 2, 4)  # [G, n, nb, c, half, j]
        quants = w[..., 0, :] | (w[..., 1, :] << 4)  # [G, n, nb, c, j]
        parts = [dw, b[..., 2:4].permute(0, 2, 1, 3).reshape(groups, nb, 16)]
    parts.append(quants.permute(0, 2, 3, 1, 4).reshape(groups, nb, -1))  # [G, nb, c · n · j]
    return torch.cat(parts, dim=-1).reshape(groups, -1).contiguous()


def unpack_gguf(packed: torch.Tensor, kind: int, in_features: int) -> torch.Tensor:
    """:func:`pack_gguf` undone: the file's blocks uint8 [N, K / 32 · block bytes]."""
    nb, groups = in_features // 32, packed.shape[0]
    rec = packed.reshape(groups, nb, -1)
    halves = [rec[..., 0:16]] if kind == GGML_Q8_0 else [rec[..., 0:16], rec[..., 16:32]]
    scales = [h.reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3) for h in halves]  # [G, n, nb, 2]
    if kind == GGML_Q8_0:
        quants = rec[..., 16:].reshape(groups, nb, 8, GROUP, 4).permute(0, 3, 1, 2, 4) ^ 0x80  # [G, n, nb, c, j]
        quants = quants.reshape(groups, GROUP, nb, 32)
    else:
        byte = rec[..., 32:].reshape(groups, nb, 4, GROUP, 4).permute(0, 3, 1, 2, 4)  # [G, n, nb, c, j]
        w = torch.stack([byte & 15, byte >> 4], dim=-2).reshape(groups, GROUP, nb, 32)  # weight order
        quants = w[..., :16] | (w[..., 16:] << 4)
    return torch.cat([*scales, quants], dim=-1).reshape(groups * GROUP, -1)


def _block_bytes(kind: int) -> int:
    if kind not in BLOCK_BYTES:
        raise ValueError(f"GGUF block kind {kind}: only Q4_1 ({GGML_Q4_1}) and Q8_0 ({GGML_Q8_0})")
    return BLOCK_BYTES[kind]


def dequantize_reference(blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """GGUF blocks uint8 [N, K / 32 · block bytes] (the file's layout) → float32 [N, K], in torch.

    Q8_0, 34 bytes a block: fp16 d, int8 q[32]; w = d · q.
    Q4_1, 20 bytes a block: fp16 d, fp16 m, uint8 qs[16]; w[j] = d · (qs[j] & 15) + m, w[j + 16] = d · (qs[j] >> 4) + m.

    >>> one = torch.tensor([0, 60, 0, 0] + [0x21] * 16, dtype=torch.uint8)[None]   # d = 1.0 (fp16 0x3C00), m = 0
    >>> dequantize_reference(one, GGML_Q4_1)[0, [0, 16]].tolist()
    [1.0, 2.0]
    """
    d, m, q = _split_reference(blocks, kind)
    return (d * q.float() + m).reshape(blocks.shape[0], -1)


def _split_reference(blocks: torch.Tensor, kind: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The file's blocks → (d [N, nb, 1], m [N, nb, 1] float32 (0 for Q8_0), the integers [N, nb, 32])."""
    n, size = blocks.shape[0], _block_bytes(kind)
    b = blocks.view(n, -1, size)
    d = b[..., :2].contiguous().view(torch.float16).float()
    if kind == GGML_Q8_0:
        return d, torch.zeros_like(d), b[..., 2:].contiguous().view(torch.int8).long()
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    qs = b[..., 4:].long()
    return d, m, torch.cat([qs & 15, qs >> 4], dim=-1)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [M, K] → (q int [M, K / 32, 32], d float32 [M, K / 32]), as :func:`linear_gguf` quantizes its
    input, bit for bit: per 32 values d = max|x| / 127, q = round(x · (1 / d)), ties to even.

    >>> q, d = quantize_rows_reference(torch.linspace(-1.0, 1.0, 32)[None])
    >>> q[0, 0, [0, 16, 31]].tolist(), round(d.item() * 127, 6)
    ([-127, 4, 127], 1.0)
    """
    xb = x.reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1) / 127.0  # [M, nb]
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xb * inv[..., None]).long(), d


def linear_gguf_reference(x: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
    """What :func:`linear_gguf` computes over the file's blocks, in torch, bit for bit: y = 0, then for each
    block in order y = y + float(Σ qw q) · (dw · d), and for Q4_1 y = y + mw · (d · Σ q), each rounded."""
    xs = x.reshape(-1, x.shape[-1])
    q, d = quantize_rows_reference(xs)  # [M, nb, 32], [M, nb]
    dw, mw, qw = _split_reference(blocks, kind)  # [N, nb, 1] twice, [N, nb, 32]
    isum = torch.einsum("mbj,nbj->mnb", q, qw).float()  # exact integers (|Σ| < 2^24)
    s = d * q.sum(-1).float()  # [M, nb]
    y = torch.zeros(xs.shape[0], blocks.shape[0])
    for b in range(q.shape[1]):
        y = y + isum[..., b] * (dw[None, :, b, 0] * d[:, b, None])
        if kind == GGML_Q4_1:
            y = y + mw[None, :, b, 0] * s[:, b, None]
    return y.reshape(*x.shape[:-1], -1)
