"""A GGUF's quantized linear weights served as they ship: the Q4_1 / Q8_0 blocks kept, multiplied by
the CPU kernel (``specmesh_kernels.cpu_linear.linear_gguf``), ``--weights gguf``.

The model is loaded as always (the GGUF converted once into an HF folder, dequantized to float32);
then each linear layer whose GGUF tensor is in a supported block format is replaced by a
:class:`GGUFLinear` over that tensor's own bytes, and its float32 weight is let go. SmolLM2-135M's
file: 210 Q4_1 layers (66 MB instead of 425) and the tied output head in Q8_0 (30 MB instead of 113);
the input embedding stays float32 (a lookup reads one row per token).

The kernel multiplies in ggml's manner on a CPU (``cpu_linear.linear_gguf``; not its bits): each 32 values
of the input quantized to int8, each block's dot product exact in integers, one float multiply and add per
block; the blocks are repacked once at load, 8 weight rows interleaved (the same bits). Against the float32
target the model differs (by the input's int8 rounding, ~1 % of a product's scale, as llama.cpp's
does), so equality is checked against plain decoding of the same quantized weights. A row's result
does not depend on the rows beside it, but an int8 rounding can turn an ulp's difference in the
input into a whole step of it: so the rest of a step over these weights must not depend on the step
either, and attention runs in key order (:func:`order_attention`, ``attention.ordered_attention``):
a token's logits are the same bits decoded alone, in a tree or packed beside other rows, and
speculative decoding over these weights is token-identical to plain decoding over them.

llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k`` for its rotary layout;
transformers' loader undoes that on the dequantized weights, and the same permutation is applied here
to the rows of blocks (:func:`unpermute_rows`).
"""

from __future__ import annotations

import gc
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specmesh_kernels import cpu_linear
from specmesh_server.flags import ServiceFlags

# ggml's type numbers (gguf.GGMLQuantizationType) → bytes per block of 32 weights
BLOCK_BYTES = cpu_linear.BLOCK_BYTES

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFLinear(torch.nn.Module):
    """A bias-free linear layer over a GGUF tensor's blocks (the file's layout, uint8 [out, in / 32 · block
    bytes], ``out`` a multiple of 8), kept as :func:`cpu_linear.pack_gguf` regroups them for the kernel (``blocks``
    [out / 8, …], the same bits)."""

    def __init__(self, blocks: torch.Tensor, kind: int, in_features: int) -> None:
        super().__init__()
        if blocks.dtype != torch.uint8 or blocks.shape[1] != in_features // 32 * BLOCK_BYTES[kind]:
            raise ValueError(f"GGUF blocks {tuple(blocks.shape)} do not hold {in_features} weights a row")
        self.blocks, self.kind = cpu_linear.pack_gguf(blocks, kind), kind
        self.in_features, self.out_features = in_features, blocks.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        return cpu_linear.linear_gguf(x, self.blocks, self.kind)

    def file_blocks(self) -> torch.Tensor:
        """The blocks as the file holds them."""
        return cpu_linear.unpack_gguf(self.blocks, self.kind, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


def order_attention(model: torch.nn.Module) -> bool:
    """Mark ``model``'s attention modules for attention in key order (``attention.ordered_attention``) if
    any of its linears is on GGUF blocks; whether it did."""
    from specmesh_server.attention import mark_attention

    if not any(isinstance(m, GGUFLinear) for m in model.modules()):
        return False
    mark_attention(model, ordered=True)
    return True


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of a q/k weight's rows (transformers' ``_reverse_permute_weights``):
    within each head, the rows interleaved as (pair, half) go back to (half, pair).

    >>> unpermute_rows(np.arange(4)[:, None], heads=1)[:, 0].tolist()   # one head of 4 rows: 0 2 1 3
    [0, 2, 1, 3]
    """
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def tensor_modules(config: Any) -> dict[str, str]:
    """GGUF tensor name → the module it becomes in transformers' Llama (``lm_head`` from ``output``, or
    from the tied ``token_embd``)."""
    names = {
        f"blk.{i}.{gguf}.weight": f"model.layers.{i}.{hf}"
        for i in range(config.num_hidden_layers)
        for gguf, hf in _LAYER_TENSORS.items()
    }
    names["output.weight"] = "lm_head"
    if getattr(config, "tie_word_embeddings", False):
        names["token_embd.weight"] = "lm_head"
    return names


def quantize_linears(model: Any, gguf: Path) -> Counter[str]:
    """Replace ``model``'s linear layers by :class:`GGUFLinear` over ``gguf``'s blocks where the block
    format is supported; returns how many of each format (and ``float32`` for those left as they were)."""
    from gguf import GGMLQuantizationType, GGUFReader

    cfg = model.config
    if getattr(cfg, "model_type", "") != "llama":
        raise ValueError(f"--weights gguf serves Llama-architecture GGUFs, not {cfg.model_type!r}")
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    modules = tensor_modules(cfg)
    counts: Counter[str] = Counter()
    done: set[str] = set()
    for tensor in GGUFReader(gguf).tensors:
        path = modules.get(tensor.name)
        if path is None or path in done:
            continue
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        linear = getattr(parent, attr)
        kind = int(tensor.tensor_type)
        rows = np.asarray(tensor.data)  # uint8 [out, in / 32 · block bytes], the file's bytes
        if kind not in BLOCK_BYTES or rows.shape[0] % cpu_linear.GROUP:  # the kernel takes rows 8 at a time
            counts["float32"] += 1
            continue
        if ".attn_q." in tensor.name:
            rows = unpermute_rows(rows, heads)
        elif ".attn_k." in tensor.name:
            rows = unpermute_rows(rows, kv_heads)
        blocks = torch.from_numpy(np.ascontiguousarray(rows).copy())
        if blocks.shape[0] != linear.out_features or getattr(linear, "bias", None) is not None:
            raise ValueError(f"{tensor.name}: {tuple(blocks.shape)} blocks do not fit {path} ({linear})")
        setattr(parent, attr, GGUFLinear(blocks, kind, linear.in_features))
        counts[GGMLQuantizationType(kind).name] += 1
        done.add(path)
    return counts


WEIGHTS = ("fp32", "gguf")


def add_weights_flag(flags: ServiceFlags, gguf_note: str) -> None:
    """``--weights fp32|gguf``, shared by the services that run a model (``gguf_note``: what a GGUF run
    promises there)."""
    flags.add(
        "--weights",
        "fp32",
        str,
        "fp32 = the model's weights in float32 (a GGUF's dequantized once at conversion); gguf = a GGUF model's "
        "linear layers served from its own Q4_1 / Q8_0 blocks by SpecMesh's CPU kernel (4-bit weights read as "
        f"shipped; {gguf_note})",
        choices=list(WEIGHTS),
    )


def serve_blocks(model: Any, spec: str | None) -> str:
    """``--weights gguf``: ``model``'s linear layers on the blocks of the GGUF that ``spec`` (the service's
    ``--model``) names, its float32 weights let go; returns the start-up line's words. ValueError where that
    cannot run here (no CPU kernel, not a Llama GGUF); ``ModelNotFoundError`` for a model with no GGUF."""
    from specmesh_server.model_loading import gguf_source
    from specmesh_server.packed_linear import gemv_supported

    if not gemv_supported():
        raise ValueError("--weights gguf needs the CPU kernel (AVX2, FMA, F16C and a C++ compiler)")
    source = gguf_source(spec)
    counts = quantize_linears(model, source)
    gc.collect()  # the float32 weights of the layers swapped
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
    return f"the GGUF's own blocks from {source.name} ({kinds} linear layers; --weights gguf)"
