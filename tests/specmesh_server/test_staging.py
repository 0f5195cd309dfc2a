"""``staging``: many small host tensors reach a device in one copy, as views of one buffer, bit for bit."""

from __future__ import annotations

import pytest
import torch

from specmesh_server.staging import ALIGN, pack, unpack, upload


def _mixed() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(-(2**62), 2**62, (3, 5), generator=g),  # int64
        torch.tensor([True, False, True]),  # bool, 3 bytes: the next field is realigned
        torch.rand(2, 3, 4, generator=g, dtype=torch.float64),
        torch.zeros(0, 4),  # empty
        torch.randint(-128, 127, (7,), generator=g, dtype=torch.int8),
        torch.rand(5, generator=g)[::2],  # not contiguous
        torch.tensor(3.5),  # 0-dim
        torch.randint(0, 9, (4,), generator=g, dtype=torch.int32),
    ]


def test_packed_fields_come_back_bit_for_bit_with_aligned_offsets():
    tensors = _mixed()
    buf, fields = pack(tensors)
    assert buf.dtype == torch.uint8 and all(f.offset % ALIGN == 0 for f in fields)
    back = unpack(buf, fields)
    for t, b in zip(tensors, back, strict=True):
        assert b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t)
    # views of the one buffer: nothing copied on the way out
    assert all(b.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for b in back if b.numel())


def test_on_a_cpu_upload_hands_the_tensors_back():
    tensors = _mixed()
    for t, b in zip(tensors, upload(tensors, torch.device("cpu")), strict=True):
        assert torch.equal(b, t) and b.is_contiguous()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the pinned, non-blocking copy")
def test_on_cuda_upload_is_one_copy_without_a_host_wait():
    tensors = _mixed()
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call in upload raises
    try:
        staged = upload(tensors, dev)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for t, b in zip(tensors, staged, strict=True):
        assert b.device.type == "cuda" and torch.equal(b.cpu(), t)
