"""The engine's two forwards over the target model, as functions of the batch: a prefill chunk, and
a decode step with its lossless acceptance. What the engine does with the results (cache lengths,
streaming, speculation bookkeeping) stays in ``engine``.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from specmesh_server.attention import Packing
from specmesh_server.model_runner import ModelRunner
from specmesh_server.paged_kv import PagedRows
from specmesh_server.tree import TokenTree
from verifier_svc.batch_accept import accept_batch, sample_tokens
from verifier_svc.grammar import StepMasks, constrain_trees, step_masks
from verifier_svc.logits_controls import process_logits
from verifier_svc.logprobs import TokenLogprob, prompt_logprobs, step_logprobs
from verifier_svc.sequence import Sequence
from verifier_svc.step_inputs import decode_inputs, prefill_inputs, unpadded

NO_TREE = TokenTree([], [])


@dataclass(frozen=True)
class PrefillStep:
    hidden: torch.Tensor  # [b, n, h]
    seconds: float  # the forward (and the first tokens' sampling)
    tokens_in: int  # tokens the forward computed, padding included
    finished: list[int]  # indices of the requests whose prompt is now cached whole (they got a first token)
    first_tokens: list[int]  # one per finished request
    logprobs: list[list[TokenLogprob] | None]  # one per finished request
    state_rows: list[int]  # per finished request, its prompt's last row in hidden.view(b * n, h)
    # Per request asking for prompt logprobs: those of the prompt tokens this chunk predicted, in order
    # (continuing the request's ``prompt_logprobs``).
    prompt_logprobs: dict[int, list[TokenLogprob]]


def prefill_step(
    runner: ModelRunner,
    joining: list[Sequence],
    chunks: list[list[int]],
    rows: PagedRows,
    packed: bool = True,
    eos_ids: set[int] | frozenset[int] = frozenset(),
) -> PrefillStep:
    """One forward over the next prompt chunk of each joining request (``rows``: their blocks); advances
    each one's cached length. Prompts now cached in full get their first token (a preempted
    request's is its pending one, so it gets none), drawn from their processed logits
    (``logits_controls``; ``eos_ids`` for min_tokens). Requests that ask for prompt logprobs get
    those of the prompt tokens this chunk predicts (one lm-head pass and one host copy for the
    chunk). ``packed`` (where the runner can): chunks of unequal lengths (a long prompt's beside
    short prompts) run packed, so the linear layers compute no padding, as a packed decode step does."""
    dev = runner.device
    step = prefill_inputs(chunks, [s.length for s in joining], dev)
    b, n = step.input_ids.shape
    lengths = [len(c) for c in chunks]
    t0 = time.perf_counter()
    computed = b * n
    if packed and runner.packs and sum(lengths) < 0.9 * b * n:
        computed = sum(lengths)
        packing = Packing(*unpadded(lengths, dev), b, n)
        real = runner.forward(rows, step.input_ids, step.positions, step.mask, packing=packing)[0]  # [N, h]
        hidden = real.new_zeros(b, n, real.shape[-1])
        hidden[packing.rows, packing.cols] = real  # [b, n, h], padding zeros
    else:
        hidden = runner.forward(rows, step.input_ids, step.positions, step.mask)  # [b, n, h]
    prompt_lps = chunk_prompt_logprobs(runner, joining, chunks, hidden)
    for seq, chunk in zip(joining, chunks, strict=True):
        seq.length += len(chunk)
    finished = [i for i, s in enumerate(joining) if s.length == s.cache_target and not s.output]
    tokens: list[int] = []
    logprobs: list[list[TokenLogprob] | None] = []
    if finished:
        last = torch.tensor([len(chunks[i]) - 1 for i in finished], device=dev)
        logits = runner.logits(hidden[torch.tensor(finished, device=dev), last])  # [f, vocab]
        reqs = [joining[i].req for i in finished]
        grammars = [joining[i].grammar for i in finished]
        if any(g is not None for g in grammars):  # structured outputs: the first token obeys the grammar
            constrain_trees(grammars, [NO_TREE] * len(finished))
            masks = step_masks(grammars, [NO_TREE] * len(finished))
            assert masks is not None
            masks.apply(logits)
        logits = process_logits(logits, reqs, [[]] * len(reqs), [NO_TREE] * len(reqs), set(eos_ids))
        tokens = sample_tokens(reqs, [joining[i].context_length for i in finished], logits)
        logprobs = step_logprobs(reqs, logits, lambda j: ([j], [tokens[j]]))
    n = hidden.shape[1]
    # The state that predicted each first token: the prompt's last, for proposers that take states.
    state_rows = [i * n + len(chunks[i]) - 1 for i in finished]
    seconds = time.perf_counter() - t0
    return PrefillStep(hidden, seconds, computed, finished, tokens, logprobs, state_rows, prompt_lps)


def chunk_prompt_logprobs(
    runner: ModelRunner, joining: list[Sequence], chunks: list[list[int]], hidden: torch.Tensor
) -> dict[int, list[TokenLogprob]]:
    """Prompt logprobs this chunk gives, per joining request that asks and has no output yet: the
    row at prompt position q (from the first not yet scored) predicts prompt token q + 1.

    hidden: [b, n, h], request i's chunk at hidden[i, :len(chunks[i])], starting at its cached length."""
    dev = hidden.device
    picks: list[tuple[int, int, int]] = []  # (request, first row in its chunk, rows)
    for i, (seq, chunk) in enumerate(zip(joining, chunks, strict=True)):
        if seq.req.prompt_logprobs is None or seq.output:
            continue
        start, scored = seq.length, len(seq.prompt_logprobs)
        stop = min(start + len(chunk), len(seq.req.prompt_ids) - 1)  # the last prompt row predicts the output
        if stop > max(start, scored):
            picks.append((i, max(start, scored) - start, stop - max(start, scored)))
    if not picks:
        return {}
    b_idx = torch.cat([torch.full((n,), i, dtype=torch.long) for i, _, n in picks]).to(dev)
    col = torch.cat([torch.arange(c, c + n) for _, c, n in picks]).to(dev)
    logits = runner.logits(hidden[b_idx, col])  # [rows, vocab]
    nxt = [joining[i].req.prompt_ids[joining[i].length + c + 1 : joining[i].length + c + 1 + n] for i, c, n in picks]
    n_top = [joining[i].req.prompt_logprobs or 0 for i, _, n in picks for _ in range(n)]
    flat = prompt_logprobs(logits, torch.tensor([t for ts in nxt for t in ts], device=dev), n_top)
    out, offset = {}, 0
    for i, _, n in picks:
        out[i], offset = flat[offset : offset + n], offset + n
    return out


@dataclass(frozen=True)
class DecodeStep:
    hidden: torch.Tensor  # [sum(n_i + 1), h]: the real tokens' states, request by request
    results: list[tuple[list[int], int]]  # per request: accepted node path, bonus token
    logprobs: list[list[TokenLogprob] | None]  # per request, one per emitted token (where asked)
    starts: list[int]  # request i's first row in ``hidden``
    computed: int  # tokens the forward computed (padding included where padded)
    width: int  # the widest row: pending token + tree
    keys: int  # key positions the mask spans
    seconds: float  # the forward, acceptance and logprobs
    path: str  # graph (a CUDA graph replayed) | static (the static step, eagerly) | eager

    def state_rows(self, i: int) -> list[int]:
        """Emitted token j of request i was predicted at its parent's row: the pending token's row
        for the first, accepted node path[j - 1]'s for the rest."""
        start = self.starts[i]
        return [start, *(start + 1 + k for k in self.results[i][0])]


def decode_step(
    runner: ModelRunner,
    seqs: list[Sequence],
    trees: list[TokenTree],
    packed: bool,
    device_accept: bool | None,
    rows: PagedRows,
    eos_ids: set[int] | frozenset[int] = frozenset(),
    masks: StepMasks | None = None,
) -> DecodeStep:
    """One batched forward over prefilled requests (``rows``: their blocks): each one's pending token plus
    its tree (maybe empty); then the grammar masks of constrained requests' rows (``masks``, from
    ``grammar.step_masks``: each node by the grammar state its path reaches), each request's logits
    controls on every row (``logits_controls``: each node as if its path were generated; ``eos_ids`` for
    min_tokens) and lossless acceptance per request (``batch_accept.accept_batch``)."""
    counts = [len(t) + 1 for t in trees]
    width = max(counts)
    lengths = [s.length for s in seqs]
    static = runner.static
    t0 = time.perf_counter()
    if static is not None and static.serves(len(seqs), width, max(lengths)):  # one staged copy; a graph's replay
        tables = [runner.cache.own_blocks(b) for b in rows.blocks]
        path = "graph" if static.replays(len(seqs), width, max(lengths)) else "static"
        hidden = static.forward([s.pending for s in seqs], lengths, trees, tables)  # [sum(n_i + 1), h]
        computed = len(seqs) * width
    else:
        path = "eager"
        hidden, computed = _eager_forward(runner, seqs, trees, rows, packed)
    logits = runner.logits(hidden)  # [sum(n_i + 1), vocab]
    if masks is not None:
        masks.apply(logits)
    reqs = [s.req for s in seqs]
    logits = process_logits(logits, reqs, [s.output for s in seqs], trees, set(eos_ids))
    results = accept_batch(reqs, [s.context_length for s in seqs], trees, logits, counts, device_accept=device_accept)
    starts = [0, *itertools.accumulate(counts)]

    def drawn(i: int) -> tuple[list[int], list[int]]:
        """Emitted token j of request i was drawn at its parent's row: the root (the pending token's
        row) for the first, accepted node path[j - 1] for the rest; the bonus after the last."""
        (path, bonus), start = results[i], starts[i]
        return [start, *(start + 1 + k for k in path)], [*(trees[i].tokens[k] for k in path), bonus]

    logprobs = step_logprobs(reqs, logits, drawn)
    seconds = time.perf_counter() - t0
    return DecodeStep(hidden, results, logprobs, starts, computed, width, max(lengths) + width, seconds, path)


def _eager_forward(
    runner: ModelRunner, seqs: list[Sequence], trees: list[TokenTree], rows: PagedRows, packed: bool
) -> tuple[torch.Tensor, int]:
    """A decode step's forward outside the static step's buckets: the real tokens' hidden states
    [sum(n_i + 1), h], and the tokens it computed (padding included where padded)."""
    dev = runner.device
    step = decode_inputs([s.pending for s in seqs], [s.length for s in seqs], trees, dev)
    width = step.input_ids.shape[1]
    counts = [len(t) + 1 for t in trees]
    real = unpadded(counts, dev)  # (row, column) of each real token: [sum(n_i + 1)] each
    # Packed: the forward holds the real tokens only, so a row pays for its own tree, not the widest
    # (8 rows, one 16-node tree: 169 → 113 ms here). Where padding is under a tenth, the scatter
    # and gather cost more than it saves (8 rows × 5 tokens: 90 vs 94 ms), so those steps stay padded.
    packing = Packing(*real, len(seqs), width) if packed and sum(counts) < 0.9 * len(seqs) * width else None
    computed = sum(counts) if packing is not None else len(seqs) * width
    meta = None
    if runner.tree_kernel:  # the kernel's form of the mask, from the trees: no device read
        from specmesh_kernels.tree_attention import MAX_TREE_ROWS, tree_meta_from_trees

        if width <= MAX_TREE_ROWS:
            meta = tree_meta_from_trees([t.parents for t in trees], [s.length for s in seqs], width, dev)
    hidden = runner.forward(rows, step.input_ids, step.positions, step.mask, step.write_pos, packing, tree_meta=meta)
    return (hidden[0] if packing is not None else hidden[real]), computed  # [sum(n_i + 1), h]
