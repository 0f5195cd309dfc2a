"""Linear layers through oneDNN with weights packed once, for the CPU verifier.

A verification step multiplies a few rows (the batch's pending tokens plus tree nodes) by every
weight matrix. On a CPU whose memory bandwidth, not arithmetic, bounds that step, the stock
``F.linear`` path (MKL sgemm) re-packs each weight for every call with more than one row: a
2-row step reads the weights about twice. SmolLM2-135M on a 2-core EPYC, one row after 700
cached tokens (forward + logits, median): width 1 71 → 57 ms, width 2 118 → 60 ms, width 16
137 → 83 ms. oneDNN's blocked layout, made once here (``_reorder_linear_weight``), is read as is.

Steps of at most ``GEMV_ROWS`` rows (24 or 48: plain decode up to that batch, trees of a few rows) are bound by that
one read, which oneDNN spends 1.6x on at one row: with ``gemv`` the plain weight is kept beside the packed
one and such steps go through ``specmesh_kernels.cpu_linear``'s kernel (SmolLM2-135M's linears at 1 row:
35 → 22 ms; the whole batch-1 decode step 1.23x faster, a batch-8 one 0.71x the time of oneDNN's,
docs/bench/issue55-cpu; larger steps stay on oneDNN). That costs the weights' memory twice.

The product is the same up to floating-point reduction order (|Δlogit| ≲ 1e-4 on SmolLM2), as
it already is between stock calls of different row counts; greedy equality with transformers'
own ``generate()`` is tested through the verifier service.
"""

from __future__ import annotations

import torch

from specmesh.paths import cache_dir
from specmesh_kernels import cpu_linear
from specmesh_server.flags import ServiceFlags

# The weight layout is blocked for about this many rows (steps bring 1 … ~100; measured flat
# between 16 and 64, slower when packed for 1 row).
ROWS_HINT = 64
# Steps of at most this many rows go through the kernel (with ``gemv``): 48 on a CPU with AVX-512, 24 with
# AVX2 alone, where each beats oneDNN (``cpu_linear.row_limit``).
GEMV_ROWS = cpu_linear.row_limit()


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing applies to float32 linears on a CPU build with oneDNN."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


LINEARS = ("gemv", "packed", "stock")


def effective(linears: str, device: torch.device, dtype: torch.dtype) -> str:
    """The linears that run for ``--linears linears``: stock where oneDNN packing is unsupported,
    packed where the kernel is (e.g. ``effective("gemv", torch.device("cuda"), torch.float32)`` → stock)."""
    if linears not in LINEARS:
        raise ValueError(f"linears: one of {LINEARS}, not {linears!r}")
    if linears == "stock" or not supported(device, dtype):
        return "stock"
    return "gemv" if linears == "gemv" and gemv_supported() else "packed"


def describe(linears: str) -> str:
    """The start-up line's words for the linears that run."""
    return {
        "gemv": f"oneDNN with pre-packed weights; steps of at most {GEMV_ROWS} rows through SpecMesh's kernel",
        "packed": "oneDNN with pre-packed weights",
        "stock": "transformers' own",
    }[linears]


def gemv_supported() -> bool:
    """Whether the matrix-vector kernel runs here (built once into the cache folder; False where this
    CPU lacks AVX2/FMA or no compiler is found, logged)."""
    return cpu_linear.load(cache_dir() / "extensions")


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` for inference with its weight in oneDNN's blocked layout (no autograd); with
    ``gemv``, steps of at most ``GEMV_ROWS`` rows read the plain weight through the kernel instead."""

    def __init__(self, linear: torch.nn.Linear, rows_hint: int = ROWS_HINT, gemv: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)  # opaque
        self.bias = None if linear.bias is None else linear.bias.detach()
        # [out, in] contiguous, or None; at most this many input elements go through the kernel
        self.plain = linear.weight.detach().contiguous() if gemv else None
        self.gemv_numel = GEMV_ROWS * self.in_features if gemv else 0

    @property
    def gemv_rows(self) -> int:
        """The most rows a step may bring to go through the kernel (0 without ``gemv``)."""
        return self.gemv_numel // self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        if self.plain is not None and x.numel() <= self.gemv_numel:
            return cpu_linear.linear(x, self.plain, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"gemv={self.plain is not None}"
        )


def linear_reference(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """What :class:`PackedLinear` computes, the stock way."""
    return torch.nn.functional.linear(x, linear.weight, linear.bias)


def pack_linears(model: torch.nn.Module, rows_hint: int = ROWS_HINT, gemv: bool = False) -> int:
    """Replace every ``nn.Linear`` of ``model`` in place by a :class:`PackedLinear`; returns how many.

    A tied output head gets its own packed copy; the input embedding keeps the original (and, with
    ``gemv``, is the head's plain weight: tied, not copied).
    """
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, torch.nn.Linear)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, rows_hint, gemv))
    return len(swaps)


def add_linears_flag(flags: ServiceFlags) -> None:
    """``--linears gemv|packed|stock``, shared by the services that run a model through ``ModelRunner``."""
    flags.add(
        "--linears",
        "gemv",
        str,
        "CPU float32: packed = linear layers through oneDNN with weights packed once at start-up "
        f"(faster multi-token steps); gemv = packed, and steps of at most {GEMV_ROWS} rows through SpecMesh's "
        "AVX2 matrix-vector kernel (faster decode; the weights held twice); stock = transformers' own",
        choices=list(LINEARS),
    )
