"""Log-probabilities of emitted tokens, for requests that ask for them (OpenAI's ``logprobs``).

A token's log-probability is taken under the distribution it was drawn from: the softmax of the
request's processed logits (``logits_controls``: penalties, biases, min_tokens; the model's own
logits where it set none) for greedy requests (temperature 0 has no distribution of its own), and
for sampled requests the softmax after temperature, min-p, top-k and top-p too
(``sampling.filter_logits``) — what vLLM calls processed logprobs. Tokens that filtering removed
have probability 0 and are never listed. Prompt tokens' log-probabilities (``prompt_logprobs``)
are the model's raw softmax, as vLLM's.

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
    rank: int = 0  # 1 + the number of tokens more likely than it


def token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    n_top: list[int],
    min_p: torch.Tensor | None = None,
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
        row_min_p = min_p[rows] if min_p is not None else None
        x[rows] = filter_logits(logits[rows], temperature[rows], top_p[rows], top_k[rows], row_min_p)
    lp = torch.log_softmax(x, dim=-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)  # [R]
    rank = (lp > chosen[:, None]).sum(dim=-1) + 1  # [R]
    k = max(n_top, default=0)
    top = torch.topk(lp, k, dim=-1) if k else None  # [R, k]
    host_chosen, host_rank = chosen.tolist(), rank.tolist()
    host_vals = top.values.tolist() if top is not None else [[] for _ in n_top]
    host_ids = top.indices.tolist() if top is not None else [[] for _ in n_top]
    out = []
    for c, r, n, vals, ids in zip(host_chosen, host_rank, n_top, host_vals, host_ids, strict=True):
        keep = [j for j in range(n) if math.isfinite(vals[j])]
        out.append(TokenLogprob(c, tuple(ids[j] for j in keep), tuple(vals[j] for j in keep), r))
    return out


def prompt_logprobs(logits: torch.Tensor, next_tokens: torch.Tensor, n_top: list[int]) -> list[TokenLogprob]:
    """Each prompt token's log-probability under the model's raw softmax at the row before it, and the
    ``n_top[r]`` most likely tokens there: logits [n, V] (rows of positions q) and next_tokens int64 [n]
    (the prompt's tokens at q + 1) → n entries, one host copy.

    >>> lg = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    >>> [(round(math.exp(x.logprob), 2), x.rank, x.top_ids) for x in prompt_logprobs(lg, torch.tensor([2]), [1])]
    [(0.25, 2, (0,))]
    """
    zeros = torch.zeros(logits.shape[0], device=logits.device)  # temperature 0: no processing
    return token_logprobs(logits, next_tokens, zeros, zeros + 1, zeros.long(), n_top)


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
        repeat_rows([r.min_p for r in req], per_row, dev) if any(r.min_p for r in req) else None,
    )
    offset = 0
    for i, n in zip(want, per_row, strict=True):
        out[i], offset = flat[offset : offset + n], offset + n
    return out
