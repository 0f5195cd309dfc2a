"""The target's hidden states on the wire (``HiddenStates`` in ``protos/``): the verifier gathers and
encodes them, a head proposer decodes them. Rows travel row-major, little-endian, in the dtype the
proposer asked for (fp16 by default: hidden_size × 2 bytes per token).
"""

from __future__ import annotations

import torch

from specmesh.v1 import proposer_pb2

TORCH_DTYPES = {
    proposer_pb2.HIDDEN_DTYPE_UNSPECIFIED: torch.float16,
    proposer_pb2.HIDDEN_DTYPE_FLOAT16: torch.float16,
    proposer_pb2.HIDDEN_DTYPE_BFLOAT16: torch.bfloat16,
    proposer_pb2.HIDDEN_DTYPE_FLOAT32: torch.float32,
}


def gather_rows(hidden: torch.Tensor, rows: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each taker's rows of a forward's flattened hidden states, copied to the host once for all.

    hidden [..., H] (any device); rows[i]: flat row indices of taker i → host tensors [len(rows[i]), H].

    >>> h = torch.arange(12.0).view(2, 3, 2)               # [b=2, n=3, H=2]
    >>> [t.tolist() for t in gather_rows(h, [[0, 1], [5]], torch.float32)]
    [[[0.0, 1.0], [2.0, 3.0]], [[10.0, 11.0]]]
    """
    flat = hidden.reshape(-1, hidden.shape[-1])  # [b·n, H]
    index = torch.tensor([r for rs in rows for r in rs], dtype=torch.long, device=hidden.device)
    host = flat.index_select(0, index).to(dtype).cpu()  # the step's one gather and one host copy
    return list(host.split([len(rs) for rs in rows]))


def encode(states: torch.Tensor, dtype: int) -> proposer_pb2.HiddenStates:
    """[n, H] host tensor → the message (``dtype``: a ``HiddenDtype``).

    >>> msg = encode(torch.ones(2, 3), proposer_pb2.HIDDEN_DTYPE_FLOAT16)
    >>> msg.hidden_size, len(msg.data)                    # 2 rows × 3 × 2 bytes
    (3, 12)
    """
    t = states.to(TORCH_DTYPES[dtype]).contiguous()
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
    return proposer_pb2.HiddenStates(dtype=dtype, hidden_size=t.shape[-1], data=raw.numpy().tobytes())


def decode(msg: proposer_pb2.HiddenStates, rows: int, hidden_size: int) -> torch.Tensor:
    """The message's rows as fp32 [rows, hidden_size]; ValueError saying what does not fit.

    >>> decode(encode(torch.tensor([[0.5, -2.0]]), proposer_pb2.HIDDEN_DTYPE_BFLOAT16), 1, 2).tolist()
    [[0.5, -2.0]]
    """
    dtype = TORCH_DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"hidden_states.dtype: unknown value {msg.dtype}")
    if msg.hidden_size != hidden_size:
        raise ValueError(f"hidden_states.hidden_size: {msg.hidden_size}, this head's is {hidden_size}")
    if rows == 0:
        return torch.empty(0, hidden_size)
    size = torch.empty((), dtype=dtype).element_size()
    if len(msg.data) != rows * hidden_size * size:
        raise ValueError(f"hidden_states.data: {len(msg.data)} bytes, expected {rows} rows × {hidden_size} × {size}")
    raw = torch.frombuffer(bytearray(msg.data), dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
    return raw.view(dtype).view(rows, hidden_size).float()
