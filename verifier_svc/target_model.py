"""The target model as the engine serves it: loaded, its kernels checked, its step cost measured."""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import TYPE_CHECKING

from specmesh_router.cost_model import LiveStepCost
from verifier_svc.config import VerifierConfig
from verifier_svc.kernel_paths import (
    ATTENTION,
    KernelUnavailable,
    check_kernel_device,
    check_kernel_model,
    describe,
    static_steps,
)

if TYPE_CHECKING:
    from specmesh_server.model_loading import LoadedModel
    from specmesh_server.model_runner import ModelRunner
    from specmesh_server.tensor_parallel import Leader, Ranks, Shard
    from specmesh_server.thread_budget import ThreadBudget
    from verifier_svc.ranks import Group, Placement


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
    group: Group | None = None  # the other ranks, under tensor parallelism


def check_shardable(config: VerifierConfig, where: Placement) -> None:
    """Refuse now, before any rank starts, a degree the model cannot be sharded to (one line)."""
    from transformers import AutoConfig

    from specmesh_server.model_loading import resolve_model_path
    from specmesh_server.tensor_parallel import plan_shard

    plan_shard(AutoConfig.from_pretrained(resolve_model_path(config.model)), 0, where.world)


def _load(config: VerifierConfig, where: Placement | None, ranks: Ranks | None) -> tuple[LoadedModel, Shard | None]:
    """The model on this rank's device: whole, or (under tensor parallelism: ``ranks``) this rank's
    shard, cut on the host and then moved, so a device holds only its shard. The ranks load in turn:
    the host holds one whole model at a time, besides the shards already cut. Sets the process's torch
    threads first: ``--threads``, else (ranks on a CPU) the cores shared among the ranks."""
    import os

    import torch
    import torch.distributed as dist

    from specmesh_server.model_loading import load_model, pick_dtype
    from specmesh_server.tensor_parallel import plan_shard, shard_model

    if config.threads > 0:
        torch.set_num_threads(config.threads)
    elif ranks is not None and where.device.type == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // where.world))
    if ranks is None:
        return load_model(config.model, config.device, config.dtype), None
    dtype = str(pick_dtype(where.device, config.dtype)).removeprefix("torch.")
    for turn in range(where.world):
        if turn == where.rank:
            lm = load_model(config.model, "cpu", dtype)
            shard = plan_shard(lm.model.config, where.rank, where.world)
            shard_model(lm.model, shard, ranks.all_reduce)
            lm.model.to(where.device)
            gc.collect()  # the whole model's cut-off parts
        dist.barrier(group=ranks.start)
    return dataclasses.replace(lm, device=where.device), shard


def _ready(ranks: Ranks) -> None:
    """Every rank's runner built: from here rank 0 sends operations (or heartbeats) and the others
    wait for them, each wait bounded by --tensor-parallel-timeout. Until here (a slow rank loading,
    packing, allocating its KV cache) the ranks meet on the start-up group's longer bound."""
    import torch.distributed as dist

    dist.barrier(group=ranks.start)


def _runner(
    config: VerifierConfig,
    lm: LoadedModel,
    max_context: int,
    shard: Shard | None = None,
    ranks: Ranks | None = None,
    leader: Leader | None = None,
) -> ModelRunner:
    from specmesh_server.model_runner import ModelRunner

    return ModelRunner(
        lm.model,
        lm.device,
        lm.dtype,
        max_context,
        tree_kernel=ATTENTION[config.attention],
        linears=config.linears,
        kv_budget_bytes=config.kv_cache_bytes or None,  # None: the runner's default share of free memory
        block_size=config.block_size,
        prefix_caching=config.prefix_caching,
        shard=shard,
        ranks=ranks,
        leader=leader,
        threads=_thread_budget(config, lm, ranks),
    )


def _thread_budget(config: VerifierConfig, lm: LoadedModel, ranks: Ranks | None) -> ThreadBudget | None:
    """``--adaptive-threads``: on a CPU with one rank, the torch threads (at most those set now) follow the
    cores other processes leave free."""
    import torch

    from specmesh_server.thread_budget import ThreadBudget

    if not config.adaptive_threads or lm.device.type != "cpu" or ranks is not None:
        return None
    return ThreadBudget(torch.get_num_threads())


def _gguf_linears(config: VerifierConfig, lm: LoadedModel) -> None:
    """``--weights gguf``: the linear layers on the GGUF's own blocks (``gguf_weights``), said at start-up."""
    from specmesh_server.gguf_weights import serve_blocks

    try:
        print(f"verifier: weights: {serve_blocks(lm.model, config.model)}", flush=True)
    except ValueError as exc:
        raise KernelUnavailable(str(exc)) from exc


def _max_context(config: VerifierConfig, lm: LoadedModel) -> int:
    model_max = int(getattr(lm.model.config, "max_position_embeddings", 0) or 4096)
    return min(config.max_context or model_max, model_max)


def load_shard(config: VerifierConfig, where: Placement, ranks: Ranks) -> ModelRunner:
    """Ranks 1..N-1: this rank's shard in a runner built as rank 0 builds its own."""
    lm, shard = _load(config, where, ranks)
    runner = _runner(config, lm, _max_context(config, lm), shard, ranks)
    _ready(ranks)
    return runner


def load_target(config: VerifierConfig, where: Placement | None = None, spawned: list | None = None) -> LoadedTarget:
    """Load the model, pack its linears and measure its step cost. Runs on the thread that will
    run the engine: a second thread opening OpenMP regions would slow every step (``TorchThread``).
    ``where`` (tensor parallelism, rank 0): join the ranks (``spawned``: those this process started),
    load this rank's shard and drive the others' forwards."""

    from specmesh_server.metrics import ALL_REDUCES
    from specmesh_server.model_loading import pick_device
    from specmesh_server.model_runner import measure_step_cost

    # A kernel the flags force must run here: refused now, before the model loads (and imports triton).
    device = pick_device(config.device)
    check_kernel_device(config.attention, config.engine.device_accept, device)
    if config.weights == "gguf" and device.type != "cpu":
        raise KernelUnavailable(f"--weights gguf runs on the CPU kernel, not on {device}: use --device cpu")
    kernel = ATTENTION[config.attention]  # --cuda-graphs on where no static step can run: refused now too
    static_steps(
        config.cuda_graphs, device.type == "cuda" if kernel is None else kernel, device, config.tensor_parallel_size
    )
    t0 = time.perf_counter()
    group = None
    ranks = None
    if where is not None and where.world > 1:
        from specmesh_server.tensor_parallel import Leader
        from verifier_svc.ranks import Group, join, watch_spawned

        ranks = join(config, where)
        procs = list(spawned or [])
        group = Group(Leader(ranks, watch=watch_spawned(procs)), procs)
    lm, shard = _load(config, where, ranks)
    check_kernel_model(config.attention, lm.model.config)
    if config.weights == "gguf":
        _gguf_linears(config, lm)
    max_context = _max_context(config, lm)
    print(
        f"verifier: model {lm.name} from {lm.path} on {lm.device} ({lm.dtype}) in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    if shard is not None:
        print(
            f"verifier: tensor parallel over {shard.world} ranks ({'nccl' if where.device.type == 'cuda' else 'gloo'}, "
            f"timeout {config.tensor_parallel_timeout_s:g} s); {shard.describe()}; spawned ranks' pids: "
            f"{' '.join(str(p.pid) for p in group.procs) or 'none (launcher-started)'}",
            flush=True,
        )
    runner = _runner(config, lm, max_context, shard, ranks, group.leader if group is not None else None)
    if ranks is not None:
        _ready(ranks)
    kv_bytes = runner.cache.allocated_bytes
    paths = describe(runner.tree_kernel, runner.packs, config.engine.device_accept, lm.device)
    print(f"verifier: {paths}", flush=True)
    kv_tokens = runner.cache.token_budget
    print(
        f"verifier: KV cache budget {kv_bytes / 2**20:.0f} MiB{' per rank' if shard else ''} = {kv_tokens} "
        f"positions in blocks of "
        f"{config.block_size} ({kv_tokens // max_context} requests of the full {max_context}-token context); "
        f"prefix caching {'on' if config.prefix_caching else 'off'}",
        flush=True,
    )
    if runner.device.type == "cpu":
        from specmesh_server.packed_linear import describe as describe_linears
        from specmesh_server.thread_budget import describe as describe_threads

        print(f"verifier: linear layers: {describe_linears(runner.linears)} (--linears {runner.linears})", flush=True)
        print(f"verifier: {describe_threads(runner.threads)}", flush=True)
    if static_steps(config.cuda_graphs, runner.tree_kernel, lm.device, config.tensor_parallel_size):
        static = runner.use_static(config.engine.max_running, max_context, graphs=True)
        print(f"verifier: decode steps as static steps, {static.describe()} (--cuda-graphs off: none)", flush=True)
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
    ALL_REDUCES.take()  # the start-up measurement's all-reduces are no step's
    if group is not None:
        group.leader.start()
    return LoadedTarget(lm, runner, max_context, kv_tokens, step_cost, group)
