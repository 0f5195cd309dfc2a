"""Draft-model proposal trees: batched drafting over a slot KV cache, one tree per request.

One proposal for a batch of requests (rows of the slot cache) costs ``depth`` forwards of the
draft model: the first feeds each request's uncached context tail (usually just the verifier's
bonus token) and yields the root distribution; each later one feeds up to ``width`` frontier
nodes per request with a tree attention mask (a node sees the context and its ancestors) and
yields their children. Draft tokens, scores and parents stay on the device until the loop ends;
the trees are copied to the host once and serialized.

Frontier nodes' KV is written after the context, in a storage region of ``max_depth * width``
positions; on the next Advance the accepted nodes' entries are moved into place
(``matched_storage``), the rest is simply overwritten later: no re-prefill.

Tree shape (EAGLE-2 dynamic trees for greedy requests, static sampled shapes drawn without
replacement for sampled ones) and the level-by-level candidate bookkeeping are the batched tree
search's (``proposer_svc.core.tree_search``); this module feeds it the draft model's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from proposer_svc.core.tree_search import DraftConfig, SearchRow, TreeSearch
from specmesh_server.model_runner import ModelRunner, causal_mask

_DRAFT_SEED_MIX = 0x5DEECE66D2B7E151  # draft noise: a stream apart from the verifier's acceptance uniforms


def matched_storage(tokens: list[int], parents: list[int], storage: list[int], new_tokens: list[int]) -> list[int]:
    """Storage slots of the forwarded draft nodes that ``new_tokens`` follow from the root.

    tokens/parents/storage: the last proposal's candidates (parent -1 = root; storage -1 = its
    KV was never computed). The matched nodes' KV is exactly what a prefill of those tokens gives.

    >>> matched_storage([4, 5, 6, 7], [-1, -1, 1, 2], [0, 1, 5, -1], [5, 6, 7, 9])
    [1, 5]
    """
    node, out = -1, []
    for tok in new_tokens:
        nxt = next((m for m in range(len(tokens)) if parents[m] == node and tokens[m] == tok and storage[m] >= 0), None)
        if nxt is None:
            break
        out.append(storage[nxt])
        node = nxt
    return out


# --- per-request state -----------------------------------------------------------------------


@dataclass
class DraftTree:
    """One proposal: the tree sent, and every candidate drafted (for KV reuse on Advance)."""

    tokens: list[int]
    parents: list[int]
    dists: list[tuple[list[int], list[float]]] | None
    cand_tokens: list[int] = field(default_factory=list)
    cand_parents: list[int] = field(default_factory=list)
    cand_storage: list[int] = field(default_factory=list)
    context_length: int = 0


@dataclass
class RequestState:
    """A request's view of the sequence and where its KV lives (owned by the batching thread)."""

    request_id: str
    context: list[int]
    max_nodes: int
    max_depth: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    slot: int = -1
    cached: int = 0  # context tokens whose KV is in the slot
    wanted: bool = True  # a tree for the current context is owed
    last: DraftTree | None = None  # the latest proposal, until the next Advance consumes it
    reused_tokens: int = 0  # KV entries taken over from drafted nodes (not re-fed)
    started: bool = False  # an Advance arrived (the verifier never uses a tree for the bare prompt)

    @property
    def tail(self) -> list[int]:
        return self.context[self.cached :]

    def advance(self, tokens: list[int], cache: object | None) -> None:
        """Append tokens; keep the drafted KV of the ones the last tree had already drafted."""
        last, self.last = self.last, None
        if last is not None and cache is not None and last.context_length == len(self.context) == self.cached:
            # The newest token stays uncached: feeding it yields the next root distribution.
            slots = matched_storage(last.cand_tokens, last.cand_parents, last.cand_storage, tokens[:-1])
            if slots:
                src = torch.tensor(slots, dtype=torch.long, device=cache.device) + self.cached
                cache.gather_positions(self.slot, src, self.cached)
                self.cached += len(slots)
                self.reused_tokens += len(slots)
        self.context.extend(tokens)
        self.wanted = self.started = True


# --- the drafting loop -----------------------------------------------------------------------


class Drafter:
    """Runs the draft model over a slot cache: catch-up prefill and batched tree drafting."""

    def __init__(self, runner: ModelRunner, config: DraftConfig) -> None:
        self.runner, self.config = runner, config
        self.storage = config.max_depth * config.width  # positions after a context reserved for drafted nodes

    @torch.inference_mode()
    def prefill(self, state: RequestState, upto: int) -> None:
        """Feed context[cached:upto] into the request's slot, in chunks."""
        dev = self.runner.device
        while state.cached < upto:
            n = min(self.config.prefill_chunk, upto - state.cached)
            ids = torch.tensor([state.context[state.cached : state.cached + n]], device=dev)  # [1, n]
            pos = torch.arange(state.cached, state.cached + n, device=dev)[None]  # [1, n]
            self.runner.cache.reserve(state.slot + 1, state.cached + n + self.storage)
            self.runner.forward(slice(state.slot, state.slot + 1), ids, pos, causal_mask(pos, state.cached + n))
            state.cached += n

    @torch.inference_mode()
    def draft(self, rows: slice, states: list[RequestState], busy: list[bool]) -> list[DraftTree | None]:
        """One tree per busy row of ``rows`` (states[i] sits in slot rows.start + i); idle rows ride along
        with a dummy token written to scratch positions beyond their storage."""
        cfg, runner, dev = self.config, self.runner, self.runner.device
        b = len(states)
        S, W, K = self.storage, cfg.width, cfg.branch
        is_busy = torch.tensor(busy, device=dev)  # [b]
        tails = [s.tail if on else [0] for s, on in zip(states, busy, strict=True)]
        ctx_h = [s.cached + (len(t) if on else 0) for s, t, on in zip(states, tails, busy, strict=True)]
        search = TreeSearch(
            [
                SearchRow(s.max_nodes, s.max_depth, n, s.temperature, s.top_p, s.top_k, s.seed, on)
                for s, n, on in zip(states, ctx_h, busy, strict=True)
            ],
            cfg,
            _DRAFT_SEED_MIX,
            dev,
        )
        cached = torch.tensor([s.cached for s in states], device=dev)  # [b]
        tail_len = torch.tensor([len(t) for t in tails], device=dev)  # [b]
        ctx = torch.tensor(ctx_h, device=dev)  # [b] context length under each tree
        scratch = cached + S  # idle rows write here (beyond their storage)

        # Step 0: each row's uncached tail → the root distribution.
        P = max(len(t) for t in tails)
        ids = torch.zeros(b, P, dtype=torch.long)
        for i, t in enumerate(tails):
            ids[i, : len(t)] = torch.tensor(t)
        ar = torch.arange(P, device=dev)
        pos = cached[:, None] + ar[None, :]  # [b, P]
        write = torch.where(is_busy[:, None], pos, scratch[:, None] + ar[None, :])
        kv_len = int(max(s.cached + len(t) for s, t, on in zip(states, tails, busy, strict=True) if on))
        runner.cache.reserve(rows.stop, int(max(s.cached for s in states)) + S + max(P, W) + 1)
        mask = causal_mask(pos, kv_len) & is_busy[:, None, None]
        mask[:, :, 0] = True  # idle and padded queries see one key: no all-masked rows
        hidden = runner.forward(rows, ids.to(dev), pos, mask, write)  # [b, P, h]
        logits = runner.logits(hidden[torch.arange(b, device=dev), (tail_len - 1).clamp(min=0)])[:, None]  # [b, 1, V]

        anc = torch.zeros(b, 1, S, dtype=torch.bool, device=dev)  # [b, F, S] storage slots seen by each frontier node
        c_storage = []  # per level [b, F*K]: where a forwarded candidate's KV sits (-1: never forwarded)
        for d in range(1, search.depth + 1):
            search.expand(logits, d)
            c_storage.append(torch.full((b, search.F * K), -1, dtype=torch.long, device=dev))
            if d == search.depth:
                break
            pick = search.next_frontier()  # [b, Wn]
            Wn, new_ok = search.F, search.frontier_ok
            slot_ids = (d - 1) * W + torch.arange(Wn, device=dev)  # [Wn] storage slots of this level
            c_storage[-1].scatter_(1, pick, slot_ids[None, :].expand(b, Wn).masked_fill(~new_ok, -1))
            anc = anc.gather(1, (pick // K)[:, :, None].expand(b, Wn, S)).clone()  # parents' ancestor sets
            anc[:, :, slot_ids] |= torch.eye(Wn, dtype=torch.bool, device=dev)[None]
            # Positions: depth d nodes sit at ctx + d - 1; stored at ctx + slot.
            pos = (ctx + d - 1)[:, None].expand(b, Wn)
            lane = torch.arange(Wn, device=dev)
            write = torch.where(is_busy[:, None], ctx[:, None] + slot_ids[None, :], scratch[:, None] + lane[None, :])
            kv_len = max(ctx_h) + (d - 1) * W + Wn
            rel = torch.arange(kv_len, device=dev)[None, :] - ctx[:, None]  # [b, kv_len] key index in storage
            in_store = (rel >= 0) & (rel < S)
            seen = anc.gather(2, rel.clamp(0, S - 1)[:, None, :].expand(b, Wn, kv_len)) & in_store[:, None, :]
            mask = ((rel < 0)[:, None, :] | seen) & new_ok[:, :, None]
            mask[:, :, 0] = True
            hidden = runner.forward(rows, search.frontier_tokens, pos, mask, write)  # [b, Wn, h]
            logits = runner.logits(hidden)  # [b, Wn, V]

        trees = search.trees(extra=torch.cat(c_storage, 1))  # trees and storage in one device→host copy
        out: list[DraftTree | None] = []
        for s, tree, storage in zip(states, trees, search.extra_host, strict=True):
            if tree is None:
                out.append(None)
                continue
            draft = DraftTree(
                tree.tokens, tree.parents, tree.dists, tree.cand_tokens, tree.cand_parents, storage, len(s.context)
            )
            s.cached, s.last, s.wanted = len(s.context), draft, False  # the tail is in the cache now
            out.append(draft)
        return out
