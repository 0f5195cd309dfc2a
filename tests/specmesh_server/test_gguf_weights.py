"""GGUF blocks served as they ship: the kernel multiplies them as ggml does (x quantized to int8 per 32
values, exact integer dot products), close to the dequantized product, a row's result does not depend on
the rows beside it, the shipped file's blocks are exactly the weights the float32 target runs,
and a verifier over them decodes speculatively token for token as it decodes plainly."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize
from support import start_verifier, stop_verifier, workload_prompts

from specmesh import Client, SamplingParams, SpecDecodeParams
from specmesh_kernels import cpu_linear
from specmesh_server import gguf_weights

pytestmark = pytest.mark.skipif(not cpu_linear.cpu_supported(), reason="this CPU has no AVX2/FMA")
KINDS = [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def _blocks(n: int, k: int, kind: GGMLQuantizationType, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """(uint8 blocks [n, k / 32 · bytes] of random weights quantized by gguf, their float32 weights [n, k])."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, kind)
    return torch.from_numpy(raw.copy()), dequantize(raw, kind).astype(np.float32)


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    from specmesh_server.packed_linear import gemv_supported

    assert gemv_supported()


def _packed(blocks: torch.Tensor, kind: GGMLQuantizationType) -> torch.Tensor:
    return cpu_linear.pack_gguf(blocks, int(kind))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,k,n", [(1, 64, 8), (3, 96, 16), (17, 576, 40), (5, 32, 8), (2, 1536, 24)])
def test_the_kernel_is_its_int8_reference_and_near_the_dequantized_product(kind, rows, k, n):
    blocks, w = _blocks(n, k, kind, seed=rows + k + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    got = cpu_linear.linear_gguf(x, _packed(blocks, kind), int(kind))
    assert torch.equal(got, cpu_linear.linear_gguf_reference(x, blocks, int(kind)))  # bit for bit
    exact = x @ torch.from_numpy(w).T  # what int8 activations cost: ~1 % of the outputs' scale
    assert (got - exact).abs().max() < 0.03 * exact.abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_integer_inputs_give_the_exact_integer_product(kind):
    """Blocks with scale 1 (and Q4_1's minimum 0) by rows whose every block holds ±127: every quantized value
    is the input itself, so each output is the integer dot product, exactly (no rounding anywhere)."""
    k, n, g = 256, 24, torch.Generator().manual_seed(7)
    one = torch.tensor([0, 60], dtype=torch.uint8)  # fp16 1.0
    if kind == GGMLQuantizationType.Q8_0:
        qw = torch.randint(-128, 128, (n, k // 32, 32), generator=g)  # −128 too: a file may hold it
        blocks = torch.cat([one.expand(n, k // 32, 2), qw.to(torch.int8).view(torch.uint8)], -1)
    else:
        qw = torch.randint(0, 16, (n, k // 32, 32), generator=g)
        qs = (qw[..., :16] | (qw[..., 16:] << 4)).to(torch.uint8)
        blocks = torch.cat([one.expand(n, k // 32, 2), torch.zeros(n, k // 32, 2, dtype=torch.uint8), qs], -1)
    x = torch.randint(-127, 128, (5, k // 32, 32), generator=g).float()
    x[:, :, 0] = 127.0  # every block's max: d = 1
    got = cpu_linear.linear_gguf(x.view(5, k), _packed(blocks.reshape(n, -1).contiguous(), kind), int(kind))
    assert torch.equal(got, (x.view(5, k).long() @ qw.reshape(n, k).T).float())


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_is_the_same_bits_whatever_rows_come_with_it(kind):
    """What makes speculation over quantized weights token-identical to plain decoding over them."""
    blocks, _ = _blocks(40, 320, kind, seed=5)
    x = torch.randn(19, 320, generator=torch.Generator().manual_seed(1))
    packed = _packed(blocks, kind)
    alone = torch.cat([cpu_linear.linear_gguf(x[i : i + 1], packed, int(kind)) for i in range(19)])
    for rows in range(2, 20):  # tiles of 8 (4 without VNNI) rows, then the rest
        assert torch.equal(cpu_linear.linear_gguf(x[:rows], packed, int(kind)), alone[:rows]), rows


@pytest.mark.parametrize("kind", KINDS)
def test_packing_keeps_the_files_bits(kind):
    blocks, _ = _blocks(16, 416, kind, seed=2)
    packed = _packed(blocks, kind)
    assert packed.shape == (2, blocks.numel() // 2)  # two groups of 8 rows, nothing added
    assert torch.equal(cpu_linear.unpack_gguf(packed, int(kind), 416), blocks)
    with pytest.raises(ValueError, match="multiple of 8"):
        _packed(blocks[:13], kind)


def test_the_kernel_refuses_blocks_that_do_not_fit():
    blocks, _ = _blocks(8, 64, GGMLQuantizationType.Q8_0, seed=0)
    packed = _packed(blocks, GGMLQuantizationType.Q8_0)
    with pytest.raises(RuntimeError, match="blocks"):
        cpu_linear.linear_gguf(torch.randn(1, 96), packed, int(GGMLQuantizationType.Q8_0))
    with pytest.raises(RuntimeError, match="pack_gguf"):  # the file's layout, not packed
        cpu_linear.linear_gguf(torch.randn(1, 64), blocks, int(GGMLQuantizationType.Q8_0))
    with pytest.raises(RuntimeError, match="Q8_0"):
        cpu_linear.linear_gguf(torch.randn(1, 64), packed, 2)


def test_the_shipped_files_blocks_are_the_float32_targets_weights(lm):
    """Every one of SmolLM2's 210 Q4_1 layers and its Q8_0 head, q/k rows un-permuted, dequantizes to
    exactly the weight transformers' conversion gave the float32 model."""
    import copy

    from specmesh_server.model_loading import default_gguf_path

    model = copy.deepcopy(lm.model)
    want = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    counts = gguf_weights.quantize_linears(model, default_gguf_path())
    assert counts == {"Q4_1": 210, "Q8_0": 1}
    for name, weight in want.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, gguf_weights.GGUFLinear)
        got = dequantize(layer.file_blocks().numpy(), GGMLQuantizationType(layer.kind))
        assert np.array_equal(got, weight.numpy()), name


@pytest.mark.slow
def test_a_verifier_over_the_blocks_decodes_speculatively_as_it_decodes_plainly(tmp_path, lm, chat_ids):
    v = start_verifier(tmp_path, "--weights", "gguf", "--proposer", "ngram-local=inprocess:ngram")
    try:
        assert "Q4_1" in v.log()
        prompts = [chat_ids(t) for t in workload_prompts(per_category=1, max_chars=1500)[:8]]
        greedy = SamplingParams(temperature=0.0, max_tokens=48)
        with Client(v.address) as c:

            def run(ids: list[int], proposer: str) -> list[int]:
                return c.complete(ids, greedy, SpecDecodeParams(proposer=proposer)).token_ids

            plain = [run(ids, "none") for ids in prompts]
            one = [run(ids, "ngram-local") for ids in prompts[:3]]
            with ThreadPoolExecutor(8) as pool:
                eight = list(pool.map(lambda ids: run(ids, "ngram-local"), prompts))
        assert one == plain[:3] and eight == plain
        assert all(len(p) == 48 or p[-1] in lm.tokenizer.all_special_ids for p in plain)
    finally:
        stop_verifier(v)


_ISA_SCRIPT = """
import sys, torch
from torch.utils.cpp_extension import load
from specmesh_kernels import cpu_linear
load(name="specmesh_cpu", sources=[str(p) for p in cpu_linear.SOURCES], extra_cflags=list(cpu_linear.BASE_CFLAGS),
     extra_ldflags=["-fopenmp"], build_directory=sys.argv[1], is_python_module=False)
cases = torch.load(sys.argv[2])
torch.save([cpu_linear.linear(*c) if c[2] is None else cpu_linear.linear_gguf(*c) for c in cases], sys.argv[3])
"""


@pytest.mark.slow
@pytest.mark.skipif(not cpu_linear.vnni_supported(), reason="this CPU builds the AVX2 kernel already")
def test_the_avx2_build_gives_the_avx512_builds_bits(tmp_path):
    """A CPU without AVX-512 VNNI takes maddubs/madd (and Q8_0's sign trick) where this one takes vpdpbusd: the
    same integers, so the same bits. Its float32 products take 8-lane tiles where this one's take pairs of rows
    in 16 lanes: the same multiply-adds per lane, so the same bits too. Built here without the AVX-512 flags,
    in a process of its own."""
    import subprocess
    import sys

    cases = []
    for kind in KINDS:
        for k in (576, 1536):
            blocks, _ = _blocks(48, k, kind, seed=k)
            x = torch.randn(11, k, generator=torch.Generator().manual_seed(k))  # tiles of 8 here, of 4 there
            cases.append((x, _packed(blocks, kind), int(kind)))
    for rows, k in ((2, 576), (11, 1536), (25, 100), (48, 13)):  # odd rows: a pair padded; k % 8: a tail
        gen = torch.Generator().manual_seed(rows)
        cases.append((torch.randn(rows, k, generator=gen), torch.randn(37, k, generator=gen), None))
    torch.save(cases, tmp_path / "in.pt")
    (tmp_path / "build").mkdir()
    script = [
        sys.executable,
        "-c",
        _ISA_SCRIPT,
        str(tmp_path / "build"),
        str(tmp_path / "in.pt"),
        str(tmp_path / "out.pt"),
    ]
    subprocess.run(script, check=True)
    for got, case in zip(torch.load(tmp_path / "out.pt"), cases, strict=True):
        assert torch.equal(got, cpu_linear.linear(*case) if case[2] is None else cpu_linear.linear_gguf(*case))
