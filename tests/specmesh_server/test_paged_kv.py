"""The paged cache gives the slot cache's hidden states: a prefill, a step verifying ragged trees (padded
and packed; attention reading the blocks in place, over them gathered, and the tree-attention kernel)
and a plain step reading what the tree step wrote, with block tables scattered over the pool and
positions crossing blocks; and moving the accepted nodes' entries equals the slot cache's move."""

from __future__ import annotations

import copy

import pytest
import support
import torch

from specmesh_server import paged_kv
from specmesh_server.attention import Packing
from specmesh_server.kv_blocks import BlockTable
from specmesh_server.model_runner import ModelRunner
from specmesh_server.tree import TokenTree
from verifier_svc.step_inputs import decode_inputs, prefill_inputs, unpadded

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15], [16, 17]]
TREES = [TokenTree([20, 21, 22, 23, 24], [-1, 0, 0, 2, -1]), TokenTree([], []), TokenTree([30], [-1])]
TREES.append(TokenTree([40, 41, 42], [-1, 0, 1]))
BS = 4


@pytest.fixture(scope="module")
def tiny_llama():
    return support.tiny_llama()


class Rows:
    """The rows of each forward: slots 0..b-1 of a slot cache, or block tables grown to the positions
    the forward writes (scattered: the pool's free blocks are shuffled and none adjoins another)."""

    def __init__(self, runner: ModelRunner, b: int) -> None:
        self.runner, self.b = runner, b
        self.tables = [BlockTable(b"") for _ in range(b)]
        if self.paged:
            m = runner.cache.manager
            taken = m.pool.allocate(m.pool.free_blocks)
            torch.manual_seed(0)  # the even blocks free, in random order; the odd ones held: no two free blocks adjoin
            m.pool.release([taken[i] for i in torch.randperm(len(taken)).tolist() if taken[i] % 2 == 0])

    @property
    def paged(self) -> bool:
        return hasattr(self.runner.cache, "manager")

    def __call__(self, ends: list[int], kv_len: int):
        if not self.paged:
            return slice(0, self.b)
        for t, end in zip(self.tables, ends, strict=True):
            self.runner.cache.manager.grow(t, end)
        return self.runner.cache.rows(self.tables, kv_len)


def _steps(runner: ModelRunner, packed: bool) -> tuple[Rows, list[torch.Tensor]]:
    b, dev = len(PROMPTS), runner.device
    rows = Rows(runner, b)
    lengths = [len(p) for p in PROMPTS]
    first = prefill_inputs(PROMPTS, [0] * b, dev)
    hidden = runner.forward(rows(lengths, first.mask.shape[-1]), first.input_ids, first.positions, first.mask)
    out = [hidden[unpadded(lengths, dev)]]  # real tokens only: padding differs (it writes to scratch)
    step = decode_inputs([50 + i for i in range(b)], lengths, TREES, dev)
    counts = [len(t) + 1 for t in TREES]
    ends = [n + c for n, c in zip(lengths, counts, strict=True)]
    where = rows(ends, step.mask.shape[-1])
    real = unpadded(counts, dev)
    if packed:
        packing = Packing(*real, b, step.input_ids.shape[1])
        out.append(runner.forward(where, step.input_ids, step.positions, step.mask, step.write_pos, packing)[0])
    else:
        out.append(runner.forward(where, step.input_ids, step.positions, step.mask, step.write_pos)[real])
    after = decode_inputs([60 + i for i in range(b)], ends, [TREES[1]] * b, dev)
    where = rows([e + 1 for e in ends], after.mask.shape[-1])
    out.append(runner.forward(where, after.input_ids, after.positions, after.mask, after.write_pos))
    return rows, out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(
    "kernel,in_place,min_run",
    [(False, True, BS), (False, True, None), (False, False, None), (True, False, None)],
    ids=["in-place", "short-runs-copied", "gathered", "tree-kernel"],
)
def test_the_paged_cache_gives_the_slot_caches_hidden_states(
    tiny_llama, kernel, in_place, min_run, packed, monkeypatch
):
    if min_run is not None:  # every whole block a run read in place (by default runs this short are copied)
        monkeypatch.setattr(paged_kv, "MIN_RUN", min_run)
    if kernel:
        support.require_cpu_kernels()
    cpu, f32 = torch.device("cpu"), torch.float32
    slot = ModelRunner(copy.deepcopy(tiny_llama), cpu, f32, 256, tree_kernel=kernel)
    paged = ModelRunner(
        copy.deepcopy(tiny_llama), cpu, f32, 256, tree_kernel=kernel, kv_budget_bytes=2**20, block_size=BS
    )
    assert paged.cache.in_place == (not kernel)  # on a CPU the default reads blocks in place
    paged.cache.in_place = in_place
    (_, want) = _steps(slot, packed)
    contexts = []  # what the paged cache hands attention, per layer and forward
    update = paged.cache.update
    monkeypatch.setattr(
        paged.cache, "update", lambda *a, **k: contexts.append(type((out := update(*a, **k))[0])) or out
    )
    rows, got = _steps(paged, packed)
    expected = {paged_kv.BlockContext} if in_place else {torch.Tensor}
    assert set(contexts) == ({paged_kv.TableContext} if kernel else expected)  # the kernel reads through the table
    assert any(t.blocks != sorted(t.blocks) for t in rows.tables)  # tables really are scattered
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


def test_moving_the_accepted_nodes_entries_equals_the_slot_caches_move(tiny_llama):
    cpu, f32 = torch.device("cpu"), torch.float32
    slot = ModelRunner(copy.deepcopy(tiny_llama), cpu, f32, 256)
    paged = ModelRunner(copy.deepcopy(tiny_llama), cpu, f32, 256, kv_budget_bytes=2**20, block_size=BS)
    (_, _), (rows, _) = _steps(slot, False), _steps(paged, False)
    path, base = torch.tensor([0, 2, 3]), len(PROMPTS[0]) + 1  # row 0 accepts nodes 0, 2, 3
    slot.cache.gather_positions(0, path + base, base)
    paged.cache.copy_positions(rows.tables[0], path + base, base)
    n = base + len(path)
    table = paged.cache.rows(rows.tables[:1], n).table
    for layer in range(len(slot.cache.keys)):
        for dense, pool in ((slot.cache.keys[layer], paged.cache.keys[layer]),):
            positions = torch.arange(n)
            slots = table[0, positions // BS] * BS + positions % BS
            torch.testing.assert_close(pool[:, slots], dense[0, :, :n])


def test_a_ragged_prefill_never_writes_padding_into_a_rows_own_blocks(tiny_llama):
    """Row 0 brings 1 token at position 10 beside row 1's 5 from position 1: row 0's padding reaches
    position 14, past its own 11 positions (3 blocks), and must land in scratch, not in its block 2."""
    cpu, f32 = torch.device("cpu"), torch.float32
    slot = ModelRunner(copy.deepcopy(tiny_llama), cpu, f32, 256)
    paged = ModelRunner(copy.deepcopy(tiny_llama), cpu, f32, 256, kv_budget_bytes=2**20, block_size=BS)
    prompts = [list(range(1, 12)), [20, 21, 22, 23, 24, 25]]
    outs = []
    for runner in (slot, paged):
        tables = [BlockTable(b"") for _ in prompts]
        lengths = [0, 0]
        for chunks in ([prompts[0][:10], prompts[1][:1]], [prompts[0][10:], prompts[1][1:]]):
            step = prefill_inputs(chunks, lengths, cpu)
            ends = [n + len(c) for n, c in zip(lengths, chunks, strict=True)]
            if runner is paged:  # as the engine asks: tables grown to each row's end, rows up to the longest
                for t, end in zip(tables, ends, strict=True):
                    paged.cache.manager.grow(t, end)
                where = paged.cache.rows(tables, max(ends))
            else:
                where = slice(0, 2)
            runner.forward(where, step.input_ids, step.positions, step.mask)
            lengths = ends
        after = decode_inputs([30, 31], lengths, [TREES[1]] * 2, cpu)
        if runner is paged:
            for t, n in zip(tables, lengths, strict=True):
                paged.cache.manager.grow(t, n + 1)
            where = paged.cache.rows(tables, max(lengths) + 1)
        outs.append(runner.forward(where, after.input_ids, after.positions, after.mask, after.write_pos))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
