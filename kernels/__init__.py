"""Triton kernels for the hot paths, each beside its pure-torch ``*_reference()``.

- ``tree_attention``: attention of every request's tree rows over its slot of the KV cache.
- ``tree_accept``: batched greedy / multi-step speculative-sampling acceptance on the device.

Triton reads ``TRITON_INTERPRET`` once, when a kernel is decorated. On a machine without CUDA
this package turns the interpreter on before any of its kernels is defined (unless the caller
already chose, or triton was imported earlier), so the kernels run exactly, if slowly, on the
CPU and tests exercise their logic; on CUDA they compile for the GPU.
"""

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
