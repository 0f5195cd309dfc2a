"""Acceptance dispatch for one verification step: every request's (accepted path, bonus token).

Greedy rows take the host walk on one argmax copy; sampled rows are filtered (temperature,
top-p, top-k) and walked with their counter-based uniforms (``acceptance``). On CUDA the whole
batch is walked on the device instead (``specmesh_kernels.tree_accept``: the same uniforms and
rules, one device-to-host copy for the step).
"""

from __future__ import annotations

import torch

from specmesh.server.sampling import filter_logits
from specmesh.server.tree import TokenTree
from verifier_svc.acceptance import acceptance_uniforms, greedy_accept, sample_accept, walk_shape
from verifier_svc.requests import GenerationRequest

KERNEL_MAX_NODES = 63  # the device acceptance / tree-attention kernels' ancestor bitmask: 64 rows


def repeat_rows(values: list, repeats: list[int], device: torch.device) -> torch.Tensor:
    """``values[i]`` repeated ``repeats[i]`` times, as one tensor: a request's setting for each of
    its logits rows.

    >>> repeat_rows([0.5, 1.0], [2, 1], torch.device("cpu")).tolist()
    [0.5, 0.5, 1.0]
    """
    return torch.repeat_interleave(torch.tensor(values, device=device), torch.tensor(repeats, device=device))


def accept_batch(
    reqs: list[GenerationRequest],
    context_lengths: list[int],
    trees: list[TokenTree],
    logits: torch.Tensor,
    counts: list[int],
) -> list[tuple[list[int], int]]:
    """(accepted node path, bonus token) per request, losslessly (see ``acceptance``).

    logits: [sum(counts), vocab], request i's rows (its root, then its tree's nodes) contiguous;
    ``context_lengths``: each request's tokens so far (the uniforms' counters).
    """
    if logits.device.type == "cuda" and max(len(t) for t in trees) <= KERNEL_MAX_NODES:
        return _accept_on_device(reqs, context_lengths, trees, logits)
    argmax = logits.argmax(dim=-1).tolist()  # one host copy for every greedy decision
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    results: list[tuple[list[int], int] | None] = [None] * len(reqs)
    sampled = [i for i, r in enumerate(reqs) if r.temperature > 0]
    for i, tree in enumerate(trees):
        if reqs[i].temperature == 0:
            results[i] = greedy_accept(tree, argmax[starts[i] : starts[i + 1]])
    if sampled:
        dev = logits.device
        idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in sampled]).to(dev)
        per_row = [counts[i] for i in sampled]
        req = [reqs[i] for i in sampled]
        filtered = filter_logits(
            logits[idx],
            repeat_rows([r.temperature for r in req], per_row, dev),
            repeat_rows([r.top_p for r in req], per_row, dev),
            repeat_rows([r.top_k for r in req], per_row, dev),
        )
        probs = torch.softmax(filtered, dim=-1)  # [sum over sampled rows, vocab]
        shapes = [walk_shape(trees[i]) for i in sampled]
        u = acceptance_uniforms(
            torch.tensor([r.seed for r in req]),
            torch.tensor([context_lengths[i] for i in sampled]),
            max(d for d, _ in shapes),
            max(k for _, k in shapes),
        )
        offset = 0
        for j, i in enumerate(sampled):
            results[i] = sample_accept(trees[i], probs[offset : offset + counts[i]], u[j])
            offset += counts[i]
    return results  # type: ignore[return-value]


def _accept_on_device(
    reqs: list[GenerationRequest], context_lengths: list[int], trees: list[TokenTree], logits: torch.Tensor
) -> list[tuple[list[int], int]]:
    from specmesh_kernels.tree_accept import PackedTrees, tree_accept, unpack_result

    dev = logits.device
    packed = PackedTrees.from_lists(
        [t.tokens for t in trees], [t.parents for t in trees], [t.dists for t in trees], device=dev
    )
    out = tree_accept(
        logits,
        packed,
        torch.tensor([r.temperature for r in reqs], device=dev),
        torch.tensor([r.top_p for r in reqs], device=dev),
        torch.tensor([r.top_k for r in reqs], device=dev),
        torch.tensor([r.seed for r in reqs], device=dev),
        torch.tensor(context_lengths, device=dev),  # the host walk's uniform counters
        max_nodes=max(len(t) for t in trees),
    )
    return unpack_result(out.cpu())  # the step's one device-to-host copy
