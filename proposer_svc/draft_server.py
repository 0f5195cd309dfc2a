"""``specmesh serve draft``: the draft-model proposer, one ``Propose`` stream per request.

The streams only queue events; one background thread owns the draft model and its slot KV
cache, applies the queued Start/Advance/End events (several Advances of one request coalesce:
only the newest context gets a tree), and drafts every request that is owed a tree in one
batched forward per draft step. The draft runs on its own ``--device`` and ``--threads``,
independent of the target's.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from proposer_svc.server import add_metrics_flag
from specmesh.server.metrics import ProposerMetrics
from specmesh.server.packed_linear import add_linears_flag
from specmesh.server.serving import new_server, serve
from specmesh.v1 import proposer_pb2, proposer_pb2_grpc

log = logging.getLogger(__name__)


def vocab_mismatch(draft: proposer_pb2.VocabIdentity, target: proposer_pb2.VocabIdentity) -> str:
    """Why this draft cannot propose for that target ('' when it can); an empty target field is not checked.

    >>> d = proposer_pb2.VocabIdentity(vocab_size=10, tokenizer_hash="ab")
    >>> vocab_mismatch(d, proposer_pb2.VocabIdentity(vocab_size=10, tokenizer_hash="ab"))
    ''
    >>> vocab_mismatch(d, proposer_pb2.VocabIdentity(vocab_size=12, tokenizer_hash="cd"))
    "draft vocabulary size 10 != target's 12; draft tokenizer hash 'ab' != target's 'cd'"
    """
    problems = []
    if target.vocab_size and draft.vocab_size != target.vocab_size:
        problems.append(f"draft vocabulary size {draft.vocab_size} != target's {target.vocab_size}")
    if target.tokenizer_hash and draft.tokenizer_hash != target.tokenizer_hash:
        problems.append(f"draft tokenizer hash {draft.tokenizer_hash!r} != target's {target.tokenizer_hash!r}")
    return "; ".join(problems)


@dataclass
class _Open:
    key: int
    state: Any  # RequestState
    deliver: Callable[[proposer_pb2.ProposeResponse | None], None]


@dataclass
class _Advance:
    key: int
    tokens: list[int]
    budget: proposer_pb2.TreeBudget | None


@dataclass
class _Close:
    key: int


class DraftLoop:
    """The batching thread: owns the Drafter (model + slot cache) and every request's state."""

    def __init__(self, drafter: Any, metrics: ProposerMetrics | None = None) -> None:
        self.drafter, self.metrics = drafter, metrics
        self._inbox: queue.SimpleQueue[_Open | _Advance | _Close | None] = queue.SimpleQueue()
        self._states: list[Any] = []  # index = slot
        self._by_key: dict[int, tuple[Any, Callable]] = {}
        self._deliver_to: dict[int, Callable] = {}  # id(state) → its stream's deliver
        self._thread = threading.Thread(target=self._run, name="draft-loop", daemon=True)
        self.proposals = 0
        self.propose_s = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def submit(self, event: _Open | _Advance | _Close) -> None:
        self._inbox.put(event)

    # --- batching thread ---------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        with torch.inference_mode():  # the slot cache holds inference tensors: every update stays inside
            self._serve()

    def _serve(self) -> None:
        while True:
            events = [self._inbox.get()]  # block for the first, then take whatever is queued
            while not self._inbox.empty():
                events.append(self._inbox.get())
            if any(e is None for e in events):
                return
            for ev in events:
                try:
                    self._apply(ev)
                except Exception:  # a bug must not stop the loop: end this stream, keep serving the rest
                    log.exception("draft loop: %s failed", type(ev).__name__)
                    got = self._by_key.get(getattr(ev, "key", -1))
                    if got is not None:
                        got[1](None)
            while any(s.wanted for s in self._states):
                self._propose_round()
                if not self._inbox.empty():  # newer Advances first: never draft for a stale context
                    break

    def _apply(self, ev: _Open | _Advance | _Close) -> None:
        if isinstance(ev, _Open):
            ev.state.slot = len(self._states)
            self._states.append(ev.state)
            self._by_key[ev.key] = (ev.state, ev.deliver)
            self._deliver_to[id(ev.state)] = ev.deliver
        elif isinstance(ev, _Advance):
            got = self._by_key.get(ev.key)
            if got is None:
                return
            state = got[0]
            state.advance(ev.tokens, self.drafter.runner.cache)
            if ev.budget is not None:
                state.max_nodes = ev.budget.max_nodes or state.max_nodes
                state.max_depth = ev.budget.max_depth or state.max_depth
        else:
            got = self._by_key.pop(ev.key, None)
            if got is None:
                return
            state = got[0]
            del self._deliver_to[id(state)]
            last = self._states.pop()
            if last is not state:  # refill the hole with the last slot: running slots stay 0..n-1
                length = min(len(last.context) + self.drafter.storage, self.drafter.runner.cache.seq_capacity)
                self.drafter.runner.cache.move_slot(last.slot, state.slot, length)
                last.slot = state.slot
                self._states[state.slot] = last

    def _propose_round(self) -> None:
        t0 = time.perf_counter()
        long_tail = 2 * self.drafter.storage  # longer uncached tails are prefilled on their own first
        for s in self._states:
            if s.wanted and (len(s.tail) > long_tail or not s.started):
                self.drafter.prefill(s, len(s.context) - 1)
            if s.wanted and not s.started:  # the prompt alone: prefill now, while the verifier prefills too
                s.wanted = False
                self._deliver(s, proposer_pb2.ProposeResponse(context_length=len(s.context)))
        batch = self.drafter.config.max_batch
        n = len(self._states)
        for start in range(0, n, batch):
            states = self._states[start : start + batch]
            busy = [s.wanted for s in states]
            if not any(busy):
                continue
            t_batch = time.perf_counter()
            try:
                trees = self.drafter.draft(slice(start, start + len(states)), states, busy)
            except Exception:  # a bug or OOM must not hang the streams: end them, keep serving
                log.exception("drafting failed")
                for s in states:
                    s.wanted = False
                    self._deliver(s, None)
                continue
            seconds = time.perf_counter() - t_batch  # one batched drafting serves every tree of the batch
            for s, tree in zip(states, trees, strict=True):
                if tree is not None:
                    if self.metrics is not None:
                        self.metrics.proposal(len(tree.tokens), seconds)
                    dists = [proposer_pb2.NodeDistribution(ids=i, probs=p) for i, p in tree.dists or ()]
                    msg = proposer_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents, distributions=dists)
                    self._deliver(s, proposer_pb2.ProposeResponse(context_length=tree.context_length, tree=msg))
        self.proposals += 1
        self.propose_s += time.perf_counter() - t0

    def _deliver(self, state: Any, resp: proposer_pb2.ProposeResponse | None) -> None:
        deliver = self._deliver_to.get(id(state))
        if deliver is not None:
            deliver(resp)


class DraftServicer(proposer_pb2_grpc.ProposerServiceServicer):
    def __init__(
        self,
        loop: DraftLoop,
        identity: proposer_pb2.VocabIdentity,
        max_nodes: int,
        max_depth: int,
        metrics: ProposerMetrics | None = None,
    ) -> None:
        self.loop, self.identity, self.metrics = loop, identity, metrics
        self.max_nodes, self.max_depth = max_nodes, max_depth
        self._keys = iter(range(1 << 62))

    def _bad_tokens(self, tokens: list[int]) -> str:
        bad = next((t for t in tokens if not 0 <= t < self.identity.vocab_size), None)
        return "" if bad is None else f"token id {bad} outside the draft vocabulary [0, {self.identity.vocab_size})"

    async def Propose(
        self, request_iterator: AsyncIterator[proposer_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[proposer_pb2.ProposeResponse]:
        from proposer_svc.draft import RequestState

        requests = request_iterator.__aiter__()
        try:
            first = await requests.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("event") != "start":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the first message must be start")
        start = first.start
        if problem := vocab_mismatch(self.identity, start.vocab):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"draft refused: {problem}")
        if not start.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start.prompt_token_ids: empty")
        if problem := self._bad_tokens(list(start.prompt_token_ids)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"start.prompt_token_ids: {problem}")
        s = start.sampling
        state = RequestState(
            request_id=start.request_id,
            context=list(start.prompt_token_ids),
            max_nodes=min(start.budget.max_nodes or self.max_nodes, self.max_nodes),
            max_depth=min(start.budget.max_depth or self.max_depth, self.max_depth),
            temperature=s.temperature,
            top_p=s.top_p if 0 < s.top_p <= 1 else 1.0,
            top_k=max(s.top_k, 0),
            seed=s.seed,
        )
        aio_loop = asyncio.get_running_loop()
        outbox: asyncio.Queue[proposer_pb2.ProposeResponse | tuple[grpc.StatusCode, str] | None] = asyncio.Queue()
        key = next(self._keys)
        self.loop.submit(_Open(key, state, lambda r: aio_loop.call_soon_threadsafe(outbox.put_nowait, r)))

        async def read() -> None:
            try:
                async for msg in requests:
                    kind = msg.WhichOneof("event")
                    if kind == "advance":
                        tokens = list(msg.advance.accepted_token_ids)
                        if problem := self._bad_tokens(tokens):
                            outbox.put_nowait((grpc.StatusCode.INVALID_ARGUMENT, f"advance: {problem}"))
                            return
                        budget = msg.advance.budget if msg.advance.HasField("budget") else None
                        self.loop.submit(_Advance(key, tokens, budget))
                    elif kind == "start":
                        outbox.put_nowait((grpc.StatusCode.FAILED_PRECONDITION, "start: stream already started"))
                        return
                    else:
                        break
                outbox.put_nowait(None)
            except (asyncio.CancelledError, grpc.RpcError):
                outbox.put_nowait(None)

        reader = asyncio.ensure_future(read())
        if self.metrics is not None:
            self.metrics.session_started()
        outcome = "error"
        try:
            while True:
                item = await outbox.get()
                if item is None:
                    outcome = "ok"
                    return
                if isinstance(item, tuple):
                    outcome = "rejected"
                    await context.abort(*item)
                yield item
        finally:
            reader.cancel()
            self.loop.submit(_Close(key))
            if self.metrics is not None:
                self.metrics.session_ended(outcome)


# --- process --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="specmesh serve draft", description="SpecMesh draft-model proposer.")
    p.add_argument("--address", default=env("SPECMESH_DRAFT_ADDRESS", "127.0.0.1:50062"), help="host:port")
    p.add_argument(
        "--model",
        default=env("SPECMESH_DRAFT_MODEL", "") or None,
        help="HF causal-LM folder or .gguf sharing the target's tokenizer (default: SmolLM2-135M-Instruct itself, "
        "which accepts everything and gains nothing; train one with `specmesh draft distill`)",
    )
    p.add_argument("--device", default=env("SPECMESH_DRAFT_DEVICE", "") or None, help="cpu, cuda, cuda:1 …")
    p.add_argument("--dtype", default=env("SPECMESH_DRAFT_DTYPE", "") or None, help="float32, bfloat16, float16")
    p.add_argument("--threads", type=int, default=int(env("SPECMESH_DRAFT_THREADS", "1")), help="torch threads")
    add_linears_flag(p, env("SPECMESH_DRAFT_LINEARS", "packed"))
    p.add_argument("--max-batch", type=int, default=int(env("SPECMESH_DRAFT_MAX_BATCH", "16")))
    p.add_argument("--max-nodes", type=int, default=int(env("SPECMESH_DRAFT_MAX_NODES", "16")))
    p.add_argument("--max-depth", type=int, default=int(env("SPECMESH_DRAFT_MAX_DEPTH", "6")))
    p.add_argument("--width", type=int, default=int(env("SPECMESH_DRAFT_WIDTH", "4")), help="frontier per level")
    p.add_argument("--branch", type=int, default=int(env("SPECMESH_DRAFT_BRANCH", "4")), help="children per node")
    p.add_argument("--max-context", type=int, default=int(env("SPECMESH_DRAFT_MAX_CONTEXT", "0")))
    p.add_argument("--grace", type=float, default=float(env("SPECMESH_GRACE_S", "30")))
    add_metrics_flag(p)
    return p.parse_args(argv)


async def run(a: argparse.Namespace) -> None:
    import torch

    from proposer_svc.draft import DraftConfig, Drafter
    from specmesh.server.model_loading import load_model, tokenizer_hash
    from specmesh.server.model_runner import ModelRunner

    if a.threads > 0:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    lm = load_model(a.model, a.device, a.dtype)
    text_cfg = lm.model.config.get_text_config()
    model_max = int(getattr(text_cfg, "max_position_embeddings", 0) or 4096)
    config = DraftConfig(
        max_nodes=a.max_nodes, max_depth=a.max_depth, width=a.width, branch=a.branch, max_batch=a.max_batch
    )
    max_context = min(a.max_context or model_max, model_max)
    runner = ModelRunner(lm.model, lm.device, lm.dtype, max_context, packed_linears=a.linears == "packed")
    identity = proposer_pb2.VocabIdentity(vocab_size=runner.vocab_size, tokenizer_hash=tokenizer_hash(lm.tokenizer))
    print(
        f"draft: model {lm.name} ({text_cfg.num_hidden_layers} layers) from {lm.path} on {lm.device} ({lm.dtype}), "
        f"{torch.get_num_threads()} threads, in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    metrics = ProposerMetrics("draft")
    loop = DraftLoop(Drafter(runner, config), metrics)
    loop.start()
    server = new_server()
    servicer = DraftServicer(loop, identity, config.max_nodes, config.max_depth, metrics)
    proposer_pb2_grpc.add_ProposerServiceServicer_to_server(servicer, server)
    name = proposer_pb2.DESCRIPTOR.services_by_name["ProposerService"].full_name
    try:
        await serve(
            server, a.address, [name], grace_s=a.grace, ready_message="draft proposer", metrics_port=a.metrics_port
        )
    finally:
        loop.stop()
        if loop.proposals:
            log.info("%d proposal rounds, %.1f ms mean", loop.proposals, 1e3 * loop.propose_s / loop.proposals)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(parse_args(argv)))
