"""The batched tree search both tree proposers run: the draft model (``proposer_svc.draft``) over its
KV cache and the learned head (``proposer_svc.head``) over its own states. Whatever drafts a level's
logits, the candidates, the frontier and the trees sent are chosen here, for a batch of requests at
once, and read off the device in one copy.

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
from dataclasses import dataclass

import torch

from specmesh_server.sampling import filter_logits, uniform


@dataclass(frozen=True)
class DraftConfig:
    """A tree search's caps and shape, and how its rounds batch (the draft model and the head alike)."""

    max_nodes: int = 16  # caps the verifier's budget
    max_depth: int = 6  # caps the verifier's budget; a proposal costs this many draft forwards
    width: int = 4  # frontier nodes forwarded per level and request
    branch: int = 4  # children drawn per frontier node
    q_support: int = 32  # entries of a sampled node's sparse distribution
    q_floor: float = 1e-3  # mass spread over the whole support so every static child can be drawn
    max_batch: int = 16  # requests drafted in one forward
    prefill_chunk: int = 512  # the draft model: tokens per forward when catching up on a long context


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
