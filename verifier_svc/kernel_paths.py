"""Which paths tree verification takes: its attention (``--attention``) and its acceptance
(``--device-accept``), and the start-up checks that refuse a kernel the flags force but this
verifier cannot run.

The Triton kernels run compiled on CUDA tensors, and on CPU tensors only in Triton's interpreter
(``TRITON_INTERPRET=1`` before triton is first imported; ``specmesh_kernels``, imported first on a
machine without CUDA, sets it itself). A forced kernel is checked when the verifier starts, so a run
that asked for it neither measures without it nor fails at its first request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# --attention → ModelRunner(tree_kernel=…): None = the kernel on CUDA, SDPA elsewhere.
ATTENTION = {"auto": None, "triton": True, "sdpa": False}
# --device-accept → EngineConfig.device_accept: None = the kernel for CUDA logits, the host walk elsewhere.
DEVICE_ACCEPT = {"auto": None, "on": True, "off": False}
# --cuda-graphs → static steps: None = where the tree kernel runs on CUDA (graphs), True = wherever it runs.
CUDA_GRAPHS = {"auto": None, "on": True, "off": False}


class KernelUnavailable(RuntimeError):
    """A flag forces a Triton kernel this verifier cannot run; the message says which and why."""


def kernel_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device``'s tensors in this process; None where they can.

    Imports ``specmesh_kernels``: on a machine without CUDA, before anything imported triton, that
    turns the interpreter on (slow, but exact)."""
    try:
        from specmesh_kernels import _runtime, tree_accept, tree_attention
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    for kernel in (tree_attention._tree_attention_kernel, tree_accept._tree_accept_kernel):
        try:
            _runtime.runnable(kernel, device)
        except RuntimeError as exc:
            return str(exc)
    return None


def check_kernel_device(attention: str, device_accept: bool | None, device: torch.device) -> None:
    """Raise :class:`KernelUnavailable` where ``--attention triton`` or ``--device-accept on``
    forces a kernel that cannot run on ``device``. Call it before the model loads (which imports
    triton), so that on a machine without CUDA the interpreter can still be chosen."""
    forced = ["--attention triton"] if attention == "triton" else []
    forced += ["--device-accept on"] if device_accept else []
    if not forced:
        return
    why = kernel_unavailable(device)
    if why is not None:
        raise KernelUnavailable(
            f"{' and '.join(forced)}: the Triton kernels cannot run on {device} here: {why} "
            "(or choose --attention auto|sdpa, --device-accept auto|off)"
        )


def check_kernel_model(attention: str, model_config: object) -> None:
    """Raise :class:`KernelUnavailable` where ``--attention triton`` asks for the tree-attention
    kernel on a model it does not serve (sliding windows, soft-capping, attention sinks)."""
    from specmesh_server import attention as attention_fn

    if attention == "triton" and not attention_fn.supports(model_config):
        from specmesh_server.model_loading import text_config

        kind = getattr(text_config(model_config), "model_type", "") or "this model"
        raise KernelUnavailable(
            f"--attention triton: the tree-attention kernel does not serve {kind} (sliding-window, soft-capped "
            "or sink attention); choose --attention auto or sdpa"
        )


def describe(tree_kernel: bool, packs: bool, device_accept: bool | None, device: torch.device) -> str:
    """The start-up line's words for the paths a runner (``ModelRunner.tree_kernel``, ``.packs``) and
    the engine's ``device_accept`` take on ``device``.

    >>> import torch
    >>> describe(True, True, None, torch.device("cuda"))
    'tree attention triton, acceptance on device'
    >>> describe(False, True, None, torch.device("cpu"))
    'tree attention sdpa, acceptance host walk'
    >>> describe(True, True, True, torch.device("cpu"))
    'tree attention triton (Triton interpreter), acceptance on device (Triton interpreter)'
    """
    interpreted = "" if device.type == "cuda" else " (Triton interpreter)"
    if tree_kernel:
        attn = f"triton{interpreted}"
    else:
        attn = "sdpa" if packs else "transformers' own (a model the kernel does not serve)"
    on_device = device.type == "cuda" if device_accept is None else device_accept
    return f"tree attention {attn}, acceptance {f'on device{interpreted}' if on_device else 'host walk'}"


def static_steps(cuda_graphs: str, tree_kernel: bool, device: torch.device, tensor_parallel: int) -> bool:
    """Whether decode steps run as static steps (``static_step``; CUDA graphs on CUDA) under
    ``--cuda-graphs``; raises :class:`KernelUnavailable` where ``on`` asks for what cannot run.

    >>> import torch
    >>> static_steps("auto", True, torch.device("cuda"), 1), static_steps("auto", True, torch.device("cpu"), 1)
    (True, False)
    >>> static_steps("on", True, torch.device("cpu"), 1), static_steps("auto", True, torch.device("cuda"), 2)
    (True, False)
    """
    wanted = CUDA_GRAPHS[cuda_graphs]
    if wanted is None:
        return tree_kernel and device.type == "cuda" and tensor_parallel == 1
    if wanted and not tree_kernel:
        raise KernelUnavailable(
            "--cuda-graphs on: a static step reads the KV blocks through the tree-attention kernel, which this "
            "verifier does not run (choose --attention triton, or --cuda-graphs auto|off)"
        )
    if wanted and tensor_parallel > 1:
        raise KernelUnavailable(
            "--cuda-graphs on: static steps run at --tensor-parallel-size 1 only (choose --cuda-graphs auto|off)"
        )
    return wanted
