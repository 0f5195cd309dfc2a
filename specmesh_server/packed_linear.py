"""Linear layers through oneDNN with weights packed once, for the CPU verifier.

A verification step multiplies a few rows (the batch's pending tokens plus tree nodes) by every
weight matrix. On a CPU whose memory bandwidth, not arithmetic, bounds that step, the stock
``F.linear`` path (MKL sgemm) re-packs each weight for every call with more than one row: a
2-row step reads the weights about twice. SmolLM2-135M on a 2-core EPYC, one row after 700
cached tokens (forward + logits, median): width 1 71 → 57 ms, width 2 118 → 60 ms, width 16
137 → 83 ms. oneDNN's blocked layout, made once here (``_reorder_linear_weight``), is read as is.

The product is the same up to floating-point reduction order (|Δlogit| ≲ 1e-4 on SmolLM2), as
it already is between stock calls of different row counts; greedy equality with transformers'
own ``generate()`` is tested through the verifier service.
"""

from __future__ import annotations

import torch

from specmesh_server.flags import ServiceFlags

# The weight layout is blocked for about this many rows (steps bring 1 … ~100; measured flat
# between 16 and 64, slower when packed for 1 row).
ROWS_HINT = 64


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing applies to float32 linears on a CPU build with oneDNN."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` for inference with its weight in oneDNN's blocked layout (no autograd)."""

    def __init__(self, linear: torch.nn.Linear, rows_hint: int = ROWS_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)  # opaque
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def linear_reference(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """What :class:`PackedLinear` computes, the stock way."""
    return torch.nn.functional.linear(x, linear.weight, linear.bias)


def pack_linears(model: torch.nn.Module, rows_hint: int = ROWS_HINT) -> int:
    """Replace every ``nn.Linear`` of ``model`` in place by a :class:`PackedLinear`; returns how many.

    A tied output head gets its own packed copy; the input embedding keeps the original.
    """
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, torch.nn.Linear)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, rows_hint))
    return len(swaps)


def add_linears_flag(flags: ServiceFlags) -> None:
    """``--linears packed|stock``, shared by the services that run a model through ``ModelRunner``."""
    flags.add(
        "--linears",
        "packed",
        str,
        "CPU float32: packed = linear layers through oneDNN with weights packed once at start-up "
        "(faster multi-token steps); stock = transformers' own",
        choices=["packed", "stock"],
    )
