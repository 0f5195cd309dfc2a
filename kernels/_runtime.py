"""Device checks shared by the kernel launchers."""

from __future__ import annotations

import functools
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
        return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)
    return 1


@functools.cache
def _cuda_sms(index: int) -> int:  # asked once per device: every layer's launch plans with it
    return torch.cuda.get_device_properties(index).multi_processor_count
