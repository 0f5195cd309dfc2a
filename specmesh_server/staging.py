"""Many small host tensors onto a device in one host→device copy.

A ``torch.tensor(list, device="cuda")`` or ``.to("cuda")`` of pageable host memory is a copy *and* a
stream synchronisation: the host waits for every kernel queued before it. A step that builds ten small
inputs that way waits ten times. :func:`upload` packs them into one pinned byte buffer, copies it
without blocking, and hands back device views of it: one copy, no wait (the pinned buffer is held by
torch's caching host allocator until the copy has run). On a CPU the tensors come back as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 16  # bytes: every field starts where any dtype's view of it may start


@dataclass(frozen=True)
class Field:
    offset: int  # bytes into the buffer
    dtype: torch.dtype
    shape: tuple[int, ...]


def pack(tensors: Sequence[torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, list[Field]]:
    """Host tensors → one uint8 buffer (pinned where ``pin``) and where each one lies in it.

    >>> buf, fields = pack([torch.tensor([1, 2]), torch.tensor([True]), torch.tensor([[0.5]])])
    >>> buf.numel(), [(f.offset, f.dtype, f.shape) for f in fields]
    (48, [(0, torch.int64, (2,)), (16, torch.bool, (1,)), (32, torch.float32, (1, 1))])
    """
    fields, offset = [], 0
    for t in tensors:
        fields.append(Field(offset, t.dtype, tuple(t.shape)))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    buf = torch.empty(offset, dtype=torch.uint8, pin_memory=pin)
    for t, f in zip(tensors, fields, strict=True):
        if t.numel():
            buf[f.offset : f.offset + t.numel() * t.element_size()] = t.contiguous().view(-1).view(torch.uint8)
    return buf, fields


def unpack(buf: torch.Tensor, fields: Sequence[Field]) -> list[torch.Tensor]:
    """The tensors :func:`pack` put in ``buf`` (or in its copy on another device), as views of it.

    >>> buf, fields = pack([torch.tensor([1, 2]), torch.zeros(0), torch.tensor([[0.5]])])
    >>> [t.tolist() for t in unpack(buf, fields)]
    [[1, 2], [], [[0.5]]]
    """
    out = []
    for f in fields:
        size = torch.empty((), dtype=f.dtype).element_size()
        n = 1
        for d in f.shape:
            n *= d
        out.append(buf[f.offset : f.offset + n * size].view(f.dtype).view(f.shape))
    return out


def upload(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device``: those on the host in one non-blocking copy of a pinned buffer (on
    CUDA), those already there as they are; on a CPU the tensors themselves."""
    if device.type != "cuda":
        return [t.contiguous() for t in tensors]
    host = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
    out = list(tensors)
    if host:
        buf, fields = pack([tensors[i] for i in host], pin=True)
        for i, t in zip(host, unpack(buf.to(device, non_blocking=True), fields), strict=True):
            out[i] = t
    return out
