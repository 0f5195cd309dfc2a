"""A request's logits controls (vLLM's sampling parameters) applied to a step's logits rows, losslessly
under speculation.

Row r of a step predicts one token of one request. Its controls act as plain decoding would have
applied them at that position had the row's path been generated: the request's *output* there is
its output so far followed by the row's path in its tree (the node's ancestors and the node; the
root row adds nothing), and ``min_tokens`` compares with that output's length. In vLLM's order
(``vllm/v1/sample/sampler.py``), on the model's logits:

1. ``allowed_token_ids``: every other token → -inf;
2. ``min_tokens``: while the output is shorter, EOS (unless ``ignore_eos``) and ``stop_token_ids`` → -inf;
3. ``logit_bias``: logit += bias;
4. ``repetition_penalty`` p, on tokens in the prompt or the output: logit / p where logit > 0, else
   logit × p (transformers' ``RepetitionPenaltyLogitsProcessor``);
5. ``frequency_penalty`` f: logit -= f × the token's count in the output;
6. ``presence_penalty`` r: logit -= r × [count > 0].

Temperature, ``min_p``, top-k and top-p follow in ``sampling.filter_logits``; greedy takes the argmax
of these logits. Everything downstream (the greedy and sampled acceptance walks, the device kernel,
logprobs) reads the processed rows, so acceptance stays exact for the processed distribution.
One pass over the batch: no Python loop per row or per node; requests without controls are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh_server.tree import TokenTree
from verifier_svc.requests import GenerationRequest


def apply_controls(
    logits: torch.Tensor,
    counts: torch.Tensor,
    in_prompt: torch.Tensor,
    banned: torch.Tensor,
    bias: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """The controls' arithmetic on rows already gathered (steps 1-6 of the module docstring).

    logits, counts (each token's count in the row's output), bias: float [R, V]; in_prompt, banned
    (disallowed, or a stop token before ``min_tokens``): bool [R, V]; repetition, frequency,
    presence: float [R] → float [R, V].

    >>> lg = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    >>> out = apply_controls(lg, torch.tensor([[2.0, 1.0, 0.0, 0.0]]), torch.tensor([[False, False, True, False]]),
    ...     torch.tensor([[False, False, False, True]]), torch.tensor([[0.0, 0.0, 1.0, 0.0]]),
    ...     torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    >>> out.tolist()   # 2/2 - 0.5·2 - 0.25;  -1·2 - 0.5 - 0.25;  (0.5 + 1)/2;  banned
    [[-0.25, -2.75, 0.75, -inf]]
    """
    x = logits.float().masked_fill(banned, float("-inf")) + bias  # [R, V]
    seen = in_prompt | (counts > 0)
    penalised = torch.where(x > 0, x / repetition[:, None], x * repetition[:, None])
    x = torch.where(seen, penalised, x)
    return x - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def path_counts(
    tokens: torch.Tensor, parents: torch.Tensor, vocab: int, max_depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's path in its tree as token counts, and its depth, by following parent pointers
    ``max_depth`` times (vectorised over every row of every tree).

    tokens int64 [R]: each row's node token (-1 for a root row: its pending token is already output);
    parents int64 [R]: the row of each row's parent (-1 for a root) → (counts float [R, V], depth int64 [R]).

    >>> tok = torch.tensor([-1, 5, 6, 7]); par = torch.tensor([-1, 0, 1, 0])   # root → 5 → 6; root → 7
    >>> c, d = path_counts(tok, par, vocab=8, max_depth=2)
    >>> c[:, 5:].tolist(), d.tolist()
    ([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]], [0, 1, 2, 1])
    """
    r = tokens.shape[0]
    counts = torch.zeros(r, vocab, device=tokens.device)
    depth = torch.zeros(r, dtype=torch.long, device=tokens.device)
    rows = torch.arange(r, device=tokens.device)
    cur = rows
    for _ in range(max_depth):
        tok = tokens[cur.clamp(min=0)]
        live = (cur >= 0) & (tok >= 0)  # the pointer is on a node (not a root, not past one)
        counts.index_put_((rows, tok.clamp(min=0)), live.float(), accumulate=True)
        depth += live
        cur = torch.where(live, parents[cur.clamp(min=0)], -1)
    return counts, depth


def process_logits(
    logits: torch.Tensor,
    reqs: Sequence[GenerationRequest],
    outputs: Sequence[list[int]],
    trees: Sequence[TokenTree],
    eos_ids: set[int],
) -> torch.Tensor:
    """A step's logits with each controlled request's rows processed, in place (others unchanged; no
    work at all when no request has controls).

    logits [sum(len(trees[i]) + 1), V]: request i's rows contiguous (its root, then its tree's nodes);
    ``outputs[i]``: request i's output so far (its pending token included).
    """
    which = [i for i, r in enumerate(reqs) if r.has_controls]
    if not which:
        return logits
    dev, vocab = logits.device, logits.shape[-1]
    n = [len(t) + 1 for t in trees]
    starts = torch.tensor([0, *n], device=dev).cumsum(0)[:-1]
    sel = [trees[i] for i in which]
    sizes = torch.tensor([len(t) + 1 for t in sel], device=dev)
    row_req = torch.repeat_interleave(torch.arange(len(which), device=dev), sizes)  # [R]
    first = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), sizes.cumsum(0)[:-1]])  # each root's row in R
    rows = starts[torch.tensor(which, device=dev)][row_req] + (torch.arange(len(row_req), device=dev) - first[row_req])
    # Each row's node token and parent row (within R): roots have neither.
    node_tok = torch.tensor([t for tree in sel for t in [-1, *tree.tokens]], device=dev)
    parent = torch.tensor([p for tree in sel for p in [-2, *tree.parents]], device=dev) + 1  # node index, root = 0
    parent = torch.where(parent >= 0, first[row_req] + parent, -1)
    counts, depth = path_counts(node_tok, parent, vocab, max((len(t) for t in sel), default=0))
    # The output so far, counted once per request and read by each of its rows.
    out_req = torch.repeat_interleave(torch.arange(len(which)), torch.tensor([len(outputs[i]) for i in which]))
    out_counts = torch.zeros(len(which), vocab, device=dev)
    out_tok = torch.tensor([t for i in which for t in outputs[i]], dtype=torch.long)
    out_counts.index_put_((out_req.to(dev), out_tok.to(dev)), torch.ones(len(out_tok), device=dev), accumulate=True)
    counts += out_counts[row_req]
    req = [reqs[i] for i in which]
    in_prompt = torch.zeros(len(which), vocab, dtype=torch.bool, device=dev)
    banned = torch.zeros(len(which), vocab, dtype=torch.bool, device=dev)
    bias = torch.zeros(len(which), vocab, device=dev)
    for j, r in enumerate(req):  # per request (not per row): its own sets
        if r.repetition_penalty != 1.0:
            in_prompt[j, r.prompt_token_set.to(dev)] = True
        if r.allowed_token_ids:
            banned[j] = True
            banned[j, r.allowed_tensor.to(dev)] = False
        if r.logit_bias:
            ids, values = zip(*r.logit_bias, strict=True)
            bias[j, list(ids)] = torch.tensor(values, device=dev)
    # min_tokens: the row's draw follows len(output) + depth tokens of output.
    min_tokens = torch.tensor([r.min_tokens for r in req], device=dev)
    n_out = torch.tensor([len(outputs[i]) for i in which], device=dev)
    early = (n_out[row_req] + depth) < min_tokens[row_req]  # [R]
    stops = torch.zeros(len(which), vocab, dtype=torch.bool, device=dev)
    for j, r in enumerate(req):
        ids = set(r.stop_token_ids) | (set() if r.ignore_eos else eos_ids)
        if r.min_tokens and ids:
            stops[j, list(ids)] = True
    row_banned = banned[row_req] | (stops[row_req] & early[:, None])
    param = lambda name: torch.tensor([getattr(r, name) for r in req], device=dev)[row_req]  # noqa: E731
    logits[rows] = apply_controls(
        logits[rows],
        counts,
        in_prompt[row_req],
        row_banned,
        bias[row_req],
        param("repetition_penalty"),
        param("frequency_penalty"),
        param("presence_penalty"),
    ).to(logits.dtype)
    return logits
