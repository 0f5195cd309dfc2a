"""Shared fixtures: the real default model, real verifier processes on loopback, real prompts.

Helpers live in ``support.py``. Triton reads TRITON_INTERPRET once, when it is first imported
(transformers imports it through torch._dynamo): without CUDA it is turned on here, before any
test module imports anything, so the kernel tests run on the interpreter in the full suite too.

The model and the verifier processes run on the CPU in fp32 on a GPU host too (the reference
outputs they are compared with are computed on the CPU); tests of the GPU choose their device.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch
from support import VerifierProcess, start_verifier, stop_verifier

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def lm():
    """The default target model, loaded in the test process on the CPU in fp32 (reference outputs)."""
    from specmesh_server.model_loading import load_model, resolve_model_path

    if os.environ.get("SPECMESH_GPU_SUITE"):  # gpu-check's run of the suite: the weights do not travel there
        try:
            resolve_model_path()
        except Exception as exc:
            pytest.skip(f"the default model's weights are not on this machine ({type(exc).__name__})")
    torch.set_num_threads(2)
    return load_model(device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def chat_ids(lm):
    def encode(prompt: str) -> list[int]:
        ids = lm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    return encode


@pytest.fixture(scope="session")
def hf_greedy(lm):
    """transformers generate(do_sample=False), cached per (prompt ids, max_new_tokens)."""
    import torch

    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(ids), max_new_tokens)
        if key not in cache:
            with torch.inference_mode():
                out = lm.model.generate(
                    torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2
                )
            cache[key] = out[0, len(ids) :].tolist()
        return cache[key]

    return run


@pytest.fixture
def cpu_kernels() -> None:
    """For tests that run the Triton kernels on CPU tensors: skipped where the interpreter is off."""
    from support import require_cpu_kernels

    require_cpu_kernels()


@pytest.fixture(scope="module")
def verifier(tmp_path_factory, lm) -> Iterator[VerifierProcess]:
    """One verifier process per test module (the model is converted before, by ``lm``)."""
    v = start_verifier(tmp_path_factory.mktemp("verifier"))
    yield v
    stop_verifier(v)


@pytest.fixture
def engine_factory(lm):
    """In-process engines on the real model: ``make(runner_class=…, kv_budget_tokens=…, metrics=…,
    **EngineConfig fields)``; each is shut down after the test."""
    from specmesh_server.model_runner import ModelRunner
    from verifier_svc.engine import Engine, EngineConfig

    engines = []

    def make(runner_class=ModelRunner, kv_budget_tokens: int | None = None, metrics=None, **cfg) -> Engine:
        m = lm.model.config
        per_token = 2 * m.num_hidden_layers * m.num_key_value_heads * (m.hidden_size // m.num_attention_heads) * 4
        kv_bytes = None if kv_budget_tokens is None else kv_budget_tokens * per_token
        runner = runner_class(lm.model, lm.device, lm.dtype, max_context=8192, kv_budget_bytes=kv_bytes, block_size=16)
        assert (
            kv_budget_tokens is None or kv_budget_tokens - 32 < runner.cache.token_budget <= kv_budget_tokens
        )  # whole blocks and scratch
        eng = Engine(runner, lm.tokenizer, {2}, 8192, EngineConfig(**cfg), metrics=metrics)
        eng.start()
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.shutdown()
