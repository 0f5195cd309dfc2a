"""``specmesh serve head``: the learned-head proposer, drafting from the target's own hidden states.

Each stream asks the verifier for hidden states in its first response (``HiddenStateRequest``);
every Advance then brings one state per appended token, of which the head needs the last (the
state that predicted the context's last token). The streams only queue events; one background
thread owns the head and drafts every request owed a tree together, one head forward per draft
depth (``head.draft_trees``).

The head folder names the target it was trained for; a verifier whose tokenizer differs is
refused (FAILED_PRECONDITION), and so is a ``--target`` whose tokenizer or shape differs (the
service does not start). Without ``--head`` the service uses the head cached for the target,
training it once first (``specmesh head train``; minutes stated up front, path printed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from proposer_svc.core.event_thread import Close, EventThread, QueuedCore
from proposer_svc.core.process import ServingConfig, add_serving_flags, proposer_server, serve_proposer, serving_config
from proposer_svc.core.stream import Deliver, ProposeStream, StreamConfig
from proposer_svc.core.tree_flags import add_tree_flags, tree_settings
from proposer_svc.core.tree_message import tree_response
from specmesh.v1 import proposer_pb2
from specmesh_server.flags import ServiceFlags
from specmesh_server.log_limit import RateLimitedLog
from specmesh_server.metrics import ProposerMetrics
from specmesh_server.torch_thread import TorchThread

if TYPE_CHECKING:
    import torch

    from proposer_svc.core.tree_search import DraftConfig, SearchRow
    from proposer_svc.head.proposer import Head

log = logging.getLogger(__name__)
errors = RateLimitedLog(log)


@dataclass
class HeadRequest:
    """One stream's state, owned by the loop thread."""

    deliver: Deliver
    search: SearchRow  # budget, context length and sampling: the next tree's
    token: int  # the context's last token
    state: torch.Tensor | None = None  # [H]: the target state that predicted ``token``; None: not sent
    wanted: bool = False  # a tree for the current context is owed


@dataclass
class _Open:
    key: int
    request: HeadRequest


@dataclass
class _Advance:
    key: int
    tokens: list[int]
    state: torch.Tensor | None
    budget: proposer_pb2.TreeBudget


class HeadLoop(EventThread):
    """The drafting thread: applies queued events, then drafts all owed trees in batches."""

    def __init__(
        self,
        head: Head,
        config: DraftConfig,
        max_batch: int,
        metrics: ProposerMetrics | None,
        thread: TorchThread | None = None,
    ) -> None:
        super().__init__("head-loop", thread)
        self.head, self.config, self.max_batch, self.metrics = head, config, max_batch, metrics
        self._requests: dict[int, HeadRequest] = {}
        self.rounds, self.round_s = 0, 0.0

    def _run(self) -> None:
        while (events := self._events()) is not None:
            # Several Advances of one request coalesce (the newest context wins); one that fails ends its
            # own stream only.
            self._apply_all(events)
            owed = [(k, r) for k, r in self._requests.items() if r.wanted]
            for i in range(0, len(owed), self.max_batch):
                self._draft(owed[i : i + self.max_batch])

    def _end(self, key: int | None) -> None:
        r = self._requests.pop(key, None)
        if r is not None:
            r.deliver(None)

    def _apply(self, ev: _Open | _Advance | Close) -> None:
        if isinstance(ev, _Open):
            self._requests[ev.key] = ev.request
        elif isinstance(ev, Close):
            self._requests.pop(ev.key, None)
        elif (r := self._requests.get(ev.key)) is not None:
            r.token, r.state, r.wanted = ev.tokens[-1], ev.state, True
            r.search = replace(
                r.search,
                context_length=r.search.context_length + len(ev.tokens),
                max_nodes=ev.budget.max_nodes or r.search.max_nodes,
                max_depth=ev.budget.max_depth or r.search.max_depth,
            )

    def _draft(self, batch: list[tuple[int, HeadRequest]]) -> None:
        from proposer_svc.head.proposer import DraftRow, draft_trees

        for _, r in batch:
            r.wanted = False
        ready = [r for _, r in batch if r.state is not None]
        for _, r in batch:
            if r.state is None:  # no state for this context (the verifier sent none): nothing to draft from
                r.deliver(proposer_pb2.ProposeResponse(context_length=r.search.context_length))
        if not ready:
            return
        rows = [DraftRow(r.state, r.token, r.search) for r in ready]
        t0 = time.perf_counter()
        try:
            trees = draft_trees(self.head, rows, self.config)
        except Exception:  # a bug must not hang the streams: end them, keep serving
            errors.error("draft", "head drafting failed", exc_info=True)
            for r in ready:
                r.deliver(None)
            return
        seconds = time.perf_counter() - t0
        self.rounds, self.round_s = self.rounds + 1, self.round_s + seconds
        for r, tree in zip(ready, trees, strict=True):
            if self.metrics is not None:
                self.metrics.proposal(len(tree.tokens), seconds)
            probs = tree.probs if tree.dists is None else ()  # sampled shapes are never cut by value
            r.deliver(tree_response(r.search.context_length, tree, probs))


class HeadStream(QueuedCore):
    """One stream's core (``StateTaker``): asks for hidden states, queues events for the loop."""

    loop: HeadLoop
    _state: torch.Tensor | None = None  # [H]: the last Advance's state, until ``advance`` queues it

    def start(self, prompt: list[int], budget: proposer_pb2.TreeBudget) -> proposer_pb2.ProposeResponse:
        from proposer_svc.core.tree_search import SearchRow

        s = self.start_msg.sampling
        search = SearchRow(budget.max_nodes, budget.max_depth, len(prompt), s.temperature, s.top_p, s.top_k, s.seed)
        request = HeadRequest(self.deliver, search, prompt[-1])
        self.loop.submit(_Open(self.key, request))
        # No tree for the bare prompt (no state yet): the answer asks for the states instead.
        want = proposer_pb2.HiddenStateRequest(dtype=proposer_pb2.HIDDEN_DTYPE_FLOAT16)
        return proposer_pb2.ProposeResponse(context_length=len(prompt), hidden_states=want)

    def take_states(self, states: proposer_pb2.HiddenStates, tokens: int) -> None:
        from specmesh_server.hidden import decode

        rows = decode(states, tokens, self.loop.head.arch.hidden_size)  # ValueError: refused by the stream
        self._state = rows[-1] if tokens else None

    def advance(self, tokens: list[int], budget: proposer_pb2.TreeBudget) -> None:
        state, self._state = self._state, None
        if tokens:
            self.loop.submit(_Advance(self.key, tokens, state, budget))


# --- process --------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadServerConfig:
    serving: ServingConfig = field(default_factory=lambda: ServingConfig("127.0.0.1:50065"))
    head: str = ""  # the head folder; "" = the target's cached head (trained once on first use)
    target: str | None = None  # the target's HF folder or .gguf; None = the default model
    train_minutes: float = 10.0  # first use without --head: training time of the cached head
    threads: int = 2  # the verifier idles while it waits for the head's trees: both cores draft
    max_batch: int = 32
    max_nodes: int = 12
    max_depth: int = 3  # a head forward per level (~2 ms each here), and the verifier waits for the tree
    width: int = 4
    branch: int = 4


def build_flags() -> ServiceFlags:
    """The head proposer's flags (``specmesh serve head --help``)."""
    d = HeadServerConfig()
    f = ServiceFlags("specmesh serve head", "SpecMesh learned-head proposer (drafts from the target's hidden states).")
    add_serving_flags(f, d.serving.address)
    f.add("--head", d.head, str, "head folder (`specmesh head train --out`); empty: the target's cached head")
    f.add("--target", d.target, str, "the target's HF folder or .gguf (its embedding and lm_head); unset: default")
    f.add("--train-minutes", d.train_minutes, float, "no --head, no cached head: train one this long first", minimum=0)
    f.add("--threads", d.threads, int, "torch threads (0 = torch's default)", minimum=0)
    add_tree_flags(f, d, "head forward")
    return f


def parse_args(argv: list[str] | None = None) -> HeadServerConfig:
    f = build_flags()
    a = f.parse(argv)
    return HeadServerConfig(
        serving=serving_config(f, a),
        head=a.head,
        target=a.target,
        train_minutes=a.train_minutes,
        threads=a.threads,
        **tree_settings(a),
    )


def load(cfg: HeadServerConfig) -> tuple[Path, Path, Head]:
    """(head folder, target folder, the head), trained first where none is cached; on the thread that
    will draft with it (``TorchThread``)."""
    import torch
    from transformers import AutoTokenizer

    from proposer_svc.head.proposer import load_head
    from proposer_svc.head.train import cached_head
    from specmesh_server.model_loading import resolve_model_path, tokenizer_hash

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    target = resolve_model_path(cfg.target)
    ident = tokenizer_hash(AutoTokenizer.from_pretrained(target))
    folder = Path(cfg.head) if cfg.head else cached_head(cfg.target, cfg.train_minutes)
    try:
        return folder, target, load_head(folder, target, ident)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"specmesh serve head: {exc}") from None


async def run(cfg: HeadServerConfig) -> None:
    import torch

    from proposer_svc.core.tree_search import DraftConfig

    thread = TorchThread("head-loop")  # trains or loads the head, then drafts with it
    folder, target, head = await thread.run(load, cfg)
    threads = await thread.run(torch.get_num_threads)  # the drafting thread's own OpenMP setting
    arch = head.arch
    print(
        f"head: {folder} ({sum(p.numel() for p in head.parameters())} parameters, draft vocabulary {arch.draft_vocab}) "
        f"over target {target}, {threads} threads",
        flush=True,
    )
    draft = DraftConfig(max_nodes=cfg.max_nodes, max_depth=cfg.max_depth, width=cfg.width, branch=cfg.branch)
    metrics = ProposerMetrics("head")
    loop = HeadLoop(head, draft, cfg.max_batch, metrics, thread)
    loop.start()
    config = StreamConfig(
        proposer="head",
        limits=cfg.serving.limits,
        max_nodes=cfg.max_nodes,
        max_depth=cfg.max_depth,
        vocab_size=arch.vocab_size,
        tokenizer_hash=arch.tokenizer_hash,
        pushed=True,
    )
    try:
        await serve_proposer(
            proposer_server(cfg.serving), ProposeStream(config, HeadStream.opener(loop), metrics), cfg.serving, "head"
        )
    finally:
        loop.stop()
        if loop.rounds:
            log.info("%d drafting rounds, %.2f ms mean", loop.rounds, 1e3 * loop.round_s / loop.rounds)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(parse_args(argv)))
