"""The verifier's kernel switches end to end, in process: an engine whose runner attends through the
tree-attention kernel and whose acceptance walks the batch in the acceptance kernel (``--attention
triton --device-accept on``) emits the same greedy tokens as one with both off, and as plain greedy
decoding of the model, on a tiny random Llama with deep, branching, partly rejected trees (CPU
tensors: Triton's interpreter)."""

from __future__ import annotations

import copy
import threading

import pytest
import support
import torch

from specmesh_server.model_runner import ModelRunner
from specmesh_server.tree import TokenTree
from verifier_svc.engine import Engine, EngineConfig
from verifier_svc.events import ErrorEvent, FinishEvent, TokenEvent
from verifier_svc.kernel_paths import check_kernel_device
from verifier_svc.proposer_client import ProposerLimits
from verifier_svc.request_speculation import RequestSpeculation
from verifier_svc.requests import GenerationRequest, SpecParams

VOCAB = 64  # support.tiny_llama's
PROMPTS = [[1, 5, 9, 2, 7, 3], [4, 4, 8], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
DEPTHS = [3, 1, 2]  # trees of 6, 2 and 4 nodes: ragged rows, so steps run packed
MAX_TOKENS = 10


class ToyTokenizer:
    """Token i reads " i" (the engine's window detokenizer needs ``decode`` alone)."""

    def decode(self, ids: list[int], **kw: object) -> str:
        return "".join(f" {i}" for i in ids)


class OracleSession:
    """A ``speculation.ProposerSession`` that knows the greedy continuation ``want``: up to ``depth``
    levels, each the right token beside a wrong sibling (either order, so accepted paths skip nodes),
    and now and then a level with no right token (a rejection mid-tree)."""

    name, failed, invalid_trees, hidden_dtype, sent, last_response = "oracle", None, 0, None, None, 0.0

    def __init__(self, prompt: list[int], want: list[int], depth: int) -> None:
        self.prompt, self.want, self.depth = prompt, want, depth
        self.limits = ProposerLimits(vocab_size=VOCAB, max_nodes=2 * depth, max_depth=depth)

    def take(self, context_length: int, recent: list[int] | None = None) -> TokenTree:
        k = context_length - len(self.prompt)  # output tokens so far
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for d, tok in enumerate(self.want[k : k + self.depth]):
            wrong = (tok + 1) % VOCAB
            hit = (k + d) % 4 != 3
            right = tok if hit else (tok + 2) % VOCAB
            first = len(tokens)
            tokens += [right, wrong] if (k + d) % 2 == 0 else [wrong, right]
            parents += [parent, parent]
            if not hit:
                break
            parent = first if (k + d) % 2 == 0 else first + 1
        self.sent = TokenTree(tokens, parents)
        return self.sent

    def has_tree_for(self, context_length: int) -> bool:
        return True

    def advance(self, tokens: list[int], hidden: object = None) -> None: ...

    def fail(self, reason: str) -> None: ...

    def close(self) -> None: ...


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish: FinishEvent | None = None
        self.done = threading.Event()

    def __call__(self, ev: object) -> None:
        assert not isinstance(ev, ErrorEvent), ev.message
        if isinstance(ev, TokenEvent):
            self.tokens += ev.token_ids
        elif isinstance(ev, FinishEvent):
            self.finish = ev
            self.done.set()


def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding, one full forward per token (no cache, no eos)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def serve(model: torch.nn.Module, kernels: bool, wants: list[list[int]]) -> tuple[list[Collector], int]:
    """The prompts, concurrently, through one engine with the kernels on or off → (outputs, steps)."""
    runner = ModelRunner(
        copy.deepcopy(model), torch.device("cpu"), torch.float32, 256, tree_kernel=kernels, block_size=16
    )
    assert runner.tree_kernel is kernels
    eng = Engine(runner, ToyTokenizer(), {2}, 256, EngineConfig(device_accept=kernels))
    try:
        spec = SpecParams("oracle", 0, 0, "", "")
        outs = [Collector() for _ in PROMPTS]
        for i, (prompt, want, out) in enumerate(zip(PROMPTS, wants, outs, strict=True)):
            req = GenerationRequest(f"r{i}", prompt, 0.0, 1.0, 0, 1, MAX_TOKENS, (), True, spec)
            eng.submit(req, out, RequestSpeculation.start(OracleSession(prompt, want, DEPTHS[i])))
        eng.start()  # after every submit: all join at the first step, so both runs take the same steps
        for out in outs:
            assert out.done.wait(300)
        return outs, eng.stats.steps
    finally:
        eng.shutdown()


@pytest.mark.usefixtures("cpu_kernels")
def test_greedy_output_with_both_kernels_on_equals_both_off_and_plain_greedy(monkeypatch):
    import specmesh_kernels.tree_attention as attention_kernel
    import verifier_svc.batch_accept as batch_accept

    launches = {"attention": 0, "accept": 0}
    real_attention, real_accept = attention_kernel.launch_tree_attention, batch_accept.accept_on_device

    def count(name, fn):
        def wrapped(*a, **k):
            launches[name] += 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(attention_kernel, "launch_tree_attention", count("attention", real_attention))
    monkeypatch.setattr(batch_accept, "accept_on_device", count("accept", real_accept))
    model = support.tiny_llama()
    wants = [greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    off, steps_off = serve(model, False, wants)
    assert launches == {"attention": 0, "accept": 0}
    on, steps_on = serve(model, True, wants)
    assert [o.tokens for o in on] == [o.tokens for o in off] == wants
    assert launches["attention"] > 0 and launches["accept"] == steps_on  # every forward and every step
    drafted = sum(o.finish.speculation.drafted for o in on)
    accepted = sum(o.finish.speculation.accepted for o in on)
    assert 0 < accepted < drafted and steps_on == steps_off < MAX_TOKENS - 1  # trees taken, and refused


@pytest.mark.usefixtures("cpu_kernels")
def test_forced_kernels_pass_the_start_up_check_where_the_interpreter_runs():
    check_kernel_device("triton", True, torch.device("cpu"))
