"""Structured outputs: a request's grammar (xgrammar), its token masks over a step's rows, and the
pruning of draft nodes the grammar forbids.

A constrained request's every logits row is masked by the grammar state its path reaches: the
root row (after the request's output) by the request's matcher, tree node i's row by the state
after the node's ancestors and the node. ``GrammarMatcher.traverse_draft_tree`` walks a whole
tree in C++ (accept, fill the row, recurse, roll back), so a step costs one call per constrained
request and no Python per node. Masked logits are -inf where the grammar forbids the token, before
anything reads them (``logits_controls``), so the greedy and the sampled walks, the device kernel
and logprobs all see the constrained target distribution p_G(x) ∝ p(x)·[x allowed].

Pruning: a node whose token its parent's row forbids has p_G = 0 there and would always be
rejected, so it and its subtree are cut before the forward (they cost rows, not output). For
deterministic drafts the tree stays a function of the context, so acceptance is unchanged. For
sampled drafts (a node carries the proposal q it was drawn from), a surviving node is a draw from
q conditioned on the allowed set; its q is restricted to that set (acceptance renormalises it),
which keeps multi-step speculative sampling exact: survivors are independent draws from the
restricted proposals, and their number depends only on which draws were allowed.

Compiled grammars are cached by their spec (``GrammarCompiler``); a spec that cannot compile is
refused naming its field.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xgrammar as xgr

from specmesh_server.tree import TokenTree
from verifier_svc.requests import GrammarSpec, InvalidRequest

if TYPE_CHECKING:
    from specmesh_server.metrics import VerifierMetrics

log = logging.getLogger(__name__)
MAX_FORCED = 16  # tokens of a grammar's forced continuation drafted in one step


class GrammarCompiler:
    """Compiles a request's ``GrammarSpec`` for the model's tokenizer, caching the most recent
    ``cache_size`` compiled grammars by spec (xgrammar's own cache sits below it). Thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: set[int],
        cache_size: int = 256,
        metrics: VerifierMetrics | None = None,
    ) -> None:
        # The model's vocabulary (its logits' width) may exceed the tokenizer's: the rest are never allowed.
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        # The tokenizer's added tokens (<|im_start|>, <|endoftext|> …) are not text: xgrammar, which
        # finds no special tokens in some tokenizers (SmolLM2's), would allow them inside a JSON string.
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.banned = bit_clearer(sorted(set(added) - set(stop_token_ids)), vocab_size)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._size, self._lock, self.metrics = cache_size, threading.Lock(), metrics
        # Forced continuations are encoded on the engine thread with a tokenizer of its own (a fast
        # tokenizer's settings must not change under another thread's call); they repeat (JSON keys).
        raw = copy.deepcopy(getattr(tokenizer, "backend_tokenizer", None) or tokenizer)

        def encode(text: str) -> tuple[int, ...]:
            ids = raw.encode(text, add_special_tokens=False)
            return tuple(getattr(ids, "ids", ids))  # a tokenizers Encoding, or a slow tokenizer's list

        self.encode = functools.lru_cache(4096)(encode)

    def request(self, compiled: xgr.CompiledGrammar) -> RequestGrammar:
        """A new request's grammar state: a matcher of ``compiled``, with this tokenizer's forced-text
        encoder and banned tokens."""
        return RequestGrammar.start(compiled, self.vocab_size, self.encode, self.banned)

    def cached(self, spec: GrammarSpec) -> xgr.CompiledGrammar | None:
        """The compiled grammar of ``spec`` if it is cached (a lookup, no compile)."""
        with self._lock:
            if (hit := self._cache.get(spec)) is not None:
                self._cache.move_to_end(spec)
            return hit

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); ``InvalidRequest`` naming its field if it does not compile."""
        if (hit := self.cached(spec)) is not None:
            return hit
        t0 = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
            raise InvalidRequest(spec.field, f"cannot compile: {_first_line(exc)}") from exc
        if self.metrics is not None:
            self.metrics.grammar_compiled(spec.kind, time.perf_counter() - t0)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        c, ws = self._compiler, spec.any_whitespace
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.value, any_whitespace=ws, strict_mode=True)
        if spec.kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=ws, strict_mode=True)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            return c.compile_grammar(choice_ebnf(spec.choices))
        return c.compile_grammar(spec.value, root_rule_name="root")


class CompilePool:
    """Compiles ``compiler``'s specs on ``threads`` threads, so a cheap schema never waits behind
    expensive ones (xgrammar compiles outside the GIL); one compile per spec in flight, however many
    requests send it. A request waits at most ``timeout_s``: then ``InvalidRequest`` names its field,
    and the compile finishes into the cache (a retry finds it)."""

    def __init__(self, compiler: GrammarCompiler, threads: int, timeout_s: float) -> None:
        self.compiler, self.timeout_s = compiler, timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="specmesh-grammar")
        self._in_flight: dict[GrammarSpec, asyncio.Future] = {}

    async def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """``spec`` compiled (or from the cache, at once), on the calling event loop's terms."""
        if (hit := self.compiler.cached(spec)) is not None:
            return hit
        running = self._in_flight.get(spec)
        if running is None:
            running = asyncio.get_running_loop().run_in_executor(self._pool, self.compiler.compile, spec)
            self._in_flight[spec] = running
            running.add_done_callback(lambda _: self._in_flight.pop(spec, None))
        try:  # shielded: a request that stops waiting leaves the compile running for the others
            return await asyncio.wait_for(asyncio.shield(running), self.timeout_s)
        except TimeoutError:
            why = f"did not compile within {self.timeout_s:g} s (--grammar-compile-timeout): simplify it"
            raise InvalidRequest(spec.field, why) from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are EBNF's).

    >>> choice_ebnf(("yes", 'say "no"'))
    'root ::= "yes" | "say \\\\"no\\\\""'
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass
class RequestGrammar:
    """A constrained request's grammar state: its matcher has accepted the request's whole output."""

    matcher: xgr.GrammarMatcher
    width: int  # bitmask words per row: ceil(vocab / 32)
    # Text → token ids, for the forced continuation's drafts (``forced_tokens``); None: no such drafts.
    encode: Callable[[str], tuple[int, ...]] | None = None
    pruned: int = 0  # draft nodes cut so far (``SpeculationMetrics.grammar_pruned_nodes``)
    forced: int = 0  # draft nodes the grammar's forced continuation added so far
    rows: torch.Tensor | None = None  # int32 [1 + nodes, W]: this step's masks, root first

    # Tokens never allowed (the tokenizer's added tokens but its stop tokens): ``bit_clearer``'s form.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def start(
        cls,
        compiled: xgr.CompiledGrammar,
        vocab_size: int,
        encode: Callable[[str], tuple[int, ...]] | None = None,
        banned: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> RequestGrammar:
        return cls(xgr.GrammarMatcher(compiled), (vocab_size + 31) // 32, encode, banned=banned)

    def forced_tokens(self, limit: int) -> tuple[int, ...]:
        """The text the grammar forces next (e.g. ``", "topic": "`` after a JSON string closes), as at
        most ``limit`` tokens: drafts no proposer needs to guess. Empty where the next token is free."""
        if self.encode is None or limit <= 0:
            return ()
        text = self.matcher.find_jump_forward_string()
        return self.encode(text)[:limit] if text else ()

    def advance(self, tokens: list[int]) -> None:
        """The request emitted ``tokens`` (each drawn from a masked row, so each is allowed)."""
        for tok in tokens:
            if not self.matcher.accept_token(tok):
                raise RuntimeError(f"the grammar rejected emitted token {tok}: a row was not masked")


def bit_clearer(ids: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Bitmask rows ``&=`` this to forbid ``ids``: (words int64 [k], keep int32 [k]), or None for no ids.

    >>> words, keep = bit_clearer([0, 2, 33], 64)
    >>> rows = torch.full((1, 2), -1, dtype=torch.int32); rows[:, words] &= keep
    >>> rows.tolist()   # bits 0 and 2 of word 0, bit 1 of word 1 cleared
    [[-6, -3]]
    """
    ids = [i for i in ids if 0 <= i < vocab_size]
    if not ids:
        return None
    bits: dict[int, int] = {}
    for i in ids:
        bits[i >> 5] = bits.get(i >> 5, 0) | (1 << (i & 31))
    keep = np.array([~b for b in bits.values()], dtype=np.int64).astype(np.uint32).view(np.int32)
    return torch.tensor(list(bits), dtype=torch.long), torch.from_numpy(keep.copy())


def tree_links(parents: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The tree in xgrammar's first-child / next-sibling form, node 0 the root and node i + 1
    ``parents``' node i: (first child, next sibling) int64 [1 + n] each, -1 for none.

    >>> first, sibling = tree_links([-1, 0, -1])   # root → 1 → 2, root → 3
    >>> first.tolist(), sibling.tolist()
    ([1, 2, -1, -1], [-1, 3, -1, -1])
    """
    n = len(parents)
    parent = np.asarray(parents, dtype=np.int64) + 1  # [n]: each node's parent, root 0
    order = np.argsort(parent, kind="stable")  # children grouped by parent, in tree order
    first = np.full(n + 1, -1, dtype=np.int64)
    sibling = np.full(n + 1, -1, dtype=np.int64)
    if n:
        grouped = parent[order]
        starts = np.r_[True, grouped[1:] != grouped[:-1]]
        first[grouped[starts]] = order[starts] + 1
        same = grouped[1:] == grouped[:-1]
        sibling[order[:-1][same] + 1] = order[1:][same] + 1
    return first, sibling


def allowed_nodes(rows: torch.Tensor, tokens: list[int], parents: list[int]) -> np.ndarray:
    """Which tree nodes the grammar allows: node i's token is set in its parent's row. ``rows``
    int32 [1 + n, W], root first, from a traversal into zeroed rows (a node under a forbidden one
    was never visited, its row stays 0, so its children fail too: the test is transitive).

    >>> rows = torch.zeros(3, 1, dtype=torch.int32); rows[0, 0] = 0b0110; rows[1, 0] = 0b1000
    >>> allowed_nodes(rows, [1, 3, 5], [-1, 0, -1]).tolist()   # root allows 1, 2; node 1 allows 3
    [True, True, False]
    """
    if not tokens:
        return np.zeros(0, dtype=bool)
    tok = torch.tensor(tokens, dtype=torch.long)
    words = rows[torch.tensor(parents, dtype=torch.long) + 1, tok >> 5]  # [n]
    return ((words >> (tok & 31)) & 1).bool().numpy()


def prune(tree: TokenTree, keep: np.ndarray, rows: torch.Tensor) -> TokenTree:
    """``tree`` without the nodes ``keep`` drops (whole subtrees, by ``allowed_nodes``); sampled
    nodes' proposals restricted to the tokens their parent's row allows.

    >>> rows = torch.full((4, 1), 0b111, dtype=torch.int32)
    >>> prune(TokenTree([1, 2, 3], [-1, 0, -1]), np.array([True, False, True]), rows)
    TokenTree(tokens=[1, 3], parents=[-1, -1], dists=None, probs=None)
    """
    kept = np.flatnonzero(keep)
    new_index = np.cumsum(keep) - 1
    parents = [int(new_index[tree.parents[i]]) if tree.parents[i] >= 0 else -1 for i in kept]
    dists = None
    if tree.dists is not None:
        dists = [_restricted(tree.dists[i], rows[tree.parents[i] + 1]) for i in kept]
    probs = [tree.probs[i] for i in kept] if tree.probs is not None else None
    return TokenTree([tree.tokens[i] for i in kept], parents, dists, probs)


def _restricted(dist: tuple[list[int], list[float]], row: torch.Tensor) -> tuple[list[int], list[float]]:
    """A sparse proposal (ids, probs) restricted to the tokens set in the bitmask ``row``."""
    ids = torch.tensor(dist[0], dtype=torch.long)
    ok = ((row[ids >> 5] >> (ids & 31)) & 1).bool().tolist()
    return [i for i, y in zip(dist[0], ok, strict=True) if y], [p for p, y in zip(dist[1], ok, strict=True) if y]


def graft(tree: TokenTree, chain: tuple[int, ...] | list[int], room: int) -> tuple[TokenTree, int]:
    """``tree`` with the path ``chain`` from the root where it is not already (a trie insert), within
    ``room`` nodes in all, and the nodes added. New nodes are deterministic drafts (a one-hot
    proposal where the tree's nodes carry proposals; the parent's path probability where they carry
    those: the grammar makes them certain).

    >>> graft(TokenTree([5, 6], [-1, 0]), [5, 7, 8], room=9)
    (TokenTree(tokens=[5, 6, 7, 8], parents=[-1, 0, 0, 2], dists=None, probs=None), 2)
    >>> graft(TokenTree([], []), [3, 4, 5], room=2)[0].tokens
    [3, 4]
    """
    tokens, parents = np.asarray(tree.tokens, dtype=np.int64), np.asarray(tree.parents, dtype=np.int64)
    node, at = -1, 0
    while at < len(chain):  # descend while the tree already has the chain's next token
        hit = np.flatnonzero((parents == node) & (tokens == chain[at]))
        if not len(hit):
            break
        node, at = int(hit[0]), at + 1
    new = list(chain[at : at + max(room - len(tree), 0)])
    if not new:
        return tree, 0
    n = len(tree)
    new_parents = [node, *range(n, n + len(new) - 1)]
    dists = None if tree.dists is None else [*tree.dists, *(([t], [1.0]) for t in new)]
    probs = None
    if tree.probs is not None:
        probs = [*tree.probs, *([tree.probs[node] if node >= 0 else 1.0] * len(new))]
    return TokenTree([*tree.tokens, *new], [*tree.parents, *new_parents], dists, probs), len(new)


def constrain_trees(
    grammars: list[RequestGrammar | None], trees: list[TokenTree], rooms: list[int] | None = None
) -> list[TokenTree]:
    """Each constrained request's masks for this step (``RequestGrammar.rows``: its root's, then its
    kept nodes') and its tree without the nodes its grammar forbids; other requests' trees unchanged.
    ``rooms[i]`` > 0: request i speculates, and its tree first gains the text its grammar forces next
    (``forced_tokens``, ``graft``) within that many nodes. One xgrammar call per constrained request
    (the whole tree in C++), no Python per node."""
    out = []
    for i, (g, tree) in enumerate(zip(grammars, trees, strict=True)):
        if g is None:
            out.append(tree)
            continue
        room = rooms[i] if rooms is not None else 0
        if room > len(tree) and (chain := g.forced_tokens(min(room, MAX_FORCED))):
            tree, added = graft(tree, chain, room)
            g.forced += added
        rows = torch.zeros(len(tree) + 1, g.width, dtype=torch.int32)  # [1 + n, W]; unvisited rows stay 0
        if len(tree):
            first, sibling = tree_links(tree.parents)
            draft = torch.tensor([0, *tree.tokens], dtype=torch.int64)  # node 0's token is not read
            g.matcher.traverse_draft_tree(torch.from_numpy(first), torch.from_numpy(sibling), draft, rows)
        else:
            g.matcher.fill_next_token_bitmask(rows)
        if g.banned is not None:  # before pruning: a drafted banned token is cut too
            rows[:, g.banned[0]] &= g.banned[1]
        keep = allowed_nodes(rows, tree.tokens, tree.parents)
        if not keep.all():
            g.pruned += int((~keep).sum())
            tree = prune(tree, keep, rows)
            rows = rows[torch.from_numpy(np.r_[True, keep])]
        g.rows = rows
        out.append(tree)
    return out


@dataclass(frozen=True)
class StepMasks:
    """The grammar masks of a step's constrained rows."""

    bitmask: torch.Tensor  # int32 [rows, W]: row r masks logits row r (unconstrained rows: all ones)
    rows: list[int]  # the constrained rows

    def apply(self, logits: torch.Tensor) -> None:
        """Forbidden tokens' logits → -inf, in place, on the constrained rows only (xgrammar's kernel:
        72 rows of a 49k vocabulary in ~15 ms on 2 cores, where gathering them first took ~60 ms).
        logits: [rows, V]."""
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=self.rows)


def step_masks(grammars: list[RequestGrammar | None], trees: list[TokenTree]) -> StepMasks | None:
    """The masks of a step whose request i has rows [its root, its tree's nodes] in the logits, from
    each constrained request's ``rows`` (cut to its tree: the width gate may have shortened it since
    ``constrain_trees``). None when no request is constrained."""
    sizes = [len(t) + 1 for t in trees]
    picked = [(g, n, s) for g, n, s in zip(grammars, sizes, np.cumsum([0, *sizes]), strict=False) if g is not None]
    if not picked:
        return None
    bitmask = torch.full((sum(sizes), picked[0][0].width), -1, dtype=torch.int32)  # [rows, W]
    rows: list[int] = []
    for g, n, start in picked:
        assert g.rows is not None
        bitmask[start : start + n] = g.rows[:n]
        rows.extend(range(start, start + n))
    return StepMasks(bitmask, rows)
