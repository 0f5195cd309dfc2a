"""Device checks shared by the kernel launchers."""

from __future__ import annotations

from typing import Any

import torch


def interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def runnable(kernel: Any, device: torch.device) -> Any:
    """The kernel, if it can run on ``device``: compiled kernels need CUDA tensors; CPU tensors
    need the interpreter (``TRITON_INTERPRET=1`` before triton is first imported)."""
    if device.type != "cuda" and not interpreted(kernel):
        raise RuntimeError(
            "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before triton is imported"
        )
    return kernel


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter runs programs one by one)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
