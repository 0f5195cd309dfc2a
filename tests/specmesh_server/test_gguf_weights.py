"""GGUF blocks served as they ship: the kernel computes the dequantized product, a row's result does not
depend on the rows beside it, the shipped file's blocks are exactly the weights the float32 target runs,
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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,k,n", [(1, 64, 8), (3, 96, 13), (17, 576, 40), (5, 32, 1)])
def test_the_kernel_equals_the_dequantized_product(kind, rows, k, n):
    blocks, w = _blocks(n, k, kind, seed=rows + k + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    got = cpu_linear.linear_gguf(x, blocks, int(kind))
    ref = cpu_linear.linear_gguf_reference(x, blocks, int(kind))
    torch.testing.assert_close(ref, x @ torch.from_numpy(w).T, rtol=1e-5, atol=1e-4)  # the reference: gguf's own
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_is_the_same_bits_whatever_rows_come_with_it(kind):
    """What makes speculation over quantized weights token-identical to plain decoding over them."""
    blocks, _ = _blocks(37, 128, kind, seed=5)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([cpu_linear.linear_gguf(x[i : i + 1], blocks, int(kind)) for i in range(9)])
    for rows in range(2, 10):  # 2-4 rows: blocks dequantized in registers; 5 and more: through the buffer
        assert torch.equal(cpu_linear.linear_gguf(x[:rows], blocks, int(kind)), alone[:rows]), rows


def test_q8_0_is_the_float32_kernel_over_the_dequantized_weights():
    """Every output is the float32 kernel's sum over its dequantized row (Q8_0: w = d · q, one rounding,
    as torch's product rounds)."""
    blocks, _ = _blocks(21, 192, GGMLQuantizationType.Q8_0, seed=3)
    w = cpu_linear.dequantize_reference(blocks, int(GGMLQuantizationType.Q8_0))
    for rows in (1, 3, 4, 7):
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
        got = cpu_linear.linear_gguf(x, blocks, int(GGMLQuantizationType.Q8_0))
        assert torch.equal(got, cpu_linear.linear(x, w, None)), rows


def test_the_kernel_refuses_blocks_that_do_not_fit():
    blocks, _ = _blocks(8, 64, GGMLQuantizationType.Q8_0, seed=0)
    with pytest.raises(RuntimeError, match="blocks"):
        cpu_linear.linear_gguf(torch.randn(1, 96), blocks, int(GGMLQuantizationType.Q8_0))
    with pytest.raises(RuntimeError, match="Q8_0"):
        cpu_linear.linear_gguf(torch.randn(1, 64), blocks, 2)


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
        got = dequantize(layer.blocks.numpy(), GGMLQuantizationType(layer.kind))
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
