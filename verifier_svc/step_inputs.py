"""The forward inputs of one engine step, as padded [batch, width] tensors on the model's device.

Prefill: each row feeds the next chunk of its prompt, tokens [start, start + n), causally.
Decode: each row feeds its pending token, then its tree's nodes; a node sees the cached prefix,
the pending token and its own ancestors (``verification_layout``). Rows without a tree are
padded; a padding query sees one key so no softmax row is empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh_server.model_runner import causal_mask
from specmesh_server.tree import TokenTree, verification_layout


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [b, width] int64
    positions: torch.Tensor  # [b, width] rotary positions
    mask: torch.Tensor  # [b, width, kv_len] bool: query → visible cache slot
    write_pos: torch.Tensor | None = None  # [b, width] cache slots written; None: ``positions``


def prefill_inputs(chunks: list[list[int]], starts: list[int], device: torch.device) -> StepInputs:
    """Rows of prompt chunks, each from its own start position.

    >>> s = prefill_inputs([[5, 6, 7], [8]], [0, 4], torch.device("cpu"))
    >>> s.input_ids.tolist(), s.positions.tolist(), tuple(s.mask.shape)
    ([[5, 6, 7], [8, 0, 0]], [[0, 1, 2], [4, 5, 6]], (2, 3, 7))
    """
    n = max(len(c) for c in chunks)
    input_ids = torch.zeros(len(chunks), n, dtype=torch.long)
    for i, chunk in enumerate(chunks):
        input_ids[i, : len(chunk)] = torch.tensor(chunk)
    positions = (torch.tensor(starts)[:, None] + torch.arange(n)[None, :]).to(device)  # [b, n]
    return StepInputs(input_ids.to(device), positions, causal_mask(positions, int(positions.max()) + 1))


def decode_inputs(pending: list[int], lengths: list[int], trees: list[TokenTree], device: torch.device) -> StepInputs:
    """Each row's pending token at its cached length, then its tree; nodes are written contiguously
    after the prefix (``write_pos``) but take their depth's rotary position.

    >>> s = decode_inputs([9, 4], [3, 2], [TokenTree([1, 2], [-1, -1]), TokenTree([], [])], torch.device("cpu"))
    >>> s.input_ids.tolist(), s.positions.tolist(), s.write_pos.tolist()
    ([[9, 1, 2], [4, 0, 0]], [[3, 4, 4], [2, 3, 4]], [[3, 4, 5], [2, 3, 4]])
    >>> s.mask[0, 2].tolist()    # node 2 sees the prefix, the pending token and itself, not node 1
    [True, True, True, True, False, True]
    """
    width = 1 + max(len(t) for t in trees)
    kv_len = max(lengths) + width
    if width == 1:  # nobody speculates: the plain decode layout
        input_ids = torch.tensor([[p] for p in pending], device=device)  # [b, 1]
        positions = torch.tensor([[n] for n in lengths], device=device)  # [b, 1]
        return StepInputs(input_ids, positions, causal_mask(positions, kv_len), positions)
    input_ids = torch.zeros(len(trees), width, dtype=torch.long)
    write_pos = torch.tensor(lengths)[:, None] + torch.arange(width)[None, :]  # [b, width]
    positions = write_pos.clone()
    mask = torch.zeros(len(trees), width, kv_len, dtype=torch.bool)
    mask[:, :, 0] = True  # padding queries see one key (no all-masked rows)
    for i, (tok, length, tree) in enumerate(zip(pending, lengths, trees, strict=True)):
        n = len(tree) + 1
        pos, m = verification_layout(tree.parents, length)
        input_ids[i, :n] = torch.tensor([tok, *tree.tokens])
        positions[i, :n] = pos
        mask[i, :n, : m.shape[1]] = m
    return StepInputs(*(x.to(device) for x in (input_ids, positions, mask, write_pos)))


def unpadded(counts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every real query of a decode step (``counts[i]`` = 1 + request i's nodes),
    to gather [sum(counts), ...] from a padded [b, width, ...] output.

    >>> [t.tolist() for t in unpadded([2, 1], torch.device("cpu"))]
    [[0, 0, 1], [0, 1, 0]]
    """
    rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    cols = torch.cat([torch.arange(c) for c in counts])
    return rows.to(device), cols.to(device)
