"""Kernel tests run Triton's interpreter on a machine without CUDA.

Triton reads TRITON_INTERPRET once, when triton is first imported (transformers imports it through
torch._dynamo), so it is set here, before any test module of this directory imports anything.
"""

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import specmesh_kernels  # noqa: F401  (defines nothing yet; fixes the interpreter choice for this process)


@pytest.fixture(autouse=True)
def _kernels_can_run():
    from triton import knobs

    if not torch.cuda.is_available() and not knobs.runtime.interpret:
        pytest.skip("no CUDA, and triton was imported before TRITON_INTERPRET=1 could be set: run tests/kernels alone")
    torch.set_num_threads(1)
