"""The static step (``static_step``, what a CUDA graph replays) on the CPU, eagerly, through the tree-attention
kernel in Triton's interpreter: the same hidden states and cache as the eager step it replaces, padding only
in the scratch block, inputs from one reused buffer with no host read of a device value, steps no bucket
holds run eagerly, and the engine's greedy output is the same with static steps on and off."""

from __future__ import annotations

import copy
import threading

import pytest
import support
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specmesh_kernels.tree_attention import tree_meta_from_trees
from specmesh_server.kv_blocks import BlockTable
from specmesh_server.model_runner import ModelRunner
from specmesh_server.tree import TokenTree
from verifier_svc.step_inputs import decode_inputs, prefill_inputs, unpadded

CPU = torch.device("cpu")
BS = 4
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15]]
# Ragged rows: a branching tree (6 tokens: bucket 9 pads three columns), none, one node; 3 rows: bucket 4.
TREES = [TokenTree([20, 21, 22, 23, 24], [-1, 0, 0, 2, -1]), TokenTree([], []), TokenTree([30], [-1])]


@pytest.fixture(scope="module")
def tiny_llama():
    support.require_cpu_kernels()
    return support.tiny_llama()


def _prefilled(model, device: torch.device = CPU) -> tuple[ModelRunner, list[BlockTable]]:
    runner = ModelRunner(copy.deepcopy(model).to(device), device, torch.float32, 256, tree_kernel=True,
                         block_size=BS, kv_budget_bytes=2**20)  # fmt: skip
    tables = []
    for prompt, tree in zip(PROMPTS, TREES, strict=True):
        tables.append(BlockTable(b""))
        runner.cache.manager.grow(tables[-1], len(prompt) + 1 + len(tree))
    first = prefill_inputs(PROMPTS, [0] * len(PROMPTS), device)
    runner.forward(runner.cache.rows(tables, max(map(len, PROMPTS))), first.input_ids, first.positions, first.mask)
    return runner, tables


def _eager(runner: ModelRunner, tables, pending, lengths, trees) -> torch.Tensor:
    dev = runner.device
    step = decode_inputs(pending, lengths, trees, dev)
    width = step.input_ids.shape[1]
    meta = tree_meta_from_trees([t.parents for t in trees], lengths, width, dev)
    rows = runner.cache.rows(tables, max(lengths) + width)
    hidden = runner.forward(rows, step.input_ids, step.positions, step.mask, step.write_pos, tree_meta=meta)
    return hidden[unpadded([len(t) + 1 for t in trees], dev)]


def _two_steps(runner: ModelRunner, tables, static: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree step, then a plain step that reads what it wrote → both steps' real tokens' states."""
    lengths = [len(p) for p in PROMPTS]
    if static:
        first = runner.static.forward([50, 51, 52], lengths, TREES, [t.blocks for t in tables])
    else:
        first = _eager(runner, tables, [50, 51, 52], lengths, TREES)
    after = [n + len(t) + 1 for n, t in zip(lengths, TREES, strict=True)]
    for table, n in zip(tables, after, strict=True):
        runner.cache.manager.grow(table, n + 1)
    plain = [TokenTree([], [])] * 3
    if static:
        return first, runner.static.forward([60, 61, 62], after, plain, [t.blocks for t in tables])
    return first, _eager(runner, tables, [60, 61, 62], after, plain)


def test_a_static_step_gives_the_eager_steps_states_and_cache(tiny_llama):
    eager_runner, eager_tables = _prefilled(tiny_llama)
    static_runner, static_tables = _prefilled(tiny_llama)
    static = static_runner.use_static(max_batch=4, max_context=64, graphs=True)  # no graphs on a CPU
    assert not static.captured and static.bucket(3, 6) == (4, 9)
    want = _two_steps(eager_runner, eager_tables, static=False)
    got = _two_steps(static_runner, static_tables, static=True)
    assert got[0].shape == (9, 48) and got[1].shape == (3, 48)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    assert static.counts.static == 2 and static.counts.replayed == 0
    # Negative control: a different tree (node 2 under node 1 instead of node 0) changes node 2's state.
    other, other_tables = _prefilled(tiny_llama)
    other.use_static(4, 64, graphs=False)
    wrong = [TokenTree([20, 21, 22, 23, 24], [-1, 0, 1, 2, -1]), *TREES[1:]]
    moved = other.static.forward([50, 51, 52], [len(p) for p in PROMPTS], wrong, [t.blocks for t in other_tables])
    assert (moved[3] - got[0][3]).abs().max() > 1e-3


def test_padding_writes_only_the_scratch_block(tiny_llama):
    runner, tables = _prefilled(tiny_llama)
    static = runner.use_static(4, 64, graphs=False)
    before = runner.cache._pools.clone()
    lengths = [len(p) for p in PROMPTS]
    static.forward([50, 51, 52], lengths, TREES, [t.blocks for t in tables])
    changed = (runner.cache._pools != before).flatten(0, 2).any(-1).any(0).nonzero().flatten().tolist()  # slots
    real = {
        t.blocks[p // BS] * BS + p % BS
        for t, n, tree in zip(tables, lengths, TREES, strict=True)
        for p in range(n, n + len(tree) + 1)
    }
    scratch = set(range(runner.cache.scratch * BS, (runner.cache.scratch + 1) * BS))
    assert set(changed) - scratch == real  # every real token written, nothing else outside the scratch block
    assert set(changed) & scratch  # the bucket's padding (a fourth row, three columns) went there


class HostReads(TorchDispatchMode):
    """Records every read of a tensor's value on the host (``item()``, ``int()``, ``bool()`` …) in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_inputs_come_from_one_reused_buffer_and_the_forward_reads_nothing_back(tiny_llama, monkeypatch):
    from specmesh_server.static_step import Layout

    runner, tables = _prefilled(tiny_llama)
    static = runner.use_static(4, 64, graphs=False)
    layout = Layout(4, 9, static.columns)
    views = layout.views(static._device)
    pointers = [v.data_ptr() for v in (views.input_ids, views.write_slots, views.table, views.start)]
    lengths = [len(p) for p in PROMPTS]
    static.forward([50, 51, 52], lengths, TREES, [t.blocks for t in tables])
    assert views.input_ids[0, :6].tolist() == [50, 20, 21, 22, 23, 24] and views.start[:3].tolist() == lengths
    listed: list[str] = []
    original = torch.Tensor.tolist

    def tolist(self):  # the interpreter reads its arguments on the host; SpecMesh's own code may not
        import inspect

        caller = inspect.stack()[1].filename
        if "triton" not in caller:
            listed.append(caller)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    mode = HostReads()
    with mode, torch.inference_mode():
        hidden = static._forward(layout)
    monkeypatch.undo()
    assert hidden.shape == (4, 9, 48)
    assert not listed, listed
    # The interpreter's own argument reads aside, nothing in the forward reads a value back.
    assert not [r for r in mode.reads if "triton" not in r], mode.reads
    assert [v.data_ptr() for v in (views.input_ids, views.write_slots, views.table, views.start)] == pointers


def test_a_step_no_bucket_holds_runs_eagerly(tiny_llama):
    runner, _ = _prefilled(tiny_llama)
    static = runner.use_static(4, 64, graphs=False)
    assert static.batches == (1, 2, 4) and static.widths[-1] == 64
    assert static.fits(4, 64) and not static.fits(5, 1) and not static.fits(1, 65)
    assert static.fits(1, 1, longest=static.columns * BS - 1) and not static.fits(1, 2, longest=static.columns * BS - 1)
    assert not static.replays(4, 64) and static.serves(4, 64)  # nothing captured: on a CPU it runs eagerly
    with pytest.raises(ValueError, match="fit no bucket"):  # more rows than any bucket
        static.forward([1] * 5, [3] * 5, [TokenTree([], [])] * 5, [[0]] * 5)


class OracleTrees:
    """A ``ProposerSession`` whose trees hold the next four tokens of the reference continuation behind a
    wrong first node (so accepted nodes move in the cache) and a chain of junk under that node, sized in
    turn 3, 70, 0, 8 and 16 nodes (70: wider than any bucket, so that step runs eagerly)."""

    SIZES = (3, 70, 0, 8, 16)

    def __init__(self, prompt_len: int, want: list[int], vocab: int) -> None:
        from verifier_svc.proposer_client import ProposerLimits

        self.name, self.limits = "oracle-trees", ProposerLimits(vocab, 80, 80)
        self.failed, self.invalid_trees, self.hidden_dtype, self.sent = None, 0, None, None
        self.last_response = 0.0
        self.prompt_len, self.want, self.vocab, self.turn = prompt_len, want, vocab, 0

    def take(self, context_length: int, recent: list[int] | None = None) -> TokenTree:
        size = self.SIZES[self.turn % len(self.SIZES)]
        self.turn += 1
        done = context_length - self.prompt_len
        right = self.want[done : done + min(4, size - 1)]
        k, junk = len(right), max(size - 1 - len(right), 0)
        wrong = (right[0] + 1) % self.vocab if right else 5
        tokens = ([wrong] + right + [7] * junk)[:size]
        chain = [-1, *range(1, k)][:k]  # node 1 under the root, node j under node j - 1
        parents = [-1, *chain, *[0, *range(k + 1, k + junk)][:junk]][:size]
        self.sent = TokenTree(tokens, parents)
        return self.sent

    def has_tree_for(self, context_length: int) -> bool:
        return True

    def advance(self, tokens: list[int], hidden: object = None) -> None:
        pass

    def fail(self, reason: str) -> None:
        self.failed = self.failed or reason

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_the_engines_greedy_output_is_generates_with_static_steps_on_and_off(tiny_llama, lm):
    from verifier_svc.engine import Engine, EngineConfig
    from verifier_svc.events import ErrorEvent, FinishEvent, TokenEvent
    from verifier_svc.request_speculation import RequestSpeculation
    from verifier_svc.requests import GenerationRequest, SpecParams

    n = 24
    prompts = [[1 + (7 * i + j) % 60 for j in range(5 + 3 * i)] for i in range(3)]
    with torch.inference_mode():
        want = [
            tiny_llama.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=n, do_sample=False, pad_token_id=2,
                                eos_token_id=None)[0, len(p):].tolist()
            for p in prompts
        ]  # fmt: skip
    outputs = {}
    for static in (True, False):
        runner = ModelRunner(copy.deepcopy(tiny_llama), CPU, torch.float32, 256, tree_kernel=True, block_size=BS,
                             kv_budget_bytes=2**20)  # fmt: skip
        if static:
            runner.use_static(4, 256, graphs=False)
        eng = Engine(runner, lm.tokenizer, {2}, 256, EngineConfig(max_running=4, device_accept=False))
        eng.start()
        got = [[] for _ in prompts]
        done = [threading.Event() for _ in prompts]
        errors = []

        def sink(i, got=got, done=done, errors=errors):
            def on(ev):
                if isinstance(ev, TokenEvent):
                    got[i] += ev.token_ids
                elif isinstance(ev, ErrorEvent):
                    errors.append(ev.message)
                    done[i].set()
                elif isinstance(ev, FinishEvent):
                    done[i].set()

            return on

        try:
            for i, p in enumerate(prompts):
                req = GenerationRequest(
                    f"r{i}", p, 0.0, 1.0, 0, 0, n, (), True, SpecParams("oracle-trees", 0, 80, "", "")
                )
                eng.submit(req, sink(i), RequestSpeculation.start(OracleTrees(len(p), want[i], runner.vocab_size)))
            assert all(d.wait(300) for d in done), got
        finally:
            eng.shutdown()
        assert not errors, errors
        outputs[static] = got
        if static:
            assert runner.static.counts.static > 0 and eng.stats.steps > runner.static.counts.static  # some eager
    assert outputs[True] == outputs[False] == want


class FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: ``replay`` reruns the bucket's forward into the
    graph's output (a faithful graph) or leaves it as it was (a graph replaying stale buffers)."""

    def __init__(self, static, layout, faithful: bool) -> None:
        self.static, self.layout, self.faithful = static, layout, faithful
        self.hidden = torch.zeros(layout.batch, layout.width, 48)

    def replay(self) -> None:
        if self.faithful:
            self.hidden.copy_(self.static._forward(self.layout))


@pytest.mark.parametrize("faithful", [True, False], ids=["faithful", "stale"])
def test_the_start_up_probe_keeps_graphs_only_where_a_replay_equals_the_eager_step(tiny_llama, faithful):
    from specmesh_server.static_step import Captured, Layout

    runner, _ = _prefilled(tiny_llama)
    static = runner.use_static(4, 64, graphs=False)
    for w in static.widths:
        graph = FakeGraph(static, Layout(1, w, static.columns), faithful)
        static.captured[(1, w)] = Captured(graph, graph.hidden)
    free = runner.cache.pool.free_blocks
    failure = static._probe()
    assert runner.cache.pool.free_blocks == free  # the probe's blocks went back
    assert (failure is None) == faithful, failure
    if not faithful:
        assert "disagreed with the eager step" in failure


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA graphs (the CPU tests above cover the static step)"
)
def test_on_cuda_replayed_graphs_give_the_eager_steps_states_and_cache():
    """The same two steps as on the CPU, replayed as captured CUDA graphs (``make gpu-check``'s suite)."""
    cuda = torch.device("cuda")
    model = support.tiny_llama()
    eager_runner, eager_tables = _prefilled(model, cuda)
    graph_runner, graph_tables = _prefilled(model, cuda)
    static = graph_runner.use_static(max_batch=4, max_context=64, graphs=True)
    assert static.failure is None and (4, 9) in static.captured, static.describe()
    want = _two_steps(eager_runner, eager_tables, static=False)
    got = _two_steps(graph_runner, graph_tables, static=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert static.counts.replayed == 2 and static.counts.static == 0
