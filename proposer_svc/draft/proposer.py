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

Tree shape:
- greedy requests: EAGLE-2-style dynamic tree: the children of a frontier node are its top
  ``branch`` tokens, the next frontier is the ``width`` best candidates by draft path
  probability, and the tree sent is the ``max_nodes`` best candidates (ancestor-closed, since a
  child's path probability never exceeds its parent's), best first. Branching therefore lands
  where the draft is uncertain. Greedy acceptance is lossless for any tree.
- sampled requests: a static shape (``sampling_template``: which node gets how many children
  depends only on the budget), children drawn without replacement from the draft's
  temperature/top-p/top-k-truncated sparse distribution q (Gumbel-top-k). Child j of a node is an
  exact draw from q with its earlier siblings removed, and that is the distribution sent with it,
  so SpecInfer's multi-step acceptance in the verifier stays lossless. The shape must not depend
  on the sampled values: a tree pruned by value (or cut by the verifier at a value-dependent
  point) would bias which samples survive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specmesh_server.model_runner import ModelRunner, causal_mask
from specmesh_server.sampling import filter_logits, uniform

_DRAFT_SEED_MIX = 0x5DEECE66D2B7E151  # draft noise: a stream apart from the verifier's acceptance uniforms


@dataclass(frozen=True)
class DraftConfig:
    max_nodes: int = 16  # caps the verifier's budget
    max_depth: int = 6  # caps the verifier's budget; a proposal costs this many draft forwards
    width: int = 4  # frontier nodes forwarded per level and request
    branch: int = 4  # children drawn per frontier node
    q_support: int = 32  # entries of a sampled node's sparse distribution
    q_floor: float = 1e-3  # mass spread over the whole support so every static child can be drawn
    max_batch: int = 16  # requests drafted in one forward
    prefill_chunk: int = 512  # tokens per forward when catching up on a long context


# --- pure cores ------------------------------------------------------------------------------


def proposal_distribution(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    support: int,
    floor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse distribution q a sampled node is drawn from.

    logits [r, V]; temperature, top_p, top_k [r] → ids int64 [r, T], probs fp32 [r, T]: the T
    most likely draft tokens, weighted by the draft softmax after the request's temperature /
    top-p / top-k (renormalised over the T), mixed with ``floor`` spread evenly. Sums to 1 and
    every entry is positive, so T distinct children can always be drawn.

    >>> ids, q = proposal_distribution(torch.tensor([[0.0, 2.0, 1.0, -1.0]]), torch.tensor([1.0]),
    ...                                torch.tensor([1.0]), torch.tensor([2]), support=3, floor=0.03)
    >>> ids.tolist(), [round(p, 4) for p in q[0].tolist()]
    ([[1, 2, 0]], [0.7191, 0.2709, 0.01])
    """
    filtered = filter_logits(logits, temperature, top_p, top_k)  # [r, V], -inf outside
    ids = torch.topk(logits, min(support, logits.shape[-1]), dim=-1).indices  # [r, T]
    p = torch.softmax(filtered, dim=-1).gather(1, ids)  # [r, T]
    p = p / p.sum(-1, keepdim=True)  # the argmax always survives filtering, so the sum is > 0
    return ids, (1 - floor) * p + floor / ids.shape[-1]


def gumbel_order(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Order of sampling without replacement (Gumbel-top-k): entry 0 is a draw from ``probs``,
    entry 1 a draw from the rest renormalised, and so on.

    probs [..., T] > 0; u [..., T] uniforms in (0, 1) → int64 [..., T], a permutation.

    >>> gumbel_order(torch.tensor([[0.2, 0.5, 0.3]]), torch.tensor([[0.5, 0.5, 0.5]])).tolist()
    [[1, 2, 0]]
    """
    keys = probs.double().log() - torch.log(-torch.log(u.double()))
    return torch.argsort(keys, dim=-1, descending=True)


def sibling_distribution(ids: list[int], probs: list[float], j: int) -> tuple[list[int], list[float]]:
    """The distribution child j was drawn from: q without the j earlier siblings, renormalised.

    ``ids``/``probs`` are q in sampling order (the drawn children first).

    >>> sibling_distribution([5, 7, 9], [0.5, 0.3, 0.2], 1)
    ([7, 9], [0.6, 0.4])
    """
    rest = probs[j:]
    total = math.fsum(rest)
    return ids[j:], [round(p / total, 12) for p in rest]


def sampling_template(max_nodes: int, max_depth: int, width: int, branch: int) -> list[list[int]]:
    """Static children counts per level and frontier slot for sampled trees.

    The nodes are spread evenly over the levels; a level's nodes go round-robin to its frontier
    slots (at most ``branch`` each); the next frontier is the first ``width`` children, first
    children of every slot before second ones (the first draw of each node is the likeliest
    to be accepted, so chains get extended first).

    >>> sampling_template(8, 3, width=2, branch=4)
    [[3], [2, 1], [1, 1]]
    >>> sum(map(sum, sampling_template(16, 6, width=4, branch=4)))
    16
    """
    counts: list[list[int]] = []
    frontier, left = 1, max_nodes
    for level in range(max_depth):
        if left <= 0:
            break
        n = min(-(-left // (max_depth - level)), frontier * branch)
        counts.append([n // frontier + (f < n % frontier) for f in range(frontier)])
        left -= n
        frontier = min(width, n)
    return counts


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


@dataclass(frozen=True)
class SearchRow:
    """One request's part in a batched tree search."""

    max_nodes: int
    max_depth: int
    context_length: int  # salts the sampled draws: a new context, new noise
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    busy: bool = True  # False: the row rides along (batched forwards) and gets no tree


@dataclass
class SearchTree:
    """A row's tree, best first (greedy) or in the static sampling order, and every candidate."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]  # path probability under the drafter
    dists: list[tuple[list[int], list[float]]] | None  # sampled rows: the distribution of each node
    cand_tokens: list[int]  # every candidate drafted, by candidate index
    cand_parents: list[int]


class TreeSearch:
    """The level-by-level candidate bookkeeping of a batched tree search, whatever drafts the levels
    (the draft model over its KV cache, the head over its own states): see the module doc for the
    tree shapes. Per level: ``expand`` with the frontier's logits, then ``next_frontier`` picks the
    nodes to draft from next; ``trees`` reads every row's tree off the device once."""

    def __init__(self, rows: list[SearchRow], config: DraftConfig, seed_mix: int, device: torch.device) -> None:
        self.rows, self.config, self.dev = rows, config, device
        b, W, K = len(rows), config.width, config.branch
        self.depth = max(min(r.max_depth, config.max_depth) for r in rows if r.busy)  # levels drafted
        self.sampled = torch.tensor([r.busy and r.temperature > 0 for r in rows], device=device)  # [b]
        self.any_sampled = any(r.busy and r.temperature > 0 for r in rows)
        self.depth_cap = torch.tensor(
            [min(r.max_depth, config.max_depth) if r.busy else 0 for r in rows], device=device
        )
        if self.any_sampled:
            self.temp = torch.tensor([max(r.temperature, 1e-5) for r in rows], device=device)
            self.top_p = torch.tensor([r.top_p if 0 < r.top_p <= 1 else 1.0 for r in rows], device=device)
            self.top_k = torch.tensor([max(r.top_k, 0) for r in rows], device=device)
            self.seeds = torch.tensor([(r.seed ^ seed_mix) & 0x7FFFFFFFFFFFFFFF for r in rows])
            template = torch.zeros(b, self.depth, W, dtype=torch.long)  # children per (level, frontier slot)
            for i, r in enumerate(rows):
                if r.busy and r.temperature > 0:
                    counts = sampling_template(
                        min(r.max_nodes, config.max_nodes), min(r.max_depth, config.max_depth), W, K
                    )
                    for d, row in enumerate(counts):
                        template[i, d, : len(row)] = torch.tensor(row)
            self.template = template.to(device)
        self.F = 1  # frontier nodes per row
        self.parent_score = torch.zeros(b, 1, device=device)  # [b, F] log path probability
        self.frontier_cand = torch.full((b, 1), -1, dtype=torch.long, device=device)  # [b, F] candidate index
        self.frontier_ok = torch.tensor([r.busy for r in rows], device=device)[:, None]  # [b, F]
        self.offset = 0  # candidates before the current level
        self.c_tok: list[torch.Tensor] = []  # per level [b, F*K]
        self.c_score: list[torch.Tensor] = []
        self.c_parent: list[torch.Tensor] = []
        self.c_ok: list[torch.Tensor] = []
        self.q_ids: list[torch.Tensor] = []  # per level [b, F, T], sampling order
        self.q_probs: list[torch.Tensor] = []

    def expand(self, logits: torch.Tensor, d: int) -> None:
        """Level ``d``'s candidates: each frontier node's top ``branch`` children (greedy rows) or its
        first draws without replacement (sampled rows). logits [b, F, V] of the frontier nodes."""
        cfg, b, F, K, dev = self.config, len(self.rows), self.F, self.config.branch, self.dev
        lp = torch.log_softmax(logits.float(), dim=-1)  # [b, F, V]
        cand_lp, cand_ids = lp.topk(K, dim=-1)  # [b, F, K]
        if self.any_sampled:
            V = logits.shape[-1]
            q_ids, q_p = proposal_distribution(
                logits.reshape(b * F, V),
                self.temp.repeat_interleave(F),
                self.top_p.repeat_interleave(F),
                self.top_k.repeat_interleave(F),
                cfg.q_support,
                cfg.q_floor,
            )  # [b*F, T]
            T = q_ids.shape[-1]
            counters = (torch.tensor([r.context_length for r in self.rows])[:, None, None] * 1024 + d).expand(b, F, T)
            salts = torch.arange(F * T).repeat(b) + 1
            u = uniform(self.seeds[:, None].expand(b, F * T).reshape(-1), counters.reshape(-1), salts).view(b * F, T)
            order = gumbel_order(q_p, u.to(dev))  # [b*F, T]
            q_ids = q_ids.gather(1, order).view(b, F, T)  # sampling order
            q_p = q_p.gather(1, order).view(b, F, T)
            self.q_ids.append(q_ids)
            self.q_probs.append(q_p)
            cand_ids = torch.where(self.sampled[:, None, None], q_ids[..., :K], cand_ids)
            cand_lp = torch.where(self.sampled[:, None, None], q_p[..., :K].log(), cand_lp)
        score = self.parent_score[:, :, None] + cand_lp  # [b, F, K]
        ok = self.frontier_ok[:, :, None] & (d <= self.depth_cap)[:, None, None]
        if self.any_sampled:
            j = torch.arange(K, device=dev)
            ok = ok & (~self.sampled[:, None, None] | (j[None, None, :] < self.template[:, d - 1, :F, None]))
        ok = ok.expand(b, F, K)
        self.c_tok.append(cand_ids.reshape(b, F * K))
        self.c_score.append(score.masked_fill(~ok, float("-inf")).reshape(b, F * K))
        self.c_parent.append(self.frontier_cand[:, :, None].expand(b, F, K).reshape(b, F * K))
        self.c_ok.append(ok.reshape(b, F * K))

    def next_frontier(self) -> torch.Tensor:
        """The last level's candidates to draft from next: the ``width`` best by path probability
        (greedy rows) / first draws first (sampled rows, static). Returns their indices in the level
        [b, Wn]; ``frontier_tokens`` and ``frontier_ok`` describe them."""
        F, K, dev = self.F, self.config.branch, self.dev
        Wn = min(self.config.width, F * K)
        fk = torch.arange(F * K, device=dev)
        static_key = -((fk % K) * F + fk // K).float()  # [F*K]: child j of slot f ranks j*F + f
        key = torch.where(self.sampled[:, None], static_key[None, :], self.c_score[-1])
        key = key.masked_fill(~self.c_ok[-1], float("-inf"))
        pick = key.topk(Wn, dim=-1).indices  # [b, Wn]
        self.frontier_tokens = self.c_tok[-1].gather(1, pick)
        self.frontier_ok = self.c_ok[-1].gather(1, pick)
        self.parent_score = self.c_score[-1].gather(1, pick)
        self.frontier_cand = self.offset + pick
        self.offset += F * K
        self.F = Wn
        return pick

    def trees(self, ids: torch.Tensor | None = None, extra: torch.Tensor | None = None) -> list[SearchTree | None]:
        """Every busy row's tree (idle rows: None), read off the device in one copy; ``ids`` maps
        the logits' indices to token ids (a reduced vocabulary), None: they are the ids. ``extra``
        (int [b, X], values below 2**53) rides along in the same copy: ``self.extra_host``, its rows."""
        b, K, dev = len(self.rows), self.config.branch, self.dev
        tok = torch.cat(self.c_tok, 1)  # [b, M]
        tok = tok if ids is None else ids[tok]
        score = torch.cat(self.c_score, 1)
        parent = torch.cat(self.c_parent, 1)
        ok = torch.cat(self.c_ok, 1)
        M = tok.shape[1]
        order = torch.sort(-score, dim=1, stable=True).indices  # best first; a parent before its children
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(M, device=dev)[None].expand(b, M))
        budget = torch.tensor([min(r.max_nodes, self.config.max_nodes) for r in self.rows], device=dev)
        keep = ok & (self.sampled[:, None] | (rank < budget[:, None]))
        order = torch.where(self.sampled[:, None], torch.arange(M, device=dev)[None].expand(b, M), order)
        qs = [q if ids is None else ids[q] for q in self.q_ids] + list(self.q_probs) if self.any_sampled else []
        parts = [tok, parent, keep, order, score, *([extra] if extra is not None else []), *qs]
        # The one host copy of the trees: every part as float64 (ids and indices < 2**53 stay exact).
        flat = torch.cat([x.double().reshape(-1) for x in parts]).cpu()
        host = [x.view(y.shape) for x, y in zip(flat.split([x.numel() for x in parts]), parts, strict=True)]
        tok_h, parent_h, keep_h, order_h = (x.long().tolist() for x in host[:4])  # keep_h: 0/1
        prob_h = host[4].exp().tolist()
        self.extra_host = host[5].long().tolist() if extra is not None else None
        if self.any_sampled:
            levels = len(self.q_ids)
            q_sizes = [q.shape[1] for q in self.q_ids]
            q_host = host[len(host) - 2 * levels :]
            q_ids_h = [x.long().tolist() for x in q_host[:levels]]
            q_p_h = [x.tolist() for x in q_host[levels:]]
        out: list[SearchTree | None] = []
        for i, r in enumerate(self.rows):
            if not r.busy:
                out.append(None)
                continue
            new_index: dict[int, int] = {}
            tree = SearchTree([], [], [], [] if r.temperature > 0 else None, tok_h[i], parent_h[i])
            for m in order_h[i]:
                if not keep_h[i][m]:
                    continue
                p = parent_h[i][m]
                new_index[m] = len(tree.tokens)
                tree.tokens.append(tok_h[i][m])
                tree.parents.append(new_index[p] if p >= 0 else -1)
                tree.probs.append(min(1.0, prob_h[i][m]))
                if tree.dists is not None:
                    level, within = _level_of(m, q_sizes, K)
                    f, j = divmod(within, K)
                    tree.dists.append(sibling_distribution(q_ids_h[level][i][f], q_p_h[level][i][f], j))
            out.append(tree)
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


def _level_of(m: int, frontier_sizes: list[int], branch: int) -> tuple[int, int]:
    """(level, index within level) of candidate ``m`` when level d holds frontier_sizes[d] * branch.

    >>> _level_of(6, [1, 4], 4)
    (1, 2)
    """
    for level, f in enumerate(frontier_sizes):
        if m < f * branch:
            return level, m
        m -= f * branch
    raise IndexError(m)
