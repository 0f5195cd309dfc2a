"""``specmesh serve draft``: the draft-model proposer, one ``Propose`` stream per request.

The streams only queue events; one background thread owns the draft model and its slot KV
cache, applies the queued Start/Advance/End events (several Advances of one request coalesce:
only the newest context gets a tree), and drafts every request that is owed a tree in one
batched forward per draft step. The draft runs on its own ``--device`` and ``--threads``,
independent of the target's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proposer_svc.core.event_thread import Close, EventThread, QueuedCore
from proposer_svc.core.process import ServingConfig, add_serving_flags, proposer_server, serve_proposer, serving_config
from proposer_svc.core.stream import Deliver, ProposeStream, StreamConfig, StreamLimits
from proposer_svc.core.tree_flags import add_tree_flags, tree_settings
from proposer_svc.core.tree_message import tree_response
from specmesh.v1 import proposer_pb2
from specmesh_server.flags import ServiceFlags
from specmesh_server.gguf_weights import add_weights_flag
from specmesh_server.log_limit import RateLimitedLog
from specmesh_server.metrics import ProposerMetrics
from specmesh_server.packed_linear import add_linears_flag
from specmesh_server.torch_thread import TorchThread

if TYPE_CHECKING:
    from proposer_svc.core.tree_search import DraftConfig

log = logging.getLogger(__name__)
errors = RateLimitedLog(log)  # a persistent failure (OOM, a bug) repeats every round: one line per 10 s


@dataclass
class _Open:
    key: int
    state: Any  # RequestState
    deliver: Deliver


@dataclass
class _Advance:
    key: int
    tokens: list[int]
    budget: proposer_pb2.TreeBudget  # the stream's, already within this proposer's limits


class DraftLoop(EventThread):
    """The batching thread: owns the Drafter (model + slot cache) and every request's state."""

    def __init__(self, drafter: Any, metrics: ProposerMetrics | None = None, thread: TorchThread | None = None) -> None:
        super().__init__("draft-loop", thread)
        self.drafter, self.metrics = drafter, metrics
        self._states: list[Any] = []  # index = slot
        self._by_key: dict[int, tuple[Any, Deliver]] = {}
        self._deliver_to: dict[int, Deliver] = {}  # id(state) → its stream's deliver
        self.proposals = 0
        self.propose_s = 0.0

    # --- batching thread ---------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        with torch.inference_mode():  # the slot cache holds inference tensors: every update stays inside
            self._serve()

    def _serve(self) -> None:
        while (events := self._events()) is not None:
            self._apply_all(events)  # one failing event ends its own stream only
            while any(s.wanted for s in self._states):
                self._propose_round()
                if self._pending():  # newer Advances first: never draft for a stale context
                    break

    def _end(self, key: int | None) -> None:
        got = self._by_key.get(key)
        if got is not None:
            got[1](None)

    def _apply(self, ev: _Open | _Advance | Close) -> None:
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
                errors.error("draft", "drafting failed", exc_info=True)
                for s in states:
                    s.wanted = False
                    self._deliver(s, None)
                continue
            seconds = time.perf_counter() - t_batch  # one batched drafting serves every tree of the batch
            for s, tree in zip(states, trees, strict=True):
                if tree is not None:
                    if self.metrics is not None:
                        self.metrics.proposal(len(tree.tokens), seconds)
                    self._deliver(s, tree_response(tree.context_length, tree))
        self.proposals += 1
        self.propose_s += time.perf_counter() - t0

    def _deliver(self, state: Any, resp: proposer_pb2.ProposeResponse | None) -> None:
        deliver = self._deliver_to.get(id(state))
        if deliver is not None:
            deliver(resp)


class DraftStream(QueuedCore):
    """One stream's ``ProposalCore``: queues its events for the loop, which delivers the trees."""

    loop: DraftLoop

    def start(self, prompt: list[int], budget: proposer_pb2.TreeBudget) -> None:
        from proposer_svc.draft.proposer import RequestState

        start, s = self.start_msg, self.start_msg.sampling
        state = RequestState(
            request_id=start.request_id,
            context=prompt,
            max_nodes=budget.max_nodes,
            max_depth=budget.max_depth,
            temperature=s.temperature,
            top_p=s.top_p if 0 < s.top_p <= 1 else 1.0,
            top_k=max(s.top_k, 0),
            seed=s.seed,
        )
        self.loop.submit(_Open(self.key, state, self.deliver))

    def advance(self, tokens: list[int], budget: proposer_pb2.TreeBudget) -> None:
        self.loop.submit(_Advance(self.key, tokens, budget))


def draft_stream_config(
    identity: proposer_pb2.VocabIdentity, config: DraftConfig, limits: StreamLimits
) -> StreamConfig:
    """Budgets capped by the drafter's (``DraftConfig``) within what a stream may ask (``limits``);
    the target's vocabulary must be the draft's."""
    return StreamConfig(
        proposer="draft",
        limits=limits,
        max_nodes=config.max_nodes,
        max_depth=config.max_depth,
        vocab_size=identity.vocab_size,
        tokenizer_hash=identity.tokenizer_hash,
        pushed=True,
    )


# --- process --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftServerConfig:
    serving: ServingConfig = field(default_factory=lambda: ServingConfig("127.0.0.1:50062"))
    model: str | None = None  # None = the default model (the target itself)
    device: str | None = None
    dtype: str | None = None
    threads: int = 1  # torch threads; 0 = torch's default
    linears: str = "gemv"  # CPU float32 linears: gemv, packed or stock (``packed_linear``)
    weights: str = "fp32"  # fp32, or gguf: the GGUF's own Q4_1 / Q8_0 blocks on the CPU kernel (``gguf_weights``)
    max_context: int = 0  # 0 = the model's max_position_embeddings
    max_batch: int = 16
    max_nodes: int = 16
    max_depth: int = 6
    width: int = 4
    branch: int = 4


def build_flags() -> ServiceFlags:
    """The draft proposer's flags (``specmesh serve draft --help``)."""
    d = DraftServerConfig()
    f = ServiceFlags("specmesh serve draft", "SpecMesh draft-model proposer.")
    add_serving_flags(f, d.serving.address)
    f.add(
        "--model",
        None,
        str,
        "HF causal-LM folder or .gguf sharing the target's tokenizer; unset: SmolLM2-135M-Instruct itself, "
        "which accepts everything and gains nothing (train a draft with `specmesh draft distill`)",
    )
    f.add("--device", None, str, "cpu, cuda, cuda:1 …; unset: the GPU if present")
    f.add("--dtype", None, str, "float32, bfloat16, float16; unset: float32 on CPU, bfloat16 on GPU")
    f.add("--threads", d.threads, int, "torch threads (0 = torch's default)", minimum=0)
    add_linears_flag(f)
    add_weights_flag(f, "CPU, float32; the drafts are the blocks' guesses, the verifier keeps the output exact")
    add_tree_flags(f, d, "forward")
    f.add("--max-context", d.max_context, int, "context tokens per request (0 = the model's maximum)", minimum=0)
    return f


def parse_args(argv: list[str] | None = None) -> DraftServerConfig:
    f = build_flags()
    a = f.parse(argv)
    serving = serving_config(f, a)
    device = a.device or ("cpu" if a.weights == "gguf" else None)  # the GGUF kernel's device, unless named
    if a.weights == "gguf" and (a.dtype not in (None, "float32") or device.split(":")[0] != "cpu"):
        f.parser.error("--weights gguf drafts on the CPU kernel in float32: --device cpu, no other --dtype")
    return DraftServerConfig(
        serving=serving,
        model=a.model,
        device=device,
        dtype=a.dtype,
        threads=a.threads,
        linears=a.linears,
        weights=a.weights,
        max_context=a.max_context,
        **tree_settings(a),
    )


def load_draft(cfg: DraftServerConfig) -> tuple[Any, Any]:
    """The draft model and its runner, loaded on the thread that will draft with them (``TorchThread``)."""
    import torch

    from specmesh_server.model_loading import load_model
    from specmesh_server.model_runner import ModelRunner

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    lm = load_model(cfg.model, cfg.device, cfg.dtype)
    if cfg.weights == "gguf":
        from specmesh_server.gguf_weights import serve_blocks

        print(f"draft: weights: {serve_blocks(lm.model, cfg.model)}", flush=True)
    text_cfg = lm.model.config.get_text_config()
    model_max = int(getattr(text_cfg, "max_position_embeddings", 0) or 4096)
    max_context = min(cfg.max_context or model_max, model_max)
    # No tree-attention kernel: a draft level's mask (the candidates' storage slots) is not the kernel's
    # prefix-and-window form, so on CUDA every forward would pay a device read to find that out.
    runner = ModelRunner(lm.model, lm.device, lm.dtype, max_context, tree_kernel=False, linears=cfg.linears)
    return lm, runner


async def run(cfg: DraftServerConfig) -> None:
    import torch

    from proposer_svc.core.tree_search import DraftConfig
    from proposer_svc.draft.proposer import Drafter
    from specmesh_server.model_loading import tokenizer_hash

    t0 = time.perf_counter()
    thread = TorchThread("draft-loop")  # loads the draft model, then drafts with it
    lm, runner = await thread.run(load_draft, cfg)
    text_cfg = lm.model.config.get_text_config()
    config = DraftConfig(
        max_nodes=cfg.max_nodes, max_depth=cfg.max_depth, width=cfg.width, branch=cfg.branch, max_batch=cfg.max_batch
    )
    identity = proposer_pb2.VocabIdentity(vocab_size=runner.vocab_size, tokenizer_hash=tokenizer_hash(lm.tokenizer))
    threads = await thread.run(torch.get_num_threads)  # the drafting thread's own OpenMP setting
    print(
        f"draft: model {lm.name} ({text_cfg.num_hidden_layers} layers) from {lm.path} on {lm.device} ({lm.dtype}), "
        f"{threads} threads, in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    metrics = ProposerMetrics("draft")
    loop = DraftLoop(Drafter(runner, config), metrics, thread)
    loop.start()
    servicer = ProposeStream(
        draft_stream_config(identity, config, cfg.serving.limits), DraftStream.opener(loop), metrics
    )
    try:
        await serve_proposer(proposer_server(cfg.serving), servicer, cfg.serving, "draft")
    finally:
        loop.stop()
        if loop.proposals:
            log.info("%d proposal rounds, %.1f ms mean", loop.proposals, 1e3 * loop.propose_s / loop.proposals)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(parse_args(argv)))
