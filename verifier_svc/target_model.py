"""The target model as the engine serves it: loaded, its kernels checked, its step cost measured."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from specmesh_router.cost_model import LiveStepCost
from verifier_svc.config import VerifierConfig
from verifier_svc.kernel_paths import ATTENTION, check_kernel_device, check_kernel_model, describe

if TYPE_CHECKING:
    from specmesh_server.model_loading import LoadedModel
    from specmesh_server.model_runner import ModelRunner


def eos_token_ids(model: object, tokenizer: object) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for x in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(x, int):
            ids.add(x)
        elif isinstance(x, list | tuple):
            ids.update(int(i) for i in x)
    return ids


@dataclasses.dataclass(frozen=True)
class LoadedTarget:
    """The target model as the engine serves it, built on the engine's thread (``load_target``)."""

    lm: LoadedModel
    runner: ModelRunner
    max_context: int
    kv_tokens: int  # KV cache positions the budget holds
    step_cost: LiveStepCost | None  # None: no proposers, or --spec-gating always


def load_target(config: VerifierConfig) -> LoadedTarget:
    """Load the model, pack its linears and measure its step cost. Runs on the thread that will
    run the engine: a second thread opening OpenMP regions would slow every step (``TorchThread``)."""
    import torch

    from specmesh_server.kv_cache import default_budget_bytes
    from specmesh_server.model_loading import load_model, pick_device
    from specmesh_server.model_runner import ModelRunner, measure_step_cost

    if config.threads > 0:
        torch.set_num_threads(config.threads)
    # A kernel the flags force must run here: refused now, before the model loads (and imports triton).
    check_kernel_device(config.attention, config.engine.device_accept, pick_device(config.device))
    t0 = time.perf_counter()
    lm = load_model(config.model, config.device, config.dtype)
    check_kernel_model(config.attention, lm.model.config)
    model_max = int(getattr(lm.model.config, "max_position_embeddings", 0) or 4096)
    max_context = min(config.max_context or model_max, model_max)
    print(
        f"verifier: model {lm.name} from {lm.path} on {lm.device} ({lm.dtype}) in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    kv_bytes = config.kv_cache_bytes or default_budget_bytes(lm.device)
    runner = ModelRunner(
        lm.model,
        lm.device,
        lm.dtype,
        max_context,
        tree_kernel=ATTENTION[config.attention],
        packed_linears=config.packed_linears,
        kv_budget_bytes=kv_bytes,
        block_size=config.block_size,
        prefix_caching=config.prefix_caching,
    )
    paths = describe(runner.tree_kernel, runner.packs, config.engine.device_accept, lm.device)
    print(f"verifier: {paths}", flush=True)
    kv_tokens = runner.cache.token_budget
    print(
        f"verifier: KV cache budget {kv_bytes / 2**20:.0f} MiB = {kv_tokens} positions in blocks of "
        f"{config.block_size} ({kv_tokens // max_context} requests of the full {max_context}-token context); "
        f"prefix caching {'on' if config.prefix_caching else 'off'}",
        flush=True,
    )
    if runner.packed_linears:
        print("verifier: linear layers run through oneDNN with pre-packed weights (--linears stock: off)", flush=True)
    step_cost = None
    if config.proposers and config.spec_gating == "cost":
        t1 = time.perf_counter()
        rows = tuple(r for r in (1, 2, 4, 8) if r <= max(config.engine.max_running, 1))
        table = measure_step_cost(runner, rows=rows)
        step_cost = LiveStepCost(table)  # corrected from every decode step the engine runs
        widths = ", ".join(
            f"{r}×[" + " ".join(f"{s / table.seconds[0][0]:.1f}" for s in row) + "]"
            for r, row in zip(table.rows, table.seconds, strict=True)
        )
        ctx = table.context
        context = (
            f"per cached key past {ctx.prefix}: {ctx.per_row_key * 1e6:.2f} µs per row + "
            f"{ctx.per_query_key * 1e6:.2f} µs per query"
            if ctx is not None
            else "context length not priced"
        )
        print(
            f"verifier: step cost (rows×[widths {', '.join(map(str, table.widths))}], vs 1×1 = "
            f"{table.seconds[0][0] * 1e3:.1f} ms) {widths}; {context}; measured in {time.perf_counter() - t1:.1f} s",
            flush=True,
        )
    return LoadedTarget(lm, runner, max_context, kv_tokens, step_cost)
