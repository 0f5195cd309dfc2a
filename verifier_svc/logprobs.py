"""Log-probabilities of emitted tokens, for requests that ask for them (OpenAI's ``logprobs``).

A token's log-probability is taken under the distribution it was drawn from: the model's softmax
for greedy requests (temperature 0 has no distribution of its own), and for sampled requests the
softmax after temperature, top-k and top-p (``sampling.filter_logits``) — what vLLM calls
processed logprobs. Tokens that top-k/top-p removed have probability 0 and are never listed.

Under speculation a token's row comes from the verification forward over the tree (the row of
its parent node), which is the same distribution plain decoding computes for that position up
to fp32 reduction order: the logprobs a request sees do not depend on whether it speculated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specmesh_server.sampling import filter_logits, repeat_rows

if TYPE_CHECKING:
    from verifier_svc.requests import GenerationRequest


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the most likely tokens at its position."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()  # descending, as many as asked (fewer where filtering left fewer)


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    n_top: list[int],
) -> list[TokenLogprob]:
    """Log-probability of ``tokens[r]`` under row r's distribution, and its ``n_top[r]`` best tokens.

    logits [R, V]; tokens int64 [R]; temperature/top_p float [R]; top_k int64 [R]; n_top: R ints.
    One host copy for every row.

    >>> lg = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]))
    >>> out = token_logprobs(lg, torch.tensor([1, 0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]),
    ...                      torch.tensor([0, 1]), [2, 1])
    >>> round(math.exp(out[0].logprob), 3), out[0].top_ids, [round(math.exp(x), 3) for x in out[0].top_logprobs]
    (0.25, (0, 1), [0.5, 0.25])
    >>> out[1].logprob, out[1].top_ids   # top_k = 1 leaves token 0 alone: probability 1
    (0.0, (0,))
    """
    x = logits.float()  # [R, V]; greedy rows: the model's own distribution
    sampled = temperature > 0
    if bool(sampled.any()):
        rows = sampled.nonzero().squeeze(1)
        x = x.clone()  # .float() of fp32 logits is the caller's tensor
        x[rows] = filter_logits(logits[rows], temperature[rows], top_p[rows], top_k[rows])
    lp = torch.log_softmax(x, dim=-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)  # [R]
    k = max(n_top, default=0)
    top = torch.topk(lp, k, dim=-1) if k else None  # [R, k]
    host_chosen = chosen.tolist()
    host_vals = top.values.tolist() if top is not None else [[] for _ in n_top]
    host_ids = top.indices.tolist() if top is not None else [[] for _ in n_top]
    out = []
    for c, n, vals, ids in zip(host_chosen, n_top, host_vals, host_ids, strict=True):
        keep = [j for j in range(n) if math.isfinite(vals[j])]
        out.append(TokenLogprob(c, tuple(ids[j] for j in keep), tuple(vals[j] for j in keep)))
    return out


def step_logprobs(
    reqs: list[GenerationRequest], logits: torch.Tensor, drawn: Callable[[int], tuple[list[int], list[int]]]
) -> list[list[TokenLogprob] | None]:
    """Per request of a step, its emitted tokens' logprobs (None where it did not ask). ``drawn(i)``:
    the logits rows and the tokens request i emitted from them, asked only of requests that want
    logprobs. One computation and one host copy for the whole step."""
    want = [i for i, r in enumerate(reqs) if r.logprobs is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(reqs)
    if not want:
        return out
    dev = logits.device
    draws = [drawn(i) for i in want]
    req = [reqs[i] for i in want]
    per_row = [len(rows) for rows, _ in draws]
    flat = token_logprobs(
        logits[torch.tensor([r for rows, _ in draws for r in rows], device=dev)],
        torch.tensor([t for _, tokens in draws for t in tokens], device=dev),
        repeat_rows([r.temperature for r in req], per_row, dev),
        repeat_rows([r.top_p for r in req], per_row, dev),
        repeat_rows([r.top_k for r in req], per_row, dev),
        [r.logprobs or 0 for r, n in zip(req, per_row, strict=True) for _ in range(n)],
    )
    offset = 0
    for i, n in zip(want, per_row, strict=True):
        out[i], offset = flat[offset : offset + n], offset + n
    return out
