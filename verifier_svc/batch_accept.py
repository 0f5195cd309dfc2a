"""Acceptance dispatch for one verification step: every request's (accepted path, bonus token);
and the plain draw of a prefill's first token.

Greedy rows take the host walk on one argmax copy; sampled rows are filtered (temperature,
top-p, top-k) and walked with their counter-based uniforms (``acceptance``). On CUDA (or wherever
``--device-accept on`` asks) the whole batch is walked on the device instead
(:func:`accept_on_device`: the same probabilities and uniforms handed to
``specmesh_kernels.tree_accept``, one device-to-host copy for the step).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from specmesh_server.sampling import filter_logits, repeat_rows, sample_next
from specmesh_server.staging import upload
from specmesh_server.tree import TokenTree
from verifier_svc.acceptance import acceptance_uniforms, greedy_accept, sample_accept, walk_shape
from verifier_svc.requests import GenerationRequest

KERNEL_MAX_NODES = 63  # the device acceptance / tree-attention kernels' ancestor bitmask: 64 rows


def accept_batch(
    reqs: list[GenerationRequest],
    context_lengths: list[int],
    trees: list[TokenTree],
    logits: torch.Tensor,
    counts: list[int],
    *,
    device_accept: bool | None = None,
) -> list[tuple[list[int], int]]:
    """(accepted node path, bonus token) per request, losslessly (see ``acceptance``).

    logits: [sum(counts), vocab], request i's rows (its root, then its tree's nodes) contiguous;
    ``context_lengths``: each request's tokens so far (the uniforms' counters).
    ``device_accept``: walk the batch in the Triton kernel (:func:`accept_on_device`): None where the
    logits are on CUDA, True wherever the trees fit it (CPU tensors: Triton's interpreter), False never
    (the host walk). Trees over ``KERNEL_MAX_NODES`` nodes take the host walk either way.
    """
    on_device = logits.device.type == "cuda" if device_accept is None else device_accept
    if on_device and max(len(t) for t in trees) <= KERNEL_MAX_NODES:
        return accept_on_device(reqs, context_lengths, trees, logits)
    argmax = logits.argmax(dim=-1).tolist()  # one host copy for every greedy decision
    starts = [0, *itertools.accumulate(counts)]
    results: list[tuple[list[int], int] | None] = [None] * len(reqs)
    sampled = [i for i, r in enumerate(reqs) if r.temperature > 0]
    for i, tree in enumerate(trees):
        if reqs[i].temperature == 0:
            results[i] = greedy_accept(tree, argmax[starts[i] : starts[i + 1]])
    if sampled:
        idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in sampled]).to(logits.device)
        req = [reqs[i] for i in sampled]
        probs = target_probs(logits[idx], req, [counts[i] for i in sampled])  # [sum over sampled rows, vocab]
        shapes = [walk_shape(trees[i]) for i in sampled]
        u = acceptance_uniforms(
            torch.tensor([r.seed for r in req]),
            torch.tensor([context_lengths[i] for i in sampled]),
            max(d for d, _ in shapes),
            max(k for _, k in shapes),
        ).numpy()
        offset = 0
        for j, i in enumerate(sampled):
            results[i] = sample_accept(trees[i], probs[offset : offset + counts[i]], u[j])
            offset += counts[i]
    return results  # type: ignore[return-value]


def target_probs(logits: torch.Tensor, reqs: list[GenerationRequest], rows_per_req: list[int]) -> torch.Tensor:
    """Each request's sampling distribution (temperature, min-p, top-p, top-k; temperature 0 as 1, with
    min-p off: greedy requests' rows are read only by ``sample_accept`` callers that sample) over its
    logits rows: [rows, vocab] → [rows, vocab] probabilities."""
    return filtered_probs(logits, upload(row_settings(reqs, rows_per_req), logits.device))


def row_settings(reqs: list[GenerationRequest], rows_per_req: list[int]) -> list[torch.Tensor]:
    """The settings ``filtered_probs`` reads, one value per logits row, as host tensors: temperature,
    top-p, top-k, and min-p where a sampled request sets it.

    >>> from types import SimpleNamespace as R
    >>> [t.tolist() for t in row_settings([R(temperature=0.0, min_p=0.5, top_p=1.0, top_k=0),
    ...                                    R(temperature=0.5, min_p=0.0, top_p=0.5, top_k=3)], [1, 2])]
    [[1.0, 0.5, 0.5], [1.0, 0.5, 0.5], [0, 3, 3]]
    """
    temperature = [r.temperature if r.temperature > 0 else 1.0 for r in reqs]
    min_p = [r.min_p if r.temperature > 0 else 0.0 for r in reqs]
    cpu = torch.device("cpu")
    out = [
        repeat_rows(temperature, rows_per_req, cpu),
        repeat_rows([r.top_p for r in reqs], rows_per_req, cpu),
        repeat_rows([r.top_k for r in reqs], rows_per_req, cpu),
    ]
    return [*out, repeat_rows(min_p, rows_per_req, cpu)] if any(min_p) else out


def filtered_probs(logits: torch.Tensor, settings: list[torch.Tensor]) -> torch.Tensor:
    """softmax of ``logits`` filtered by ``settings`` (:func:`row_settings`, on the logits' device)."""
    filtered = filter_logits(logits, *settings[:3], settings[3] if len(settings) > 3 else None)
    return torch.softmax(filtered, dim=-1).nan_to_num(0.0)  # a row of NaN logits: no mass, not NaN


def accept_on_device(
    reqs: list[GenerationRequest], context_lengths: list[int], trees: list[TokenTree], logits: torch.Tensor
) -> list[tuple[list[int], int]]:
    """The whole step's acceptance in one kernel launch: the policy (filtered probabilities, the
    seeded uniforms) computed here, the walk in ``specmesh_kernels.tree_accept``. Everything that does
    not depend on the logits (the trees' links, the uniforms, the rows' settings) is computed on the
    host and reaches the device in one non-blocking copy (``staging``): the host waits for the device
    once, at the result's copy."""
    from specmesh_kernels.tree_accept import PackedTrees, WalkInputs, unpack_result, walk_inputs, walk_launch

    dev = logits.device
    packed = PackedTrees.from_lists([t.tokens for t in trees], [t.parents for t in trees], [t.dists for t in trees])
    max_nodes = max(len(t) for t in trees)
    u = acceptance_uniforms(  # the host walk's counters (and its very uniforms): each request's tokens so far
        torch.tensor([r.seed for r in reqs]), torch.tensor(context_lengths), max_nodes + 1, max_nodes + 1
    )
    walk = walk_inputs(packed, torch.tensor([r.temperature <= 0 for r in reqs]), u, max_nodes)
    sampled = any(r.temperature > 0 for r in reqs)
    # Greedy requests' rows of probs are never read: an all-greedy step skips the softmax.
    settings = row_settings(reqs, [len(t) + 1 for t in trees]) if sampled else []
    fields = [getattr(walk, f.name) for f in dataclasses.fields(walk)]
    staged = upload([*fields, *settings], dev)
    walk = WalkInputs(*staged[: len(fields)])
    probs = filtered_probs(logits, staged[len(fields) :]) if sampled else logits
    # any_sampled known here: no device read for the scratch's size
    out = walk_launch(probs, logits.argmax(dim=-1), walk, max_nodes, any_sampled=sampled)
    return unpack_result(out.cpu())  # the step's one device-to-host copy


def sample_tokens(reqs: list[GenerationRequest], context_lengths: list[int], logits: torch.Tensor) -> list[int]:
    """One token per request from its logits row (greedy or seeded sampling; the uniform counter is
    the request's tokens so far, as the acceptance walk uses it)."""
    dev = logits.device
    tensor = lambda xs: torch.tensor(xs, device=dev)  # noqa: E731
    return sample_next(
        logits,
        tensor([r.temperature for r in reqs]),
        tensor([r.top_p for r in reqs]),
        tensor([r.top_k for r in reqs]),
        tensor([r.seed for r in reqs]),
        tensor(context_lengths),
        tensor([r.min_p for r in reqs]) if any(r.min_p for r in reqs) else None,
    ).tolist()  # one host copy
