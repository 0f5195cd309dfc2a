"""Batched, per-request-seeded sampling of the next token.

Randomness is counter-based: the uniform draw for a request is a hash of
(seed, position, salt), so a seeded request samples the same tokens whatever else shares
its batch, and no torch.Generator per request is needed (one vectorised op for the batch).
Sampling uses the inverse CDF of the filtered distribution, one uniform per row.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# Temperatures below this are greedy: logits / 1e-45 overflow to inf and softmax to NaN (vLLM's
# _SAMPLING_EPS). Requests are normalised to 0 on arrival; filter_logits clamps as a last guard.
GREEDY_BELOW = 1e-5


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 ``x`` in [0, 2**32) without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash (Wellons) on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, counters: torch.Tensor, salt: int | torch.Tensor = 0) -> torch.Tensor:
    """Deterministic uniforms in (0, 1), one per row, from 64-bit seeds and counters.

    seeds, counters (and salt, if a tensor): int64 [b] → float64 [b]. Same inputs, same outputs,
    on any batch.

    >>> s = torch.tensor([7, 7, 8]); c = torch.tensor([0, 1, 0])
    >>> u = uniform(s, c); bool(((u > 0) & (u < 1)).all()), bool(u[0] != u[1])
    (True, True)
    """
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    salt_t = salt & _M32 if isinstance(salt, torch.Tensor) else torch.full_like(seeds, salt & _M32)
    h = _mix32((counters & _M32) ^ _mix32(salt_t))
    h = _mix32(h ^ lo)
    h = _mix32((h + 0x9E3779B9) & _M32 ^ hi)
    h = _mix32(h ^ _mix32(counters >> 32 & _M32))
    return (h.to(torch.float64) + 0.5) / 2.0**32


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply temperature, min-p, top-k and top-p (vLLM's order); masked entries become -inf.

    logits [b, V]; temperature [b] (> 0); top_p [b] in (0, 1]; top_k [b] (0 = off); min_p [b] in
    [0, 1] (None or 0 = off) → [b, V]. min-p drops tokens less likely than min_p × the most likely
    one's probability (transformers' ``MinPLogitsWarper``); top-k keeps ties at the k-th value;
    top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p (always at
    least the most likely token).

    >>> out = filter_logits(torch.tensor([[1.0, 3.0, 2.0]]), torch.tensor([1.0]),
    ...                     torch.tensor([1.0]), torch.tensor([2]))
    >>> out.tolist()
    [[-inf, 3.0, 2.0]]
    """
    logits = logits.float() / temperature.clamp(min=GREEDY_BELOW)[:, None]
    # NaN logits never win; +inf (an overflowing model) is the largest finite, so softmax stays defined.
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    vocab = logits.shape[-1]
    if min_p is not None and bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)  # [b, V]
        logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [b]
        kth = torch.topk(logits, int(k.max()), dim=-1).values  # [b, kmax], descending
        threshold = kth.gather(1, (k - 1)[:, None])  # [b, 1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if bool((top_p < 1).any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [b, V]
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample: the first index whose cumulative mass exceeds u * total.

    probs [b, V] (unnormalised, non-negative; NaN and inf count as 0); u float64 [b] in (0, 1) → int64 [b].

    >>> sample_from_probs(torch.tensor([[0.2, 0.0, 0.8]]), torch.tensor([0.25])).tolist()
    [2]
    """
    probs = torch.nan_to_num(probs.double(), nan=0.0, posinf=0.0, neginf=0.0)
    cdf = torch.cumsum(probs, dim=-1)  # [b, V]
    total = cdf[:, -1]
    target = (u * total)[:, None]  # [b, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)
    # No mass left (e.g. every logit NaN): the most likely token, never an arbitrary last id.
    return torch.where(torch.isfinite(total) & (total > 0), idx, probs.argmax(dim=-1))


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token per row: argmax where temperature < GREEDY_BELOW (0 = greedy), else a seeded sample.

    logits [b, V]; temperature/top_p (/min_p) float [b]; top_k, seeds, positions int64 [b] → int64 [b].
    ``positions`` (the index of the token being sampled) is the RNG counter.
    """
    tokens = torch.argmax(logits, dim=-1)  # [b]
    sampled = temperature >= GREEDY_BELOW  # below: greedy, as the request normalisation says
    if bool(sampled.any()):
        rows = sampled.nonzero().squeeze(1)
        row_min_p = min_p[rows] if min_p is not None else None
        filtered = filter_logits(logits[rows], temperature[rows], top_p[rows], top_k[rows], row_min_p)
        probs = torch.softmax(filtered, dim=-1)
        u = uniform(seeds[rows], positions[rows])
        tokens[rows] = sample_from_probs(probs, u)
    return tokens


def repeat_rows(values: list, repeats: list[int], device: torch.device) -> torch.Tensor:
    """``values[i]`` repeated ``repeats[i]`` times, as one tensor: a request's setting for each of
    its logits rows.

    >>> repeat_rows([0.5, 1.0], [2, 1], torch.device("cpu")).tolist()
    [0.5, 0.5, 1.0]
    """
    return torch.repeat_interleave(torch.tensor(values, device=device), torch.tensor(repeats, device=device))
